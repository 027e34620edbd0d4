"""Rotary position embeddings: every attention node gets `rope` on its query and key inputs. With `local_theta`,
the layers whose attention has a sliding window get that theta and no scaling (Gemma 3's local layers); the
sliding-window pass has already put them in blocks of their own, so each block's rope has one theta."""

from dataclasses import dataclass

from axgen.ir import Attrs, Graph, Op, ShapeError, register_op
from axgen.passes.manager import register
from axgen.spec import LinearRopeScaling, RoPE, RopeScaling, YarnRopeScaling


@dataclass(frozen=True, kw_only=True)
class RopeAttrs(Attrs):
    """`rotary_dim`: only the last rotary_dim channels of each head rotate (DeepSeek's qk_rope_head_dim), the
    others pass through; `interleaved`: channel pairs are adjacent (2i, 2i + 1), as DeepSeek's complex product,
    not the halves (i, i + head_dim / 2) of HF Llama's rotate-half."""

    theta: float
    scaling: RopeScaling | LinearRopeScaling | YarnRopeScaling | None = None
    rotary_dim: int | None = None
    interleaved: bool = False


def _rope(ins, attrs, params):
    x = ins["x"]
    if x.axes[-1] != "head_dim" or x.sizes[-1] % 2:
        raise ShapeError(f"rope needs an even trailing head_dim axis, got x{x}")
    if "seq" not in x.axes:
        raise ShapeError(f"rope needs a seq axis, got x{x}")
    if ins["positions"].axes != ("batch", "seq"):
        raise ShapeError(f"rope needs positions [batch, seq], got {ins['positions']}")
    if attrs.rotary_dim is not None and (attrs.rotary_dim % 2 or not 0 < attrs.rotary_dim <= x.sizes[-1]):
        raise ShapeError(f"rotary_dim={attrs.rotary_dim} must be even and within x{x}'s head_dim")
    return x


register_op("rope", ("x", "positions"), _rope, "rope", RopeAttrs)


@register("rope", after=("sliding_window",))
def rope(g: Graph, cfg: RoPE) -> None:
    for attn in list(g.nodes(op="attention")):
        positions = g.node(attn.region, "positions")
        local = cfg.local_theta is not None and attn.attrs.window is not None
        layout = {"rotary_dim": cfg.rotary_dim, "interleaved": cfg.interleaved}
        if local:
            op = Op("rope", theta=cfg.local_theta, **layout)
        else:
            op = Op("rope", theta=cfg.theta, scaling=cfg.scaling, **layout)
        for slot in ("q", "k"):
            g.insert_on_input(attn, slot, op, positions=positions)
