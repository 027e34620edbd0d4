"""Quantization: the chosen projections become quantized dots (int8 or fp8) with straight-through gradients.

Selects `linear` and `lm_head` nodes by their `region/node` name; by default every projection of the decoder
blocks but an MoE router, whose top-k choice is too sensitive to rounding.
"""

import re

from axgen.ir import Graph, Node, Param, TensorType
from axgen.passes.manager import FeatureConflict, PassError, register
from axgen.spec import Quantize


def _selected(node: Node, cfg: Quantize) -> bool:
    name = str(node)
    if cfg.include is None:
        wanted = node.region != "main" and node.name != "router"
    else:
        wanted = re.fullmatch(cfg.include, name) is not None
    return wanted and not (cfg.exclude and re.fullmatch(cfg.exclude, name))


@register("quantize", after=("moe",), before=("remat",))
def quantize(g: Graph, cfg: Quantize) -> None:
    for experts in g.nodes(op="moe"):
        if cfg.include and re.fullmatch(cfg.include, str(experts)):
            raise FeatureConflict(
                "moe", f"include selects {experts}, whose ragged expert dots have no quantized form"
            )
    dots = [n for n in g.nodes() if n.op in ("linear", "lm_head")]
    chosen = [n for n in dots if _selected(n, cfg)]
    if not chosen:
        names = ", ".join(str(n) for n in dots)
        raise PassError(f"{cfg.origin}: {cfg.summary()} selects none of the projections: {names}")
    # Delayed scaling is fp8's; `target` leaves the dtype to the target's lowering.
    dtype = "fp8_delayed" if cfg.scaling == "delayed" else cfg.dtype or "target"
    history = TensorType.of(("amax_history", cfg.amax_history), ("fp8_operand", 3))  # x, w, gradient
    for node in chosen:
        if cfg.scaling == "delayed":
            amax = Param(f"{node.name}_amax_history", history, "zeros", decay=False, trained=False)
            g.update(node, {"amax_history": amax}, quantize=dtype)
        else:
            g.update(node, quantize=dtype)
