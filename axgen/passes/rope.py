"""Rotary position embeddings: every attention node gets `rope` on its query and key inputs."""

from axgen.ir import Graph, Op
from axgen.passes.manager import register
from axgen.spec import RoPE


@register("rope")
def rope(g: Graph, cfg: RoPE) -> None:
    for attn in list(g.nodes(op="attention")):
        positions = g.node(attn.region, "positions")
        for slot in ("q", "k"):
            g.insert_on_input(
                attn, slot, Op("rope", theta=cfg.theta, scaling=cfg.scaling), positions=positions
            )
