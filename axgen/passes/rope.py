"""Rotary position embeddings: every attention node gets `rope` on its query and key inputs."""

from dataclasses import dataclass

from axgen.ir import Attrs, Graph, Op, ShapeError, register_op
from axgen.passes.manager import register
from axgen.spec import RoPE, RopeScaling


@dataclass(frozen=True, kw_only=True)
class RopeAttrs(Attrs):
    theta: float
    scaling: RopeScaling | None = None


def _rope(ins, attrs, params):
    x = ins["x"]
    if x.axes[-1] != "head_dim" or x.sizes[-1] % 2:
        raise ShapeError(f"rope needs an even trailing head_dim axis, got x{x}")
    if "seq" not in x.axes:
        raise ShapeError(f"rope needs a seq axis, got x{x}")
    if ins["positions"].axes != ("batch", "seq"):
        raise ShapeError(f"rope needs positions [batch, seq], got {ins['positions']}")
    return x


register_op("rope", ("x", "positions"), _rope, "rope", RopeAttrs)


@register("rope")
def rope(g: Graph, cfg: RoPE) -> None:
    for attn in list(g.nodes(op="attention")):
        positions = g.node(attn.region, "positions")
        for slot in ("q", "k"):
            g.insert_on_input(
                attn, slot, Op("rope", theta=cfg.theta, scaling=cfg.scaling), positions=positions
            )
