"""Qwen2 (q, k, v biases), Qwen3 (q/k norms) and their MoE models (Qwen2-MoE's gated shared expert; Qwen3-MoE
without one), in both directions."""

from __future__ import annotations

from axgen.hf.adapter import GATE_UP_DOWN, Family
from axgen.hf.config import (
    LLAMA_DEFAULTS,
    Config,
    HFImportError,
    SpecSource,
    check_activation,
    decoder,
    ignored_key,
    literal,
    no_attention_bias,
    no_window,
)
from axgen.hf.rope import read_rope
from axgen.interop import CheckpointError
from axgen.spec import Model

# What transformers' Qwen2-MoE and Qwen3-MoE config classes give the keys they share.
_QWEN_MOE = {
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
}


def read_qwen2(c: Config) -> SpecSource:
    check_activation(c, "hidden_act", ("silu",))
    c.expect("qkv_bias", (True,), "leaves out Qwen2's q, k and v biases, which its checkpoints hold")
    # Qwen2.5's text models say that they do not use Qwen2-VL's multimodal RoPE sections.
    c.expect("use_mrope", (False,), "splits RoPE into Qwen2-VL's multimodal sections, which axgen does not")
    no_window(c)
    source = decoder(c)
    source.features = [read_rope(c), "F.qkv_bias()"]
    return source


def read_qwen3(c: Config) -> SpecSource:
    check_activation(c, "hidden_act", ("silu",))
    no_window(c)
    no_attention_bias(c)
    ignored_key(c, "qkv_bias", False, "no biases on q, k and v")
    ignored_key(c, "use_qk_norm", True, "q and k norms")
    source = decoder(c)
    source.features = [read_rope(c), f'F.qk_norm(eps={c["rms_norm_eps"]!r})']
    return source


def read_qwen2_moe(c: Config) -> SpecSource:
    source = read_qwen2(c)
    source.mlp = _expert_mlp(c)
    source.features.append(
        f'F.moe(num_experts={c["num_experts"]}, top_k={c["num_experts_per_tok"]}, '
        f'renormalize={c["norm_topk_prob"]!r}, every={c["decoder_sparse_step"]}, '
        f'shared_hidden_dim={literal(c["shared_expert_intermediate_size"])}, shared_gate=True, '
        f'aux_loss_weight={c["router_aux_loss_coef"]!r}, router_z_loss_weight=0.0)'
    )
    return source


def read_qwen3_moe(c: Config) -> SpecSource:
    """Qwen3's attention (q/k norms, no biases) with Qwen2-MoE's routing and no shared expert."""
    source = read_qwen3(c)
    source.mlp = _expert_mlp(c)
    ignored_key(c, "shared_expert_intermediate_size", 0, "no shared expert")
    # The published configs say num_experts; transformers 5 saves the same number as num_local_experts.
    experts = c["num_local_experts" if "num_local_experts" in c.values else "num_experts"]
    source.features.append(
        f'F.moe(num_experts={experts}, top_k={c["num_experts_per_tok"]}, '
        f'renormalize={c["norm_topk_prob"]!r}, every={c["decoder_sparse_step"]}, '
        f'aux_loss_weight={c["router_aux_loss_coef"]!r}, router_z_loss_weight=0.0)'
    )
    return source


def _expert_mlp(c: Config) -> str:
    """The experts' MLP, which is also the dense layers' in axgen: Qwen's dense layers (`mlp_only_layers`, and
    those between every `decoder_sparse_step`-th) are `intermediate_size` wide, so they can exist only when that
    width is the experts' own."""
    c.expect("mlp_only_layers", ([],), "keeps dense MLPs in chosen layers, which axgen's import does not map")
    width, experts_width = c["intermediate_size"], c["moe_intermediate_size"]
    if c["decoder_sparse_step"] != 1 and width != experts_width:
        raise HFImportError(
            f"{c.path}: decoder_sparse_step={c['decoder_sparse_step']!r} keeps dense layers of "
            f"intermediate_size={width}, but axgen's dense layers are the experts' width "
            f"(moe_intermediate_size={experts_width})"
        )
    return f'MLP(hidden_dim={literal(experts_width)}, activation="swiglu")'


def write_qwen2(spec: Model) -> dict:
    return {"use_sliding_window": False}


def write_qwen2_moe(spec: Model) -> dict:
    moe = spec.feature("moe")
    if not moe.shared_gate or moe.capacity_factor is not None:
        raise CheckpointError(f"{moe.origin}: Qwen2-MoE in HF gates its shared expert and routes dropless")
    return _qwen_routing(spec) | {
        "intermediate_size": moe.shared_hidden_dim,
        "shared_expert_intermediate_size": moe.shared_hidden_dim,
    }


def write_qwen3_moe(spec: Model) -> dict:
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


_QWEN2 = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
FAMILIES = [
    Family(
        "qwen2",
        read_qwen2,
        LLAMA_DEFAULTS | _QWEN2 | {"qkv_bias": True, "use_mrope": False},
        write=write_qwen2,
        architecture="Qwen2ForCausalLM",
        features=frozenset({"rope", "qkv_bias"}),
    ),
    Family(
        "qwen3",
        read_qwen3,
        LLAMA_DEFAULTS | _QWEN2,
        write=write_qwen2,
        architecture="Qwen3ForCausalLM",
        features=frozenset({"rope", "qk_norm"}),
    ),
    Family(
        "qwen2_moe",
        read_qwen2_moe,
        LLAMA_DEFAULTS | {"qkv_bias": True, "use_mrope": False} | _QWEN_MOE,
        write=write_qwen2_moe,
        architecture="Qwen2MoeForCausalLM",
        features=frozenset({"rope", "qkv_bias", "moe"}),
        experts=GATE_UP_DOWN,
    ),
    Family(
        "qwen3_moe",
        read_qwen3_moe,
        LLAMA_DEFAULTS | _QWEN_MOE,
        write=write_qwen3_moe,
        architecture="Qwen3MoeForCausalLM",
        features=frozenset({"rope", "qk_norm", "moe"}),
        experts=GATE_UP_DOWN,
    ),
]
