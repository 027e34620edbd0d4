"""Target lowering: after the feature passes, each step writes one kind of target decision into the graph.

`axgen graph SPEC --target T --after lowering` shows the result; the printer renders it and decides nothing. The
steps run in the order listed in `STEPS`; each reads the plan (the mesh rule's and the backend's choices) and
rewrites nodes, regions or the graph's own attrs through the Graph API.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from axgen.backends.common import DOCUMENT_MASKS, KERNEL_OPTIONS, Plan
from axgen.ir import Graph, GraphError, Node, ScanCall
from axgen.ir.ops import ScanAttrs
from axgen.spec import REMAT_POLICIES

# Activations whose sharding the program pins: the residual stream at each layer boundary and the logits. XLA
# propagates the rest from the params.
CONSTRAINED_OPS = ("embed", "add", "lm_head")


def mesh(g: Graph, plan: Plan) -> None:
    """The mesh, its batch split into microbatches, the logical-axis rules for the axes this program uses, and the
    share of each device's memory its allocator takes."""
    types = [n.type for n in g.nodes()] + [p.type for n in g.nodes() for p in n.params.values()]
    used = {axis for t in types for axis in t.axes} | {"layers"}  # stacked block params add `layers`
    g.attrs["mesh"] = dict(plan.mesh)
    g.attrs["microbatches"] = f"{plan.grad_accum_steps}x{plan.microbatch}"
    g.attrs["logical_axis_rules"] = {
        axis: mesh_axes for axis, mesh_axes in plan.logical_axis_rules if axis in used
    }
    if plan.memory_fraction:
        g.attrs["memory_fraction"] = plan.memory_fraction


def shard(g: Graph, plan: Plan) -> None:
    for node in g.nodes():
        if node.op in CONSTRAINED_OPS:
            g.update(node, constrain=node.type.axes)


def attention_kernel(g: Graph, plan: Plan) -> None:
    """The target's kernel, or XLA's path for an attention that needs what the kernel lacks, and how that kernel
    keeps each query inside its document."""
    for node in g.nodes(op="attention"):
        needs = {name for name in KERNEL_OPTIONS["xla"] if getattr(node.attrs, name) is not None}
        kernel = plan.attention if needs <= KERNEL_OPTIONS[plan.attention] else "xla"
        block = plan.attention_block if kernel == "splash" else None
        g.update(node, kernel=kernel, block=block, document_mask=DOCUMENT_MASKS[kernel])


def dot_kind(g: Graph, plan: Plan) -> None:
    """Quantized dots whose spec left the dtype open take the target's."""
    for node in g.nodes():
        if getattr(node.attrs, "quantize", None) == "target":
            g.update(node, quantize=plan.quantize_dtype)


def grouped_matmul(g: Graph, plan: Plan) -> None:
    """How each dropless MoE multiplies its experts' groups of rows: the chip's kernel, with tiles for the widths
    one device holds, else XLA's ragged_dot (with the reason, where the chip has a kernel that cannot run them).
    """
    if plan.grouped_matmul is None:
        return
    rules, mesh = dict(plan.logical_axis_rules), dict(plan.mesh)
    for node in g.nodes(op="moe"):
        if node.attrs.capacity_factor:
            continue
        w_up = node.params["w_up"].type
        mlp_shards = math.prod(mesh[a] for a in rules["mlp"] if a not in rules["expert"])
        tiles = plan.grouped_matmul.tiles(w_up.size("embed"), w_up.size("mlp") // mlp_shards)
        if isinstance(tiles, str):
            g.update(
                node, grouped_matmul="ragged_dot", grouped_matmul_why=f"{plan.grouped_matmul.kernel}: {tiles}"
            )
        else:
            g.update(node, grouped_matmul=plan.grouped_matmul.kernel, tiles=tuple(tiles.items()))


def remat(g: Graph, plan: Plan) -> None:
    """Each block's policy: the spec's, else the target's default. Under a policy, every projection's output gets
    its role as its checkpoint name, the experts' products too, which the policy saves, offloads or recomputes by.
    """
    for region in g.blocks():
        if "remat" not in region.attrs and plan.remat is not None:
            g.set_region_attrs(
                region.name, remat=plan.remat.policy, remat_source=f"default of {plan.remat.origin}"
            )
        if not REMAT_POLICIES[region.attrs.get("remat", "none")].checkpoint:
            continue
        for node in g.nodes(op="linear", region=region.name):
            if node.attrs.role:
                g.update(node, checkpoint_name=node.attrs.role)
        for node in g.nodes(op="moe", region=region.name):
            g.update(node, checkpointed=True)


def scan_grouping(g: Graph, plan: Plan) -> None:
    """What one step of each scan calls: a block's own function when it runs one layer of one block, else a group
    function that runs each block's layers of the step in turn."""
    for scan in g.nodes(op="scan"):
        calls = tuple(_call(g, block, scan.attrs.steps) for block in scan.attrs.blocks)
        if sum(call.aux for call in calls) > 1:
            raise GraphError(f"{scan}: more than one block of a group has auxiliary outputs")
        function = f"{scan.name}_group" if ScanAttrs.groups(calls) else calls[0].function
        g.update(scan, function=function, calls=calls, returns_aux=any(call.aux for call in calls))


def _call(g: Graph, block: str, steps: int) -> ScanCall:
    region = g.regions[block]
    return ScanCall(
        block, region.function, region.repeat // steps, any(_aux(n) for n in g.nodes(region=block))
    )


def aux_losses(g: Graph, plan: Plan) -> None:
    """The auxiliary outputs each region returns, and the losses the training loss adds, by weight."""
    for region in g.regions.values():
        outputs = tuple(f"{n.name}_aux" for n in g.nodes(region=region.name) if _aux(n))
        if outputs:
            g.set_region_attrs(region.name, aux=outputs)
    nodes = list(g.nodes())
    g.attrs["aux_losses"] = {
        name: weight for n in nodes for name, weight in getattr(n.attrs, "aux_weights", ())
    }
    g.attrs["aux_metrics"] = tuple(sorted({name for n in nodes if n.op != "scan" for name in _aux(n)}))


def _aux(node: Node) -> tuple[str, ...]:
    """The auxiliary outputs a node makes itself (a scan only passes on its blocks')."""
    return () if node.op == "scan" else getattr(node.attrs, "aux", ())


STEPS: tuple[Callable[[Graph, Plan], None], ...] = (
    mesh,
    shard,
    attention_kernel,
    dot_kind,
    grouped_matmul,
    remat,
    scan_grouping,
    aux_losses,
)


def lower(g: Graph, plan: Plan) -> None:
    g.attrs["target"] = plan.target
    g.attrs["backend_file"] = plan.backend_file
    for step in STEPS:
        step(g, plan)
