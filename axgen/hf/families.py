"""The Hugging Face families axgen reads and writes, by model_type, and which one computes what a spec does. Each
family is one adapter (`axgen.hf.adapter.Family`) stated in its group's module."""

from __future__ import annotations

from axgen.hf import deepseek, gemma, gpt_oss, llama, qwen
from axgen.hf.adapter import Family
from axgen.interop import CheckpointError
from axgen.spec import Model

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in [*llama.FAMILIES, *qwen.FAMILIES, *gemma.FAMILIES, gpt_oss.FAMILY, *deepseek.FAMILIES]
}
# Features that shape training only, not the weights' meaning, or whose weights PEFT keeps beside the model's
# (F.lora's adapters: export-hf writes them as an adapter folder, or merges them in): every family goes with them.
TRAINING_ONLY = {"remat", "quantize", "lora", "dpo", "simpo"}


def family(spec: Model) -> Family:
    """The HF family whose model computes what the spec does; a spec no family computes is refused by its field."""
    found = FAMILIES[family_name(spec)]
    extra = sorted({f.pass_name for f in spec.features} - TRAINING_ONLY - found.features)
    if extra:
        raise CheckpointError(
            f"{spec.origin}: {found.model_type} models in HF have no {extra[0]!r}; export-hf cannot write it"
        )
    rope = spec.feature("rope")
    if rope is not None and rope.local_theta is not None and not found.local_theta:
        raise CheckpointError(
            f"{rope.origin}: RoPE.local_theta={rope.local_theta!r}: {found.model_type} models in HF have one theta "
            "for every layer"
        )
    attention = spec.decoder.attention
    if attention.scale is not None and not found.scaled_attention:
        raise CheckpointError(
            f"{attention.origin}: Attention.scale={attention.scale!r}: {found.model_type} models in HF scale "
            "attention by head_dim**-0.5 only"
        )
    return found


def family_name(spec: Model) -> str:
    """The model_type of the family nearest the spec, by its features alone (`family` checks that it computes
    what the spec does): which names a checkpoint of the spec's params takes."""
    features = {f.pass_name for f in spec.features}
    moe = spec.feature("moe")
    if "gpt_oss_experts" in features:
        return "gpt_oss"
    if "mla" in features:
        # DeepSeek-V3 scores experts by sigmoid, V2 by softmax.
        return "deepseek_v3" if moe is not None and moe.scoring == "sigmoid" else "deepseek_v2"
    if "gemma_block" in features:
        return "gemma3_text" if "qk_norm" in features else "gemma2"
    if moe is not None:
        if "qk_norm" in features:
            return "qwen3_moe"
        return "qwen2_moe" if moe.shared_hidden_dim else "mixtral"
    if "qk_norm" in features:
        return "qwen3"
    if "qkv_bias" in features:
        return "qwen2"
    return "mistral" if "sliding_window" in features else "llama"
