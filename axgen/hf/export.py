"""`axgen export-hf`: a program's params (the newest checkpoint of a run, or an `axgen convert-hf` checkpoint) as
a Hugging Face model folder: sharded safetensors, their index, a config.json, and the tokenizer's files.

The config is the spec's, written in the keys of its family's transformers config class, so that
`AutoModelForCausalLM.from_pretrained` builds the same model; `axgen import-hf` reads it back to the same spec.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from axgen.files import check_replaceable, staging_dir
from axgen.hf.families import ARCHITECTURES, expert_layout, family, family_names, hub_tensors
from axgen.hf.weights import DTYPES
from axgen.interop import CheckpointError, host_jax, iter_hf_tensors
from axgen.runtime.checkpoints import host_checksum
from axgen.spec import Model
from axgen.data.chat import load_chat_template
from axgen.data.tokenizer import load_tokenizer

SAFETENSORS_DTYPES = {np.dtype(dtype): name for name, dtype in DTYPES.items()}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",  # transformers prefers it to tokenizer_config.json's chat_template
)


# The families that state a RoPE on part of each head in adjacent pairs, and routed experts' weights scaled.
LAYOUT_FAMILIES = {"deepseek_v2", "deepseek_v3"}


# The families whose config states DeepSeek's routing (FAMILY_KEYS write it and refuse what theirs cannot say).
DEEPSEEK_FAMILIES = {"deepseek_v2", "deepseek_v3"}


def _refuse_deepseek_routing(moe) -> None:
    """DeepSeek's routing (F.moe scoring, correction bias, groups, leading dense layers) has no exported family yet:
    a Mixtral or Qwen config would state another model."""
    if moe is None:
        return
    fields = {
        "scoring": moe.scoring != "softmax",
        "balance_bias_rate": moe.balance_bias_rate is not None,
        "n_group": moe.n_group is not None,
        "first_dense_layers": moe.first_dense_layers > 0,
    }
    for name, set_here in fields.items():
        if set_here:
            raise CheckpointError(
                f"{moe.origin}: MoE.{name}={getattr(moe, name)!r}: no family axgen exports routes as DeepSeek does"
            )


def hf_config(spec: Model, dtype: str) -> dict:
    """config.json of the spec, in its family's transformers 4.x keys (which transformers 5 reads too)."""
    name = family(spec)
    attention, rope = spec.decoder.attention, spec.feature("rope")
    moe = spec.feature("moe")
    if moe is not None and moe.routed_scale is not None and name not in LAYOUT_FAMILIES:
        raise CheckpointError(
            f"{moe.origin}: MoE.routed_scale={moe.routed_scale}: no family axgen exports scales its routed experts"
        )
    if name not in DEEPSEEK_FAMILIES:
        _refuse_deepseek_routing(moe)
    if (rope.rotary_dim is not None or rope.interleaved) and name not in LAYOUT_FAMILIES:
        raise CheckpointError(
            f"{rope.origin}: RoPE.rotary_dim={rope.rotary_dim}, interleaved={rope.interleaved}: "
            "no family axgen exports rotates part of a head or adjacent pairs"
        )
    config = {
        "architectures": [ARCHITECTURES[name]],
        "model_type": name,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.d_model,
        "intermediate_size": spec.decoder.mlp.hidden_dim,
        "num_hidden_layers": spec.decoder.num_layers,
        "num_attention_heads": attention.num_heads,
        "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.decoder.norm.eps,
        "rope_theta": rope.theta,
        "rope_scaling": _rope_scaling(rope.scaling),
        "tie_word_embeddings": spec.tie_embeddings,
        "max_position_embeddings": _max_position(spec),
        "torch_dtype": dtype,
    }
    # Qwen2's q, k and v biases are implied by its model type; the others say they have none.
    no_bias = {} if name in ("qwen2", "qwen2_moe") else {"attention_bias": False}
    config = config | no_bias | FAMILY_KEYS[name](spec)
    if "rope_parameters" in config:  # a family that must state its RoPE in transformers 5's key (gpt-oss)
        del config["rope_theta"], config["rope_scaling"]
    return config


def _max_position(spec: Model) -> int:
    """The longest sequence the model was meant for: what it trains on, or what its RoPE scaling stretches to
    (linear scaling states no original length: what it trains on)."""
    trained = spec.train.seq_len if spec.train else 4096
    scaling = spec.feature("rope").scaling
    if scaling is None or scaling.rule == "linear":
        return trained
    return max(trained, int(scaling.original_max_position * scaling.factor))


