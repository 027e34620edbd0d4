"""Soft-capping: attention scores and the output logits squashed into (-cap, cap) by cap * tanh(x / cap), as in
Gemma 2. The scores' cap is an attention attr that each target's kernel implements or hands to XLA's path; the
logits' is a node after the output head."""

from dataclasses import dataclass

from axgen.ir import Attrs, Graph, register_op, same_as
from axgen.passes.manager import register
from axgen.spec import SoftCap


@dataclass(frozen=True, kw_only=True)
class CapAttrs(Attrs):
    cap: float


register_op("softcap", ("x",), same_as("x"), "attention", CapAttrs)


@register("softcap")
def softcap(g: Graph, cfg: SoftCap) -> None:
    if cfg.attention is not None:
        for attn in list(g.nodes(op="attention")):
            g.update(attn, softcap=cfg.attention)
    if cfg.final is not None:
        logits = g.output("main")
        g.set_output(g.add("main", f"{logits.name}_softcap", "softcap", {"x": logits}, cap=cfg.final))
