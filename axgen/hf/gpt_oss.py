"""gpt-oss, in both directions: biases on q, k, v and o, a sink logit per head, windows on even layers, routed
experts with biases and the clamped SwiGLU; its published checkpoints hold the experts fused, in MXFP4
(`axgen.hf.storage.Mxfp4Experts`)."""

from __future__ import annotations

from axgen.hf.adapter import Family
from axgen.hf.config import (
    LLAMA_DEFAULTS,
    Config,
    HFImportError,
    SpecSource,
    check_activation,
    check_layer_types,
    decoder,
    shown,
)
from axgen.hf.rope import read_rope, write_scaling
from axgen.interop import CheckpointError
from axgen.spec import Model

# transformers 5.23's GptOssConfig; a config without RoPE keys gets its YaRN.
GPT_OSS_DEFAULTS = LLAMA_DEFAULTS | {
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150_000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "attention_bias": True,
    "max_position_embeddings": 131_072,
    "sliding_window": 128,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "router_aux_loss_coef": 0.001,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "quantization_config": None,
    "experts_per_token": None,  # the original (non-HF) checkpoint's name for num_experts_per_tok
    "initial_context_length": None,  # the original checkpoint's name for YaRN's original context
}


def read_gpt_oss(c: Config) -> SpecSource:
    """gpt-oss: biases on q, k, v and o, a sink logit per head, 128-token windows on even layers, and routed
    experts with biases and the clamped SwiGLU (F.gpt_oss_experts). Its published checkpoints store the experts in
    MXFP4, which convert-hf dequantizes (`quantization_config`)."""
    check_activation(
        c, "hidden_act", ("silu",)
    )  # transformers' gpt-oss ignores it: its experts' SwiGLU is clamped
    c.expect(
        "attention_bias", (True,), "leaves out gpt-oss's attention biases, which axgen's gpt-oss import maps"
    )
    _mxfp4_storage(c)
    source = decoder(c)
    top_k = c["num_experts_per_tok"]
    c.expect("experts_per_token", (None, top_k), f"differs from num_experts_per_tok={top_k}")
    c.read.add("initial_context_length")  # transformers does not read it: YaRN's is in rope_scaling
    window = c["sliding_window"]
    if window is None:
        raise HFImportError(f"{c.path}: sliding_window=null leaves gpt-oss's sliding layers without a window")
    check_layer_types(c, lambda layer: "full_attention" if layer % 2 else "sliding_attention")
    if "rope_parameters" not in c.values and c["rope_scaling"] is None:
        # transformers' GptOssConfig gives a config without RoPE parameters a YaRN of its own choosing.
        raise HFImportError(
            f"{c.path}: rope_scaling=null: transformers' gpt-oss then takes a built-in YaRN; state it in the "
            "config's rope_scaling, as the published ones do"
        )
    source.features = [
        read_rope(c),
        "F.qkv_bias()",
        "F.out_bias()",
        "F.attention_sinks()",
        f"F.sliding_window(window={window}, global_every=2)",
        f'F.moe(num_experts={c["num_local_experts"]}, top_k={top_k}, renormalize=True, '
        f'aux_loss_weight={c["router_aux_loss_coef"]!r}, router_z_loss_weight=0.0)',
        f'F.gpt_oss_experts(alpha={float(c["swiglu_alpha"])!r}, limit={float(c["swiglu_limit"])!r})',
    ]
    return source


def _mxfp4_storage(c: Config) -> None:
    """`quantization_config`: how the published checkpoint stores its experts (MXFP4 blocks and scales), which
    convert-hf dequantizes; it does not change what the model computes."""
    storage = c["quantization_config"]
    if storage is None:
        return
    if not isinstance(storage, dict) or storage.get("quant_method") != "mxfp4":
        method = storage.get("quant_method") if isinstance(storage, dict) else storage
        raise HFImportError(
            f"{c.path}: quantization_config.quant_method={shown(method)} is not a storage convert-hf reads (mxfp4)"
        )
    extra = sorted(set(storage) - {"quant_method", "modules_to_not_convert"})
    if extra:
        raise HFImportError(
            f"{c.path}: quantization_config.{extra[0]}={shown(storage[extra[0]])} is not a key axgen's mxfp4 "
            "reading knows"
        )


def write_gpt_oss(spec: Model) -> dict:
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
            **(write_scaling(rope.scaling) or {"rope_type": "default"}),
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


FAMILY = Family(
    "gpt_oss",
    read_gpt_oss,
    GPT_OSS_DEFAULTS,
    write=write_gpt_oss,
    architecture="GptOssForCausalLM",
    features=frozenset(
        {"rope", "qkv_bias", "out_bias", "attention_sinks", "sliding_window", "moe", "gpt_oss_experts"}
    ),
    storage="mxfp4",
    not_exported=("quantization_config",),
)
