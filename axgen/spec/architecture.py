"""The decoder a model is made of: its layers' attention, MLP and norms."""

from __future__ import annotations

from dataclasses import dataclass

from axgen.spec.validation import SpecNode, suggest

ACTIVATIONS = ("swiglu", "gelu")


@dataclass(frozen=True, kw_only=True)
class RMSNorm(SpecNode):
    HF_KEYS = {"eps": "rms_norm_eps"}
    eps: float

    def validate(self) -> None:
        self.require_positive("eps")


@dataclass(frozen=True, kw_only=True)
class LayerNorm(SpecNode):
    HF_KEYS = {"eps": "layer_norm_eps"}
    eps: float

    def validate(self) -> None:
        self.require_positive("eps")


@dataclass(frozen=True, kw_only=True)
class Attention(SpecNode):
    """Causal multi-head attention; `num_kv_heads < num_heads` is grouped-query attention. `scale` multiplies the
    scores q.k before the softmax; None is head_dim**-0.5. Gemma states its own: query_pre_attn_scalar**-0.5.
    """

    HF_KEYS = {"scale": "query_pre_attn_scalar (scale = query_pre_attn_scalar**-0.5)"}
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None = None

    def validate(self) -> None:
        self.require_positive("num_heads", "num_kv_heads", "head_dim")
        if self.scale is not None:
            self.require_positive("scale")
        if self.num_heads % self.num_kv_heads:
            self.fail("num_kv_heads", f"does not divide num_heads={self.num_heads}")


@dataclass(frozen=True, kw_only=True)
class MLP(SpecNode):
    HF_KEYS = {"hidden_dim": "intermediate_size", "activation": "hidden_act (silu: swiglu)"}
    hidden_dim: int
    activation: str

    def validate(self) -> None:
        self.require_positive("hidden_dim")
        if self.activation not in ACTIVATIONS:
            self.fail(
                "activation",
                f"is not one of {', '.join(ACTIVATIONS)}{suggest(self.activation, ACTIVATIONS)}",
            )


@dataclass(frozen=True, kw_only=True)
class Decoder(SpecNode):
    """`num_layers` identical pre-norm layers: x + attention(norm(x)), then x + mlp(norm(x))."""

    num_layers: int
    attention: Attention
    mlp: MLP
    norm: RMSNorm | LayerNorm

    def validate(self) -> None:
        self.require_positive("num_layers")
