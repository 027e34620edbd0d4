"""Quantization: the chosen projections become quantized dots (int8 or fp8) with straight-through gradients.

Selects `linear` and `lm_head` nodes by their `region/node` name; by default every projection of the decoder
blocks but an MoE router, whose top-k choice is too sensitive to rounding. A dropless MoE's routed experts are
selected by their `moe` node's name (`moe_layers/moe`: the gate, up and down products together) when `include`
names it, never by default: no chip's grouped matmul kernel takes int8 or fp8 operands, so quantized experts give
the kernel up for XLA's ragged_dot, which is the faster trade on some meshes and not on others (the target's
lowering decides, and says so; backends/lowering.py).
"""

import re

from axgen.ir import Graph, Node, Param, TensorType
from axgen.passes.manager import FeatureConflict, PassError, register
from axgen.spec import Quantize


def _selected(node: Node, cfg: Quantize) -> bool:
    name = str(node)
    if cfg.include is None:
        wanted = node.region != "main" and node.name != "router" and node.op != "moe"
    else:
        wanted = re.fullmatch(cfg.include, name) is not None
    return wanted and not (cfg.exclude and re.fullmatch(cfg.exclude, name))


@register("quantize", after=("moe",), before=("remat",))
def quantize(g: Graph, cfg: Quantize) -> None:
    experts = [n for n in g.nodes(op="moe") if _selected(n, cfg)]
    for node in experts:
        if node.attrs.capacity_factor:
            raise FeatureConflict(
                "moe",
                f"include selects {node}, whose capacity-factor experts have no quantized form"
                " (the dropless ones do)",
            )
        if cfg.scaling == "delayed":
            raise FeatureConflict(
                "moe",
                f"include selects {node}, and the routed experts' products keep no amax history:"
                " use scaling='current'",
            )
    dots = [n for n in g.nodes() if n.op in ("linear", "lm_head")] + list(g.nodes(op="moe"))
    chosen = [n for n in dots if _selected(n, cfg)]
    if not chosen:
        names = ", ".join(str(n) for n in dots)
        raise PassError(f"{cfg.origin}: {cfg.summary()} selects none of the projections or experts: {names}")
    # Delayed scaling is fp8's; `target` leaves the dtype to the target's lowering.
    dtype = "fp8_delayed" if cfg.scaling == "delayed" else cfg.dtype or "target"
    history = TensorType.of(("amax_history", cfg.amax_history), ("fp8_operand", 3))  # x, w, gradient
    for node in chosen:
        if node.op == "moe":
            g.update(node, quantize=dtype)
        elif cfg.scaling == "delayed":
            amax = Param(f"{node.name}_amax_history", history, "zeros", decay=False, trained=False)
            g.update(node, {"amax_history": amax}, quantize=dtype)
        else:
            g.update(node, quantize=dtype)