def _rope_scaling(scaling) -> dict | None:
    if scaling is None:
        return None
    return ROPE_SCALINGS[scaling.rule](scaling)


ROPE_SCALINGS = {
    "llama3": lambda scaling: {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position,
    },
    "linear": lambda scaling: {"rope_type": "linear", "factor": scaling.factor},
    # Every value stated, the attention factor too, so that transformers' defaults decide nothing.
    "yarn": lambda scaling: {
        "rope_type": "yarn",
        "factor": scaling.factor,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
        "original_max_position_embeddings": scaling.original_max_position,
        "attention_factor": scaling.attention_factor,
        "truncate": scaling.truncate,
    },
}


def _mistral(spec: Model) -> dict:
    window = spec.feature("sliding_window")
    if window is not None and window.global_every is not None:
        raise CheckpointError(
            f"{window.origin}: Mistral's window covers every layer; global_every has no HF key"
        )
    return {"sliding_window": window.window if window else None}


def _mixtral(spec: Model) -> dict:
    moe = spec.feature("moe")
    if not moe.renormalize or moe.capacity_factor is not None or moe.every != 1:
        raise CheckpointError(
            f"{moe.origin}: Mixtral in HF routes every layer dropless and renormalises the top-k weights"
        )
    return {
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_weight or 0.0,
        "sliding_window": None,
    }


def _qwen2(spec: Model) -> dict:
    return {"use_sliding_window": False}


def _qwen2_moe(spec: Model) -> dict:
    moe = spec.feature("moe")
    if not moe.shared_gate or moe.capacity_factor is not None:
        raise CheckpointError(f"{moe.origin}: Qwen2-MoE in HF gates its shared expert and routes dropless")
    return _qwen_routing(spec) | {
        "intermediate_size": moe.shared_hidden_dim,
        "shared_expert_intermediate_size": moe.shared_hidden_dim,
    }


def _qwen3_moe(spec: Model) -> dict:
    moe = spec.feature("moe")
    if moe.shared_hidden_dim or moe.capacity_factor is not None:
        raise CheckpointError(f"{moe.origin}: Qwen3-MoE in HF has no shared expert and routes dropless")
    return _qwen_routing(spec)


def _qwen_routing(spec: Model) -> dict:
    """The routed experts in the keys Qwen2-MoE and Qwen3-MoE share."""
    moe = spec.feature("moe")
    return {
        "use_sliding_window": False,
        "moe_intermediate_size": spec.decoder.mlp.hidden_dim,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.renormalize,
        "decoder_sparse_step": moe.every,
        "mlp_only_layers": [],
        "router_aux_loss_coef": moe.aux_loss_weight or 0.0,
    }


def _gemma2(spec: Model) -> dict:
    window, cap = spec.feature("sliding_window"), spec.feature("softcap")
    if window is None or window.global_every != 2:
        raise CheckpointError(
            f"{spec.origin}: Gemma 2 in HF alternates windowed and full layers (global_every=2)"
        )
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _query_pre_attn_scalar(spec.decoder.attention),
        "sliding_window": window.window,
        "attn_logit_softcapping": cap.attention if cap else None,
        "final_logit_softcapping": cap.final if cap else None,
    }


def _gemma3_text(spec: Model) -> dict:
    """Gemma 3: windowed layers with their own theta (rope_local_base_freq), the last of each group of
    `sliding_window_pattern` global; q/k norms with the decoder's eps; final logits capped or not."""
    rope, window, cap = spec.feature("rope"), spec.feature("sliding_window"), spec.feature("softcap")
    qk_norm = spec.feature("qk_norm")
    if qk_norm.eps != spec.decoder.norm.eps:
        raise CheckpointError(
            f"{qk_norm.origin}: QKNorm.eps={qk_norm.eps!r}: Gemma 3 in HF normalises q and k with rms_norm_eps="
            f"{spec.decoder.norm.eps!r}"
        )
    if cap is not None and cap.attention is not None:
        raise CheckpointError(f"{cap.origin}: SoftCap.attention: Gemma 3 in HF does not cap attention scores")
    layers = spec.decoder.num_layers
    if window is None:
        pattern, size = 1, 4096  # every layer global; the window size is then unused
    else:
        pattern, size = window.global_every or layers + 1, window.window
    if window is not None and window.global_every is None:
        layer_types = ["sliding_attention"] * layers
    else:
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _query_pre_attn_scalar(spec.decoder.attention),
        "sliding_window": size,
        "layer_types": layer_types,
        "rope_local_base_freq": rope.local_theta if rope.local_theta is not None else rope.theta,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": cap.final if cap else None,
    }


