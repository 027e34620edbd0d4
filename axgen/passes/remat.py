"""Rematerialisation: the spec's policy for every decoder block. The remat lowering applies it (or the target's
default where the spec names none): `jax.checkpoint` per layer, saving or offloading the projections it names.
"""

from axgen.ir import Graph
from axgen.passes.manager import register
from axgen.spec import Remat


@register("remat", after=("moe",))
def remat(g: Graph, cfg: Remat) -> None:
    for region in g.blocks():
        g.set_region_attrs(region.name, remat=cfg.policy, remat_source=cfg.provenance)
