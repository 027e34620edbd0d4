"""The op vocabulary: each op's input slots and its shape rule over named axes.

A shape rule takes the input types, the attrs and the params, checks them, and returns the output type. Rules
raise `ShapeError` with the op and the offending axes, so a pass that builds an ill-typed graph fails at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from axgen.ir.types import Param, TensorType


class ShapeError(ValueError):
    pass


@dataclass(frozen=True)
class OpDef:
    slots: tuple[str, ...]
    rule: Callable[[dict[str, TensorType], dict, dict[str, Param]], TensorType]


def _same_as(slot: str, *others: str):
    def rule(ins, attrs, params):
        for other in others:
            if ins[other] != ins[slot]:
                raise ShapeError(f"{other}{ins[other]} differs from {slot}{ins[slot]}")
        return ins[slot]

    return rule


def _input(ins, attrs, params):
    return attrs["type"]


def _positions(ins, attrs, params):
    return TensorType.of("seq")


def _embed(ins, attrs, params):
    table = params["table"].type
    return ins["tokens"].concat(table.drop("vocab"))


def _norm(ins, attrs, params):
    x = ins["x"]
    last = TensorType(x.axes[-1:], x.sizes[-1:])
    for role, param in params.items():
        if param.type != last:
            raise ShapeError(f"norm {role}{param.type} does not match the last axis of x{x}")
    return x


def _linear(ins, attrs, params):
    """An einsum: contracts the axes that x and w share, keeps the rest of x, then the rest of w."""
    x, w = ins["x"], params["w"].type
    contracted = [a for a in w.axes if a in x.axes]
    if not contracted:
        raise ShapeError(f"w{w} shares no axis with x{x}")
    for axis in contracted:
        if x.size(axis) != w.size(axis):
            raise ShapeError(f"axis {axis}: x has {x.size(axis)}, w has {w.size(axis)}")
    return x.drop(*contracted).concat(w.drop(*contracted))


def _rope(ins, attrs, params):
    x = ins["x"]
    if x.axes[-1] != "head_dim" or x.sizes[-1] % 2:
        raise ShapeError(f"rope needs an even trailing head_dim axis, got x{x}")
    if "seq" not in x.axes:
        raise ShapeError(f"rope needs a seq axis, got x{x}")
    if ins["positions"].axes != ("seq",):
        raise ShapeError(f"rope needs positions [seq], got {ins['positions']}")
    return x


def _attention(ins, attrs, params):
    q, k, v = ins["q"], ins["k"], ins["v"]
    if k != v:
        raise ShapeError(f"k{k} and v{v} differ")
    if q.axes != ("batch", "seq", "heads", "head_dim") or k.axes != (
        "batch",
        "seq",
        "kv_heads",
        "head_dim",
    ):
        raise ShapeError(
            f"expected q[batch, seq, heads, head_dim], k[batch, seq, kv_heads, head_dim]; got q{q}, k{k}"
        )
    if q.size("heads") % k.size("kv_heads") or q.size("head_dim") != k.size("head_dim"):
        raise ShapeError(f"q{q} and k{k} do not group")
    return q


def _moe(ins, attrs, params):
    """x [batch, seq, embed] routed by router_logits [batch, seq, expert] through experts that map embed -> embed."""
    x, logits = ins["x"], ins["router_logits"]
    if logits.drop("expert") != x.drop("embed") or logits.axes[-1] != "expert":
        raise ShapeError(f"router_logits{logits} do not route x{x}")
    for role, param in params.items():
        if param.type.axes[0] != "expert" or param.type.sizes[0] != logits.sizes[-1]:
            raise ShapeError(f"expert weight {role}{param.type} does not lead with expert={logits.sizes[-1]}")
    if params["w_down"].type.axes[-1] != "embed" or params["w_up"].type.axes[1] != "embed":
        raise ShapeError(
            f"experts must map embed -> embed, got w_up{params['w_up'].type}, w_down{params['w_down'].type}"
        )
    if not 1 <= attrs["top_k"] <= logits.sizes[-1]:
        raise ShapeError(f"top_k={attrs['top_k']} is not in [1, {logits.sizes[-1]}]")
    return x


def _lm_head(ins, attrs, params):
    x = ins["x"]
    vocab = attrs["vocab"] if attrs.get("tied") else params["w"].type.size("vocab")
    return x.drop("embed").concat(TensorType.of(("vocab", vocab)))


OPS: dict[str, OpDef] = {
    "input": OpDef((), _input),
    "positions": OpDef(("tokens",), _positions),
    "embed": OpDef(("tokens",), _embed),
    "rms_norm": OpDef(("x",), _norm),
    "layer_norm": OpDef(("x",), _norm),
    "linear": OpDef(("x",), _linear),
    "rope": OpDef(("x", "positions"), _rope),
    "attention": OpDef(("q", "k", "v"), _attention),
    "swiglu": OpDef(("gate", "up"), _same_as("gate", "up")),
    "gelu": OpDef(("x",), _same_as("x")),
    "add": OpDef(("x", "y"), _same_as("x", "y")),
    "scan": OpDef(("x", "positions"), _same_as("x")),
    "lm_head": OpDef(("x",), _lm_head),
    "moe": OpDef(("x", "router_logits"), _moe),
}