def _query_pre_attn_scalar(attention) -> int:
    """Gemma's query_pre_attn_scalar, whose **-0.5 is the attention's scale."""
    if attention.scale is None:
        return attention.head_dim
    scalar = round(attention.scale**-2)
    if scalar**-0.5 != attention.scale:
        raise CheckpointError(
            f"{attention.origin}: Attention.scale={attention.scale!r} is no integer's **-0.5, which is how "
            "Gemma 2 in HF states it (query_pre_attn_scalar)"
        )
    return scalar


def _gpt_oss(spec: Model) -> dict:
    """gpt-oss in transformers 5's keys: its config class turns a missing or null `rope_scaling` into YaRN, so the
    RoPE is stated as `rope_parameters`."""
    window, moe, experts = (
        spec.feature("sliding_window"),
        spec.feature("moe"),
        spec.feature("gpt_oss_experts"),
    )
    if window is None or window.global_every != 2:
        raise CheckpointError(
            f"{spec.origin}: gpt-oss in HF alternates windowed and full layers (global_every=2)"
        )
    if moe.capacity_factor is not None or moe.every != 1:
        raise CheckpointError(f"{moe.origin}: gpt-oss in HF routes every layer dropless")
    rope = spec.feature("rope")
    return {
        "rope_parameters": {
            "rope_theta": rope.theta,
            **(_rope_scaling(rope.scaling) or {"rope_type": "default"}),
        },
        "attention_bias": True,
        "sliding_window": window.window,
        "layer_types": [
            "full_attention" if layer % 2 else "sliding_attention" for layer in range(spec.decoder.num_layers)
        ],
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_weight or 0.0,
        "swiglu_alpha": experts.alpha,
        "swiglu_limit": experts.limit,
    }


def _deepseek_v2(spec: Model) -> dict:
    """DeepSeek-V2: MLA's dims, DeepSeek-MoE in every layer (greedy softmax top-k, not renormalised, scaled by
    routed_scaling_factor, a shared expert of n_shared_experts experts' width), and the softmax scale as transformers
    derives it: qk_head_dim**-0.5 times YaRN's mscale(factor, mscale_all_dim)**2."""
    moe, rope = spec.feature("moe"), spec.feature("rope")
    width = spec.decoder.mlp.hidden_dim
    if moe is None or moe.every != 1 or moe.capacity_factor is not None:
        raise CheckpointError(f"{spec.origin}: DeepSeek-V2 in HF routes experts dropless in every layer")
    if moe.renormalize or moe.shared_gate or not moe.shared_hidden_dim or moe.shared_hidden_dim % width:
        raise CheckpointError(
            f"{moe.origin}: DeepSeek-V2 in HF keeps the top-k weights as they are and shares an ungated expert "
            f"of a whole number of experts' width ({width})"
        )
    if not rope.interleaved:
        raise CheckpointError(
            f"{rope.origin}: RoPE.interleaved=False: DeepSeek-V2 in HF turns MLA's rope channels in adjacent pairs"
        )
    v2_routing = {
        "scoring": moe.scoring == "softmax",
        "balance_bias_rate": moe.balance_bias_rate is None,
        "group_score": moe.n_group is None or moe.group_score == "max",
        "seq_aux_loss_weight": not moe.seq_aux_loss_weight,
    }
    for field, stated in v2_routing.items():
        if not stated:
            raise CheckpointError(
                f"{moe.origin}: MoE.{field}={getattr(moe, field)!r}: DeepSeek-V2 in HF scores by softmax with no "
                "correction bias or sequence-wise loss, and ranks groups by their best expert (group_score='max')"
            )
    return (
        _deepseek_attention(spec, "V2")
        | _deepseek_experts(moe, width)
        | {
            "topk_method": "greedy" if moe.n_group is None else "group_limited_greedy",
            "n_group": moe.n_group,
            "topk_group": moe.topk_group,
            "norm_topk_prob": False,
            "aux_loss_alpha": moe.aux_loss_weight or 0.0,
        }
        | _deepseek_dense_layers(moe, width)
    )


