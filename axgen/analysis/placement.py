"""Where a program's trained params fall on one device of its mesh, by the rules table the program runs
(`runtime.logical_to_mesh`): what `axgen build` warns of and `axgen plan` prunes meshes by, before any compile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from axgen.backends.common import GIB
from axgen.build import Built
from axgen.ir import Graph
from axgen.runtime.sharding import logical_to_mesh, shards

# A trained value's bytes on its devices through a step: the float32 param and AdamW's two float32 moments.
STATE_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class Placement:
    params: int  # trained values, each layer's counted
    per_device: int  # the values one device holds
    # What a device would hold were each param split over every mesh axis its logical axes' rules name (data
    # parallelism holds copies; so do pipeline stages of what is not a stacked layer).
    even_share: float
    whole: tuple[str, ...]  # the params no mesh axis splits, largest first

    @property
    def state_bytes(self) -> int:
        """Per device: the params and their optimizer state."""
        return STATE_BYTES_PER_PARAM * self.per_device


def placement(graph: Graph, rules: dict[str, tuple[str, ...]], mesh: dict[str, int]) -> Placement:
    params = per_device = 0
    even_share = 0.0
    whole: dict[str, int] = {}
    for node in graph.nodes():
        repeat = graph.regions[node.region].repeat
        for param in node.params.values():
            if not param.trained:
                continue
            size = math.prod(param.shape) * repeat
            split = math.prod(
                shards(e, mesh) for e in logical_to_mesh(rules, param.type.axes, param.shape, mesh)
            )
            params += size
            per_device += size // split
            even_share += size / math.prod(
                mesh.get(m, 1) for m in {m for axis in param.type.axes for m in rules.get(axis, ())}
            )
            if split == 1:
                whole[param.key] = whole.get(param.key, 0) + size
    return Placement(params, per_device, even_share, tuple(sorted(whole, key=whole.get, reverse=True)))


def uneven(built: Built) -> str | None:
    """One line when a device would hold more than twice its even share of the params: those whose dims no mesh
    axis divides stay whole on every device, which the program does without a word (gpt-oss-120b on fsdp=256,
    whose 2880 width 256 does not divide, held 1.3 TB a chip)."""
    mesh = dict(built.plan.mesh)
    found = placement(built.graph, dict(built.plan.logical_axis_rules), mesh)
    if found.per_device <= 2 * found.even_share:
        return None
    split = " ".join(f"{axis}={size}" for axis, size in mesh.items() if size > 1)
    return (
        f"{built.spec.origin.file} on {built.plan.target}: a device holds {found.per_device / 1e9:.2f}B of the "
        f"{found.params / 1e9:.2f}B params ({found.per_device / found.even_share:.0f}x its even share over "
        f"{split}; {found.state_bytes / GIB:.1f} GiB with AdamW's moments): no mesh axis divides the dims of "
        f"{', '.join(found.whole[:3])}{' and others' if len(found.whole) > 3 else ''}, so they stay whole; a mesh "
        f"rule whose axes divide them shards them"
    )
