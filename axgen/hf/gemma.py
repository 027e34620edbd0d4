"""Gemma 2 (windowed and full layers alternating, soft-capping, query_pre_attn_scalar) and Gemma 3's text model
(q/k norms, N local : 1 global layers with a theta each), in both directions; a Gemma 3 image-text config is read
as its text model."""

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
    literal,
    no_attention_bias,
    shown,
)
from axgen.hf.rope import read_rope, read_scaling, rope_dict, rope_value
from axgen.interop import CheckpointError
from axgen.spec import Model

GEMMA2_DEFAULTS = LLAMA_DEFAULTS | {
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_size": None,  # transformers 4.42's second name for sliding_window
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 8192,
}


# Gemma3TextConfig's defaults (transformers 5.23), with the 4.x keys published configs still carry.
GEMMA3_TEXT_DEFAULTS = LLAMA_DEFAULTS | {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}


def read_gemma2(c: Config) -> SpecSource:
    check_activation(c, "hidden_activation", ("gelu_pytorch_tanh",))
    c.read.add("hidden_act")  # transformers reads hidden_activation for Gemma 2
    no_attention_bias(c)
    source = decoder(c)
    head_dim = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    scalar = c["query_pre_attn_scalar"]
    if scalar != head_dim:  # Gemma-2-27B: 144 (hidden / heads), where head_dim is 128
        source.attention = source.attention[:-1] + f", scale={literal(scalar)}**-0.5)"
    source.features = [read_rope(c), "F.gemma_block()", _alternating_window(c)]
    caps = {"attention": c["attn_logit_softcapping"], "final": c["final_logit_softcapping"]}
    caps = {name: cap for name, cap in caps.items() if cap is not None}
    if caps:
        source.features.append(f"F.softcap({', '.join(f'{k}={float(v)!r}' for k, v in caps.items())})")
    return source


def _alternating_window(c: Config) -> str:
    """Gemma 2's layers alternate a sliding window (even layers) and full attention (odd)."""
    check_layer_types(c, lambda layer: "full_attention" if layer % 2 else "sliding_attention")
    window = c["sliding_window"]
    c.expect("sliding_window_size", (None, window), f"differs from sliding_window={window}")
    return f"F.sliding_window(window={window}, global_every=2)"


def read_gemma3_text(c: Config) -> SpecSource:
    """Gemma 3's text model: Gemma 2's block with (1 + w) q/k norms, layers of N local : 1 global, a theta per
    layer type, and no attention soft-capping."""
    check_activation(c, "hidden_activation", ("gelu_pytorch_tanh",))
    c.read.add("hidden_act")  # transformers reads hidden_activation for Gemma 3
    no_attention_bias(c)
    # transformers' Gemma 3 never caps attention scores, whatever the config says; axgen will not guess.
    c.expect("attn_logit_softcapping", (None,), "caps attention scores, which transformers' Gemma 3 does not")
    source = decoder(c)
    head_dim = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    scalar = c["query_pre_attn_scalar"]
    if scalar != head_dim:  # Gemma-3-27B: 168 (hidden / heads), where head_dim is 128
        source.attention = source.attention[:-1] + f", scale={literal(scalar)}**-0.5)"
    every = _gemma3_pattern(c)
    source.features = [
        _gemma3_rope(c, local=every != 1),
        "F.gemma_block()",
        f'F.qk_norm(eps={c["rms_norm_eps"]!r})',
    ]
    if every != 1:
        window = c["sliding_window"]
        source.features.append(
            f"F.sliding_window(window={window}{f', global_every={every}' if every else ''})"
        )
    else:
        c.read.add("sliding_window")  # no layer has a window
    final = c["final_logit_softcapping"]
    if final is not None:
        source.features.append(f"F.softcap(final={float(final)!r})")
    return source


def _gemma3_pattern(c: Config) -> int | None:
    """k of "the last layer of each group of k is global" (4.x: sliding_window_pattern; 5: layer_types); None
    when every layer has a window, 1 when none has. Layers after the last whole group are windowed."""
    c.read |= {"sliding_window_pattern", "_sliding_window_pattern"}
    layers = c["num_hidden_layers"]
    if "layer_types" in c.values:
        types = c["layer_types"]
        full = (
            [i for i, kind in enumerate(types) if kind == "full_attention"] if isinstance(types, list) else []
        )
        every = full[0] + 1 if full else None
    elif "_sliding_window_pattern" in c.values and "sliding_window_pattern" not in c.values:
        every = c["_sliding_window_pattern"]  # the private name some re-saved configs carry
    else:
        every = c["sliding_window_pattern"]
    check_layer_types(
        c, lambda i: "full_attention" if every and (i + 1) % every == 0 else "sliding_attention"
    )
    if every and every > layers:  # no group is whole: every layer is windowed
        return None
    return every