def _deepseek_attention(spec: Model, version: str) -> dict:
    """MLA's dims, and the softmax scale as transformers' DeepSeek derives it: qk_head_dim**-0.5 times YaRN's
    mscale(factor, mscale_all_dim)**2."""
    mla, rope = spec.feature("mla"), spec.feature("rope")
    if mla.eps != 1e-6:
        raise CheckpointError(
            f"{mla.origin}: MLA.eps={mla.eps!r}: DeepSeek-{version} in HF norms its latents with 1e-6"
        )
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    scaling = _rope_scaling(rope.scaling)
    scale = spec.decoder.attention.scale
    if scale is not None and scale != qk**-0.5:
        scaling = (scaling or {}) | {"mscale_all_dim": _mscale_all_dim(spec, scale, qk)}
    return {
        "head_dim": mla.qk_rope_head_dim,
        "rope_scaling": scaling,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
    }


def _deepseek_experts(moe, width: int) -> dict:
    """DeepSeek-MoE's routed and shared experts: the shared expert is a whole number of experts' width."""
    return {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.shared_hidden_dim // width,
        "moe_intermediate_size": width,
        "routed_scaling_factor": moe.routed_scale or 1.0,
    }


def _deepseek_dense_layers(moe, width: int) -> dict:
    """first_k_dense_replace and intermediate_size, the leading dense layers' width (the experts' width where there
    are none, as DeepSeek's configs leave it unused)."""
    return {
        "first_k_dense_replace": moe.first_dense_layers,
        "intermediate_size": moe.dense_hidden_dim if moe.first_dense_layers else width,
    }


def _deepseek_v3(spec: Model) -> dict:
    """DeepSeek-V3: MLA's dims and RoPE layout (rope_interleave), the softmax scale as V2's, and DeepSeek-MoE after
    the first_k_dense_replace dense layers: sigmoid scores with the e_score_correction_bias (a tensor of the
    checkpoint; its update rate is a training choice no config states), noaux_tc's groups ranked by their two best
    experts, norm_topk_prob, routed_scaling_factor and the shared experts. No multi-token-prediction layers are
    trained here, so none are written (num_nextn_predict_layers 0). The keys of DeepSeek's own configs
    (topk_method, scoring_func, seq_aux, aux_loss_alpha: the sequence-wise loss's weight) are written too."""
    moe, rope = spec.feature("moe"), spec.feature("rope")
    width = spec.decoder.mlp.hidden_dim
    if moe.every != 1 or moe.capacity_factor is not None:
        raise CheckpointError(f"{spec.origin}: DeepSeek-V3 in HF routes experts dropless in every MoE layer")
    if moe.shared_gate or not moe.shared_hidden_dim or moe.shared_hidden_dim % width:
        raise CheckpointError(
            f"{moe.origin}: DeepSeek-V3 in HF shares an ungated expert of a whole number of experts' width ({width})"
        )
    v3_routing = {
        "balance_bias_rate": moe.balance_bias_rate is not None,
        "group_score": moe.n_group is None or moe.group_score == "top2_sum",
        "aux_loss_weight": not moe.aux_loss_weight,
    }
    for field, stated in v3_routing.items():
        if not stated:
            raise CheckpointError(
                f"{moe.origin}: MoE.{field}={getattr(moe, field)!r}: DeepSeek-V3 in HF chooses experts with a "
                "correction bias, ranks groups by their two best experts (group_score='top2_sum') and has no "
                "Switch balance loss"
            )
    return (
        _deepseek_attention(spec, "V3")
        | _deepseek_experts(moe, width)
        | {
            "rope_interleave": rope.interleaved,
            # Without groups every expert is one group's: noaux_tc over one group chooses among them all.
            "n_group": moe.n_group or 1,
            "topk_group": moe.topk_group or 1,
            "norm_topk_prob": moe.renormalize,
            "num_nextn_predict_layers": 0,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "seq_aux": True,
            "aux_loss_alpha": moe.seq_aux_loss_weight,
        }
        | _deepseek_dense_layers(moe, width)
    )


