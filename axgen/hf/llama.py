"""Llama, Mistral and Mixtral: the plain pre-norm decoder, Mistral's window over every layer, and Mixtral's routed
experts (the Hub's `block_sparse_moe.experts.E.w1/w3/w2`), in both directions."""

from __future__ import annotations

from axgen.hf.adapter import ExpertLayout, Family
from axgen.hf.config import (
    LLAMA_DEFAULTS,
    Config,
    SpecSource,
    check_activation,
    check_layer_types,
    decoder,
    no_attention_bias,
)
from axgen.hf.rope import read_rope
from axgen.interop import CheckpointError
from axgen.spec import Model


def read_llama(c: Config) -> SpecSource:
    check_activation(c, "hidden_act", ("silu",))
    no_attention_bias(c)
    # nanotron's exports (SmolLM2) say how their RoPE paired channels; HF's Llama rotates halves whatever it says.
    c.expect(
        "rope_interleaved",
        (False,),
        "pairs RoPE's channels as neighbours; HF's Llama (and axgen) rotate halves",
    )
    if c.model_type == "llama":
        check_layer_types(c, lambda layer: "full_attention")
    source = decoder(c)
    source.features = [read_rope(c)]
    return source


def read_mistral(c: Config) -> SpecSource:
    source = read_llama(c)
    window = c["sliding_window"]
    if window is not None:
        source.features.append(f"F.sliding_window(window={window})")
    check_layer_types(c, lambda layer: "full_attention" if window is None else "sliding_attention")
    return source


def read_mixtral(c: Config) -> SpecSource:
    source = read_mistral(c)
    c.expect("router_jitter_noise", (0, 0.0), "perturbs routing in training, which axgen does not do")
    source.features.append(
        f'F.moe(num_experts={c["num_local_experts"]}, top_k={c["num_experts_per_tok"]}, renormalize=True, '
        f'aux_loss_weight={c["router_aux_loss_coef"]!r}, router_z_loss_weight=0.0)'
    )
    return source


def write_mistral(spec: Model) -> dict:
    window = spec.feature("sliding_window")
    if window is not None and window.global_every is not None:
        raise CheckpointError(
            f"{window.origin}: Mistral's window covers every layer; global_every has no HF key"
        )
    return {"sliding_window": window.window if window else None}


def write_mixtral(spec: Model) -> dict:
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


FAMILIES = [
    Family(
        "llama",
        read_llama,
        LLAMA_DEFAULTS,
        write=lambda spec: {},
        architecture="LlamaForCausalLM",
        features=frozenset({"rope"}),
    ),
    Family(
        "mistral",
        read_mistral,
        LLAMA_DEFAULTS | {"sliding_window": 4096, "max_position_embeddings": 32_768},
        write=write_mistral,
        architecture="MistralForCausalLM",
        features=frozenset({"rope", "sliding_window"}),
    ),
    Family(
        "mixtral",
        read_mixtral,
        LLAMA_DEFAULTS
        | {
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
            "sliding_window": None,
            "router_aux_loss_coef": 0.001,
            "router_jitter_noise": 0.0,
        },
        write=write_mixtral,
        architecture="MixtralForCausalLM",
        features=frozenset({"rope", "moe"}),
        experts=ExpertLayout("block_sparse_moe", gate="w1", up="w3", down="w2"),
    ),
]