def _gemma3_rope(c: Config, local: bool) -> str:
    """F.rope of the global layers with `local_theta` for the windowed ones: transformers 5's `rope_parameters`
    per layer type, or 4.x's rope_theta, rope_scaling (global) and rope_local_base_freq."""
    if "rope_parameters" in c.values:
        per_type = rope_dict(c, "rope_parameters")
        kinds = {}
        for kind in ("full_attention", "sliding_attention"):
            key = f"rope_parameters.{kind}"
            value = per_type.pop(kind, None)
            if not isinstance(value, dict):
                raise HFImportError(f"{c.path}: {key}={shown(value)} is not an object of RoPE parameters")
            kinds[kind] = (key, dict(value))
        if per_type:
            name, value = next(iter(per_type.items()))
            raise HFImportError(
                f"{c.path}: rope_parameters.{name}={shown(value)} is not a Gemma 3 layer type"
            )
        (key, full), (local_key, sliding) = kinds["full_attention"], kinds["sliding_attention"]
        theta = rope_value(c, key, full, "rope_theta", "positive number")
        scaling = read_scaling(c, key, full)
        local_theta = rope_value(c, local_key, sliding, "rope_theta", "positive number")
        if read_scaling(c, local_key, sliding) is not None:
            raise HFImportError(
                f"{c.path}: {local_key} scales RoPE on the local layers, which axgen gives plain RoPE only"
            )
    else:
        theta, local_theta = c["rope_theta"], c["rope_local_base_freq"]
        scaling = read_scaling(c, "rope_scaling", rope_dict(c, "rope_scaling"))
    arguments = [f"theta={literal(float(theta))}"]
    if scaling:
        arguments.append(f"scaling={scaling}")
    if local:
        arguments.append(f"local_theta={literal(float(local_theta))}")
    return f"F.rope({', '.join(arguments)})"


def read_gemma3(c: Config) -> SpecSource:
    """A Gemma 3 image-text config: the import builds its text model (`text_config`, read as a gemma3_text
    config); the vision tower and the projector are not built, so their keys are read and left."""
    text = c["text_config"]
    if not isinstance(text, dict):
        raise HFImportError(f"{c.path}: text_config={shown(text)} is not an object")
    text_type = text.get("model_type", "gemma3_text")
    if text_type != "gemma3_text":
        raise HFImportError(f"{c.path}: text_config.model_type={shown(text_type)} is not gemma3_text")
    inner = Config(text, f"{c.path}: text_config", "gemma3_text", GEMMA3_TEXT_DEFAULTS)
    inner.read |= {"model_type", "dtype", "torch_dtype"}
    source = read_gemma3_text(inner)
    unaccounted = inner.unaccounted()
    if unaccounted:
        key = unaccounted[0]
        raise HFImportError(
            f"{c.path}: text_config.{key}={shown(text[key])} is a key axgen's gemma3_text import does not know"
        )
    c.read |= MULTIMODAL_KEYS
    return source


# A Gemma 3 image-text config's keys for the parts the import does not build: the vision tower, its projector and
# the image tokens.
MULTIMODAL_KEYS = frozenset(
    {
        "vision_config",
        "mm_tokens_per_image",
        "boi_token_index",
        "eoi_token_index",
        "image_token_index",
        "image_token_id",
        "boi_token_id",
        "eoi_token_id",
    }
)


def write_gemma2(spec: Model) -> dict:
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


def write_gemma3_text(spec: Model) -> dict:
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


FAMILIES = [
    Family(
        "gemma2",
        read_gemma2,
        GEMMA2_DEFAULTS,
        write=write_gemma2,
        architecture="Gemma2ForCausalLM",
        features=frozenset({"rope", "gemma_block", "sliding_window", "softcap"}),
        scaled_attention=True,
    ),
    Family(
        "gemma3_text",
        read_gemma3_text,
        GEMMA3_TEXT_DEFAULTS,
        write=write_gemma3_text,
        architecture="Gemma3ForCausalLM",
        features=frozenset({"rope", "gemma_block", "qk_norm", "sliding_window", "softcap"}),
        scaled_attention=True,
        local_theta=True,
    ),
    # An image-text config: its text_config is read as a gemma3_text config; export-hf writes gemma3_text.
    Family("gemma3", read_gemma3, {}),
]