def _mscale_all_dim(spec: Model, scale: float, qk: int) -> float:
    """The mscale_all_dim whose YaRN temperature squared takes qk**-0.5 to `scale`, as transformers' DeepSeek
    scales its softmax; a scale no such value gives back exactly is refused."""
    attention, scaling = spec.decoder.attention, spec.feature("rope").scaling
    if scaling is not None and scaling.rule == "yarn" and scaling.factor > 1:
        log = math.log(scaling.factor)
        value = round(((scale * qk**0.5) ** 0.5 - 1) / (0.1 * log), 12)
        mscale = 0.1 * value * log + 1.0
        if value > 0 and qk**-0.5 * mscale * mscale == scale:
            return value
    raise CheckpointError(
        f"{attention.origin}: Attention.scale={scale!r}: DeepSeek-V2 in HF scales attention by qk_head_dim**-0.5, "
        "times YaRN's mscale_all_dim temperature squared, and no mscale_all_dim gives this scale"
    )


FAMILY_KEYS = {
    "llama": lambda spec: {},
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "qwen3": _qwen2,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3_text,
    "gpt_oss": _gpt_oss,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
}


def load_params(checkpoint: Path) -> dict:
    """The params of an `axgen convert-hf` checkpoint, or of a run directory's newest checkpoint whose params match
    the checksums saved with them (a damaged newer one is named in a warning and skipped)."""
    checkpoint = Path(checkpoint).resolve()
    steps = sorted((int(p.name), p) for p in (checkpoint / "checkpoints").glob("*") if p.name.isdigit())
    if not steps:
        return _restore(checkpoint)
    for step, path in reversed(steps):
        try:
            state = _restore(path / "state")
            _verify(state["params"], json.loads((path / "checksums" / "metadata").read_text()))
            return state["params"]
        except (CheckpointError, OSError, ValueError) as err:
            print(f"warning: checkpoint step {step} in {path.parent} is damaged: {err}", file=sys.stderr)
    raise CheckpointError(f"no checkpoint in {checkpoint / 'checkpoints'} verifies")


def _restore(path: Path) -> dict:
    jax = host_jax()
    import orbax.checkpoint as ocp

    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path)
    except (OSError, ValueError, KeyError, FileNotFoundError) as err:
        _ignore_abandoned_reads()
        why = str(err).splitlines()[0].split(" [tensorstore_spec=")[0]
        raise CheckpointError(f"{path}: not a readable orbax checkpoint ({why})") from None
    return jax.tree.map(np.asarray, restored)


def _ignore_abandoned_reads() -> None:
    """After a failed restore, tensorstore still finishes the reads orbax gave up on, and their callbacks find
    orbax's event loop closed: Python would print each as an ignored exception under the one-line error."""
    default = sys.unraisablehook

    def hook(unraisable) -> None:
        if not (
            isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
        ):
            default(unraisable)

    sys.unraisablehook = hook


def _verify(params: dict, checksums: dict[str, int]) -> None:
    jax = host_jax()
    for path, array in jax.tree.leaves_with_path({"params": params}):
        name = jax.tree_util.keystr(path)
        if checksums.get(name) != host_checksum(array):
            raise CheckpointError(f"the checksum of state{name} differs from the one saved with it")


def export_hf(
    spec: Model,
    checkpoint: Path,
    out: Path,
    dtype: str | None = None,
    tokenizer: Path | None = None,
    shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    fused_experts: bool = False,
    chat_template: str | None = None,
) -> dict[str, tuple[str, int]]:
    """Writes the HF model folder at `out`, published only when complete; returns each tensor's shard and size.
    The weights are in `dtype`, else the dtype of the checkpoint the spec was imported from, else bfloat16; the
    routed experts as the family's published checkpoints hold them, one tensor per expert, unless
    `fused_experts` (transformers 5's layout in memory, which it also loads). With a tokenizer, its files go
    along, its chat template too; `chat_template` (`chatml`, a .jinja file, or one of the tokenizer's named
    templates: what `axgen data --chat-template` takes) is written as the folder's chat_template.jinja."""
    out = Path(out).resolve()
    check_replaceable(out, overwrite, "config.json")
    dtype = export_dtype(spec, dtype)
    config = hf_config(spec, dtype)
    if chat_template is not None and tokenizer is None:
        raise CheckpointError(f"--chat-template {chat_template}: needs --tokenizer, whose files it goes with")
    if tokenizer is not None:
        tokenizer, template = _tokenizer_files(Path(tokenizer), spec, chat_template)
    params = load_params(checkpoint)
    tensors = iter_hf_tensors(params, spec, _numpy_dtype(dtype))
    layout = expert_layout(spec)
    if layout is not None and not fused_experts:
        tensors = hub_tensors(tensors, layout)
    tensors = family_names(tensors, spec)
    staging = staging_dir(out)
    try:
        try:
            written = _write_shards(staging, tensors, shard_bytes)
        except CheckpointError as err:
            raise CheckpointError(f"{checkpoint}: {err}") from None
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for source, name in tokenizer or ():
            shutil.copy2(source, staging / name)
        if chat_template is not None:
            (staging / "chat_template.jinja").write_text(template)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written


