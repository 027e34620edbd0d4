"""Rotary position embeddings: every attention node gets `rope` on its query and key inputs. With `local_theta`,
the layers whose attention has a sliding window get that theta and no scaling (Gemma 3's local layers); the
sliding-window pass has already put them in blocks of their own, so each block's rope has one theta."""

from dataclasses import dataclass

from axgen.ir import Attrs, Graph, Op, ShapeError, register_op
from axgen.passes.manager import register
from axgen.spec import LinearRopeScaling, RoPE, RopeScaling, YarnRopeScaling


@dataclass(frozen=True, kw_only=True)
class RopeAttrs(Attrs):
    theta: float
    scaling: RopeScaling | LinearRopeScaling | YarnRopeScaling | None = None


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


@register("rope", after=("sliding_window",))
def rope(g: Graph, cfg: RoPE) -> None:
    for attn in list(g.nodes(op="attention")):
        positions = g.node(attn.region, "positions")
        local = cfg.local_theta is not None and attn.attrs.window is not None
        op = Op("rope", theta=cfg.local_theta) if local else Op("rope", theta=cfg.theta, scaling=cfg.scaling)
        for slot in ("q", "k"):
            g.insert_on_input(attn, slot, op, positions=positions)