def export_dtype(spec: Model, requested: str | None) -> str:
    """The dtype asked for, else the one of the checkpoint the spec was imported from, else bfloat16."""
    return requested or spec.checkpoint_dtype or "bfloat16"


def _numpy_dtype(name: str):
    return {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}[name]


def _write_shards(directory: Path, tensors: Iterator[tuple[str, np.ndarray]], shard_bytes: int) -> dict:
    """As `save_pretrained` lays them out: shards of at most `shard_bytes` and their index. Each tensor's bytes
    go to disk as it comes, so the host holds one tensor at a time; a shard's header, which must come first,
    is written once its tensors are known, and its data copied in after it."""
    shards: list[dict[str, dict]] = []
    bodies: list[Path] = []
    body = None
    for name, tensor in tensors:
        if body is None or (shards[-1] and _size(shards[-1]) + tensor.nbytes > shard_bytes):
            if body is not None:
                body.close()
            bodies.append(directory / f".body-{len(shards)}")
            shards.append({})
            body = open(bodies[-1], "wb")
        begin = _size(shards[-1])
        shards[-1][name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [begin, begin + tensor.nbytes],
        }
        body.write(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8))
    if body is not None:
        body.close()
    weight_map: dict[str, tuple[str, int]] = {}
    for number, (shard, data) in enumerate(zip(shards, bodies), 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(directory / file, shard, data)
        weight_map |= {name: (file, e["data_offsets"][1] - e["data_offsets"][0]) for name, e in shard.items()}
    index = {
        "metadata": {"total_size": sum(size for _, size in weight_map.values())},
        "weight_map": {name: file for name, (file, _) in weight_map.items()},
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def _size(shard: dict[str, dict]) -> int:
    return max((entry["data_offsets"][1] for entry in shard.values()), default=0)


def _write_safetensors(path: Path, header: dict, data: Path) -> None:
    """The safetensors layout: the header's length (8 bytes, little-endian), the JSON header padded with spaces
    to a multiple of 8, then the tensors' bytes."""
    text = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f, open(data, "rb") as body:
        f.write(struct.pack("<Q", len(text)) + text)
        shutil.copyfileobj(body, f, 64 * 2**20)
    data.unlink()


def _tokenizer_files(
    source: Path, spec: Model, chat_template: str | None
) -> tuple[list[tuple[Path, str]], str | None]:
    """(file, name to write it as) of a tokenizer.json, or of a folder holding one, and its config files beside
    it, and the text of the chat template asked for; the tokenizer must load and fit the spec's vocabulary."""
    if not source.exists():
        raise CheckpointError(f"{source}: no such file or folder (--tokenizer)")
    tokenizer_json = source / "tokenizer.json" if source.is_dir() else source
    if not tokenizer_json.is_file():
        raise CheckpointError(f"{source}: has no tokenizer.json (--tokenizer)")
    tokenizer = load_tokenizer(tokenizer_json)
    if tokenizer.vocab_size > spec.vocab_size:
        raise CheckpointError(
            f"{tokenizer_json}: its {tokenizer.vocab_size} tokens exceed vocab_size={spec.vocab_size} of {spec.origin}"
        )
    template = None if chat_template is None else load_chat_template(tokenizer, chat_template).text
    beside = [
        (tokenizer_json.with_name(name), name)
        for name in TOKENIZER_FILES[1:]
        if tokenizer_json.with_name(name).is_file() and not (name == "chat_template.jinja" and template)
    ]
    return [(tokenizer_json, "tokenizer.json"), *beside], template
