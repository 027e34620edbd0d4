"""Target lowering: after the feature passes, each step writes one kind of target decision into the graph.

`axgen graph SPEC --target T --after lowering` shows the result; the printer renders it and decides nothing: its
templates branch only on a node's op and attrs and on the program-level values these steps put in the graph's
attrs (tests/test_templates.py holds them to that). The steps run in the order listed in `STEPS`; each reads the
plan (the mesh rule's and the backend's choices) and rewrites nodes, regions or the graph's own attrs through the
Graph API.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from axgen.backends.common import Plan
from axgen.ir import Graph, GraphError, Node, ScanCall, cost
from axgen.ir.ops import ScanAttrs
from axgen.runtime.kernels import (
    ATTENTION_FALLBACKS,
    AttentionKernel,
    ATTENTION_KERNELS,
    ATTENTION_OPTIONS,
    GROUPED_MATMUL_KERNELS,
)
from axgen.spec import REMAT_POLICIES, STACK_CASTS

# Activations whose sharding the program pins: the residual stream at each layer boundary and the logits. XLA
# propagates the rest from the params.
CONSTRAINED_OPS = ("embed", "add", "lm_head")
RESIDUAL = ("batch", "seq", "embed")
RESIDUAL_EMBED = "residual_embed"  # its rule: backends/common.py


def target(g: Graph, plan: Plan) -> None:
    """What the program states of its target: the devices and the mesh rule that shaped them, the platform, dtype,
    compiler flags and allocator share, the chip's peak for MFU, and how many hosts a job has."""
    g.attrs["target"] = plan.target
    g.attrs["backend_file"] = plan.backend_file
    g.attrs["devices"] = f"{plan.num_devices} x {plan.chip.name}"
    g.attrs["mesh_rule"] = f"{plan.rule.provenance}: {plan.rule.why}"
    g.attrs["platform"] = plan.platform
    g.attrs["num_hosts"] = plan.num_hosts
    g.attrs["compute_dtype"] = plan.compute_dtype
    g.attrs["chip"] = plan.chip.name
    g.attrs["peak_flops_per_device"] = plan.chip.peak_bf16_flops if plan.chip.published_peak else None
    g.attrs["compiler_flags"] = {plan.flags_variable: plan.xla_flags}
    g.attrs["memory_fraction"] = plan.memory_fraction


def mesh(g: Graph, plan: Plan) -> None:
    """The mesh (and how slices split it), the batch split into microbatches, and the logical-axis rules for the
    axes this program uses: its tensors' and its constraints' (the `shard` lowering's, which runs first)."""
    types = [n.type for n in g.nodes()] + [p.type for n in g.nodes() for p in n.params.values()]
    used = {axis for t in types for axis in t.axes} | {"layers"}  # stacked block params add `layers`
    used |= {axis for n in g.nodes() for axis in n.attrs.constrain or ()}
    g.attrs["mesh"] = dict(plan.mesh)
    g.attrs["dcn_mesh"] = dict(plan.dcn_mesh) if plan.num_slices > 1 else None
    g.attrs["grad_accum_steps"] = plan.grad_accum_steps
    g.attrs["microbatch"] = plan.microbatch
    g.attrs["logical_axis_rules"] = {
        axis: mesh_axes for axis, mesh_axes in plan.logical_axis_rules if axis in used
    }


def shard(g: Graph, plan: Plan) -> None:
    """Pins the residual stream and the logits. Under MeshRule.shard_residual the residual's embed is RESIDUAL_EMBED,
    which the rules give `model`."""
    for node in g.nodes():
        if node.op in CONSTRAINED_OPS:
            axes = node.type.axes
            if plan.shard_residual and axes == RESIDUAL:
                axes = (*axes[:-1], RESIDUAL_EMBED)
            g.update(node, constrain=axes)


# Why a sequence split over context shards meets its keys by gathering them: every device holds its rows' whole
# sequence of keys and values for one layer at a time (Llama 3 8B at 128k tokens: 0.5 GiB in bf16, GQA keeping
# them a quarter of the queries), in one collective the compiler can overlap with the layer's projections. A ring
# would hold two shards' worth but pass c - 1 times, each pass a kernel call too short to hide it; MaxText's
# default is the all-gather too.
def _context_why(g: Graph, node: Node) -> str:
    q, k = (g.inputs(node)[slot].type for slot in ("q", "k"))
    ratio = q.size("heads") // k.size("kv_heads")
    smaller = (
        f"GQA keeps them 1/{ratio} of the queries" if ratio > 1 else "without GQA they are the queries' size"
    )
    return f"each device holds its rows' whole sequence of keys and values for one layer ({smaller})"


def context(g: Graph, plan: Plan) -> None:
    """Where the mesh splits each sequence over context shards: the model's inputs go into context order (each
    shard holds a front and a back chunk, runtime/context.py) and its output back into sequence order, between
    which every op but attention is per position; each attention gathers its keys and values over the shards
    (`context`, with why), and the output head is marked (`context`) for the fused loss, which takes the hidden
    states in context order."""
    rules, mesh = dict(plan.logical_axis_rules), dict(plan.mesh)
    shards = math.prod(mesh[a] for a in rules["seq"])
    if shards == 1:
        return

    def reordered(x: Node, name: str, to: str) -> Node:
        label = f"context parallelism: {shards} shards, each a front and a back chunk of the sequence"
        return g.add(
            "main",
            name,
            "context_order",
            {"x": x},
            source=plan.rule.provenance,
            label=label,
            to=to,
            shards=shards,
        )

    in_context_order: dict[str, Node] = {}
    for node in list(g.nodes(region="main")):
        for slot, producer in g.inputs(node).items():
            if producer.op not in ("input", "positions") or node.op == "positions":
                continue
            if producer.name not in in_context_order:
                in_context_order[producer.name] = reordered(producer, f"context_{producer.name}", "context")
            g.rewire(node, slot, in_context_order[producer.name])
    # The model's output (its logits) goes back into sequence order; a training step's fused loss keeps the hidden
    # states where they are and moves the labels to them and the losses back, a few bytes a position.
    output = g.output("main")
    in_order = reordered(output, f"{output.name}_in_order", "sequence")
    g.set_output(in_order)
    (head,) = g.nodes(op="lm_head")
    g.update(head, context=True)
    for node in g.nodes(op="attention"):
        g.update(node, context="all_gather", context_why=_context_why(g, node))


def attention_kernel(g: Graph, plan: Plan) -> None:
    """Each attention's kernel: the target's, else the first XLA path that takes what the node needs (a soft-cap or
    sinks take plain XLA ops where the kernel lacks them), with why (`kernel_why`), all by runtime/kernels.py's
    table. From the same entry, which the runtime runs by: the splash kernel's block length (the program's
    SPLASH_BLOCK), how the kernel keeps each query inside its document (`document_mask`), and, where v's head dim
    differs from q/k's (`v_head_dim`) and the kernel takes one head dim, `pad_v`: v is zero-padded to q/k's head
    dim and the output sliced back, which is exact and costs the padded channels' flops."""
    for node in g.nodes(op="attention"):
        kernel = ATTENTION_KERNELS[plan.attention]
        why = kernel.refuses(_needs(node), plan.compute_dtype)
        if why is not None:
            kernel = _attention_fallback(node, plan)
        ins = g.inputs(node)
        v_dim, qk_dim = ins["v"].type.size("head_dim"), ins["q"].type.size("head_dim")
        v_head_dim = v_dim if v_dim != qk_dim else None
        g.update(
            node,
            kernel=kernel.name,
            kernel_why=why,
            block=plan.attention_block if kernel.blocked else None,
            document_mask=kernel.document_mask,
            v_head_dim=v_head_dim,
            pad_v=v_head_dim is not None and not kernel.v_head_dim,
        )
    blocks = {n.attrs.block for n in g.nodes(op="attention") if n.attrs.block}
    g.attrs["splash_block"] = _one(blocks, "splash block lengths")


def _needs(node: Node) -> frozenset[str]:
    """The options an attention node needs of its kernel."""
    return frozenset(name for name in ATTENTION_OPTIONS if getattr(node.attrs, name) not in (None, False))


def _attention_fallback(node: Node, plan: Plan) -> AttentionKernel:
    """The first XLA path that takes what the node needs."""
    return next(
        ATTENTION_KERNELS[name]
        for name in ATTENTION_FALLBACKS
        if ATTENTION_KERNELS[name].refuses(_needs(node), plan.compute_dtype) is None
    )


def dot_kind(g: Graph, plan: Plan) -> None:
    """Quantized dots whose spec left the dtype open take the target's."""
    for node in g.nodes():
        if getattr(node.attrs, "quantize", None) == "target":
            g.update(node, quantize=plan.quantize_dtype)


def grouped_matmul(g: Graph, plan: Plan) -> None:
    """How each dropless MoE multiplies its experts' groups of rows: the chip's kernel, with tiles for the widths
    one device holds, else XLA's ragged_dot (with the reason, where the chip has a kernel that cannot run them).
    Quantized experts (`quantize`) take XLA's ragged_dot on int8 or fp8 operands where the kernel's entry in
    runtime/kernels.py takes neither; where the chip's XLA multiplies each row by every expert a device holds
    (GPU), they stay on the kernel in bf16 (`quantize_why`) unless a device holds one expert or the kernel cannot
    tile the widths anyway.
    """
    if plan.grouped_matmul is None:
        return
    rules, mesh = dict(plan.logical_axis_rules), dict(plan.mesh)
    chip = plan.grouped_matmul
    kernel = GROUPED_MATMUL_KERNELS[chip.kernel]
    for node in g.nodes(op="moe"):
        if node.attrs.capacity_factor:
            continue
        w_up = node.params["w_up"].type
        mlp_shards = math.prod(mesh[a] for a in rules["mlp"] if a not in rules["expert"])
        tiles = chip.tiles(w_up.size("embed"), w_up.size("mlp") // mlp_shards)
        if isinstance(tiles, str):
            g.update(node, grouped_matmul="ragged_dot", grouped_matmul_why=f"{kernel.name}: {tiles}")
            continue
        if plan.compute_dtype not in kernel.dtypes:
            why = f"{kernel.name}: it takes {' or '.join(sorted(kernel.dtypes))}, not {plan.compute_dtype}"
            g.update(node, grouped_matmul="ragged_dot", grouped_matmul_why=why)
            continue
        if node.attrs.quantize and node.attrs.quantize not in kernel.dtypes:
            experts_here = w_up.size("expert") // math.prod(mesh[a] for a in rules["expert"])
            if not (chip.ragged_dot_dense and experts_here > 1):
                g.update(
                    node,
                    grouped_matmul="ragged_dot",
                    grouped_matmul_why=f"{kernel.name}: {kernel.why}, and these experts are {node.attrs.quantize}",
                )
                continue
            g.update(
                node,
                quantize=None,
                quantize_why=(
                    f"{kernel.why}, and XLA's ragged_dot here multiplies each row by all {experts_here} experts a "
                    "device holds"
                ),
            )
        g.update(
            node,
            grouped_matmul=kernel.name,
            tiles=tuple(tiles.items()),
            tiles_source=f"{plan.backend_file}: grouped_matmul_tiles",
            check_vma=kernel.names_varying_axes,
        )


def moe_dispatch(g: Graph, plan: Plan) -> None:
    """How each dropless MoE whose experts are split over devices moves its token copies: the mesh rule's or the
    backend's choice, as the collective this chip's compiler has, and the rule's bound on what the all-to-all
    receives. Unsplit experts move nothing."""
    rules, mesh = dict(plan.logical_axis_rules), dict(plan.mesh)
    if math.prod(mesh[a] for a in rules["expert"]) == 1:
        return
    for node in g.nodes(op="moe"):
        if node.attrs.capacity_factor:
            continue
        g.update(node, dispatch=plan.moe_dispatch, dispatch_source=plan.moe_dispatch_source)
        if plan.moe_receive_capacity is not None:
            aux = (*node.attrs.aux, "dropped_fraction")  # the dropped copies counted, as the capacity path's
            g.update(node, receive_capacity=plan.moe_receive_capacity, aux=aux)


def stack_cast(g: Graph, plan: Plan) -> None:
    """When the stacked layers' params become COMPUTE_DTYPE (`stack_cast`: the rule's, the chip's for dropless
    experts, or STACK_CAST; backends/common._stack_cast), and why."""
    g.attrs["stack_cast"] = {
        "name": plan.stack_cast,
        "source": plan.stack_cast_source,
        "why": STACK_CASTS[plan.stack_cast],
    }


def remat(g: Graph, plan: Plan) -> None:
    """Each block's policy: the spec's, else the target's default; the program's one policy (`remat_policy`:
    what it saves and offloads by checkpoint name, and why) when any block checkpoints. Under a policy, every
    projection's output gets its role as its checkpoint name, the experts' products too, which the policy saves,
    offloads or recomputes by."""
    for region in g.blocks():
        if "remat" not in region.attrs and plan.remat is not None:
            g.set_region_attrs(region.name, remat=plan.remat.policy, remat_source=plan.remat_source)
        checkpointed = REMAT_POLICIES[region.attrs.get("remat", "none")].checkpoint
        g.set_region_attrs(region.name, checkpointed=checkpointed)
        if not checkpointed:
            continue
        for node in g.nodes(op="linear", region=region.name):
            if node.attrs.role:
                g.update(node, checkpoint_name=node.attrs.role)
        for node in g.nodes(op="moe", region=region.name):
            g.update(node, checkpointed=True)
    chosen = {(r.attrs["remat"], r.attrs.get("remat_source")) for r in g.blocks() if r.attrs["checkpointed"]}
    policy = _one(chosen, "remat policies of the blocks")
    if policy is None:
        g.attrs["remat_policy"] = None
        return
    name, source = policy
    described = REMAT_POLICIES[name]
    g.attrs["remat_policy"] = {
        "name": name,
        "source": source,
        "save": described.save,
        "offload": described.offload,
        "why": described.why,
    }


def scan_grouping(g: Graph, plan: Plan) -> None:
    """What one step of each scan calls: a block's own function when it runs one layer of one block, else a group
    function that runs each block's layers of the step in turn."""
    for scan in g.nodes(op="scan"):
        calls = tuple(_call(g, block, scan.attrs.steps) for block in scan.attrs.blocks)
        # Several blocks of a group may return auxiliary outputs (gpt-oss: experts in the windowed and the global
        # layers); the group returns their mean, one layer each.
        if any(call.aux and call.per_step > 1 for call in calls):
            raise GraphError(f"{scan}: a block with auxiliary outputs runs several layers a step")
        function = f"{scan.name}_group" if ScanAttrs.groups(calls) else calls[0].function
        g.update(scan, function=function, calls=calls, returns_aux=any(call.aux for call in calls))


def pipeline(g: Graph, plan: Plan) -> None:
    """Where the mesh splits the stacked layers into pipeline stages (the rules give `layers` the `stage` axis):
    the decoder's scan runs as `stages` stages of consecutive steps (GPipe, or 1F1B with the output head and the
    loss in the last stage), or of `stage_repeats` runs of them each that the microbatches go round (circular),
    over each pass's microbatches of `stage_microbatch` sequences per device (runtime.pipeline,
    runtime.pipelined_loss), with why. The train step and the evaluation take their passes as without stages.
    """
    stages, repeats, schedule_name = plan.stages, plan.pipeline_repeats, plan.pipeline_schedule
    if stages == 1:
        return
    (scan,) = g.nodes(op="scan")
    steps_per_stage = -(-scan.attrs.steps // stages)  # 1F1B's; the stages after the last full one hold none
    if schedule_name == "1f1b" and scan.attrs.steps % steps_per_stage:
        raise GraphError(
            f"{plan.rule.provenance}: stage={stages} does not split the {scan.attrs.steps} steps of {scan} into "
            f"stages of {steps_per_stage} steps and empty ones"
        )
    if scan.attrs.steps % (stages * repeats) and schedule_name != "1f1b":
        raise GraphError(
            f"{plan.rule.provenance}: stage={stages} x pipeline_repeats={repeats} does not split the "
            f"{scan.attrs.steps} steps of {scan} (groups of {scan.attrs.calls[0].per_step} layers) into runs of "
            "whole steps"
        )
    if schedule_name == "1f1b":
        (head,) = g.nodes(op="lm_head")
        # The last stage computes the loss of a microbatch as it leaves: one cross-entropy, nothing beside it.
        beside = [
            what
            for what, present in [
                ("auxiliary losses", scan.attrs.returns_aux),
                (f"the {head.attrs.objective} objective", head.attrs.objective),
                ("the quantized output head's unfused loss", head.attrs.loss != "fused"),
                ("adapter dropout", any(n.attrs.lora_dropout for n in g.nodes(op="linear"))),
            ]
            if present
        ]
        if beside:
            raise GraphError(
                f"{plan.rule.provenance}: pipeline_schedule='1f1b' computes the cross-entropy in the last stage, "
                f"and this model trains with {' and '.join(beside)}; use the gpipe or circular schedule"
            )
        context = dict(plan.mesh)["context"]
        if context > 1 and any(n.attrs.kernel == "splash" for n in g.nodes(op="attention")):
            raise GraphError(
                f"{plan.rule.provenance}: pipeline_schedule='1f1b' with context={context} runs attention on each "
                "device's context shard, which splash attention does not do there yet; use attention='xla'"
            )
        (embed,) = g.nodes(op="embed")
        g.update(
            embed,
            lookup="vocab_parallel",
            lookup_why="each device looks up its own rows of the table: XLA cannot partition the gather inside the "
            "1F1B stages (runtime.vocab_parallel_take)",
        )
    per_step = sum(call.per_step for call in scan.attrs.calls)
    per_run = scan.attrs.steps // (stages * repeats) * per_step
    full = scan.attrs.steps // steps_per_stage
    one_f_one_b = (
        f"{stages} stages of {steps_per_stage * per_step} layers"
        if full == stages
        else f"{full} stages of {steps_per_stage * per_step} layers and {stages - full} without"
    )
    size = plan.microbatch // plan.pipeline_microbatches
    schedule = {
        "gpipe": f"{stages} stages of {per_run} layers on the mesh's stage axis, GPipe",
        "1f1b": f"{one_f_one_b} on the mesh's stage axis, 1F1B (the output head and the loss in the last stage)",
        "circular": f"{stages} stages of {repeats} runs of {per_run} layers on the mesh's stage axis (stage s: runs "
        f"s, s + {stages}, ...), circular, {repeats} rounds",
    }[schedule_name]
    why = (
        f"{schedule} over each pass's {plan.pipeline_microbatches} microbatches of {size} sequence(s) per device "
        f"({plan.rule.provenance})"
    )
    g.update(
        scan,
        stages=stages,
        stage_schedule=schedule_name,
        stage_repeats=repeats,
        stage_microbatch=size,
        pipeline=why,
    )


# The float32 logits of one chunk of the fused loss per device, at most (where the sequence halves that far), as
# a fraction of the chip's HBM: a few such buffers live at once, against the whole logits' several GiB at a 128k
# vocabulary. Measured deviceless: a fixed 512 MiB made llama2-7b on tpu-v5e-256 (16 GiB chips) peak at 5.83 GiB
# per chip against 5.53 with the unfused loss, 128 MiB at 5.14; llama3-8b on tpu-v5p-128 (95 GiB) takes the same
# 512-position chunk at 1/128 of HBM as at 512 MiB (50.67 GiB, against 69.25 unfused).
LOSS_CHUNK_OF_HBM = 1 / 128


def loss(g: Graph, plan: Plan) -> None:
    """How the training loss meets the output head (whose logits, or their soft cap, are the main output). An
    unquantized head fuses with the cross-entropy (runtime.lm_head_cross_entropy) in chunks of positions: the
    longest chunk, halving from the whole sequence, whose float32 logits per device fit LOSS_CHUNK_OF_HBM. A
    quantized head keeps its own dot and the loss takes its logits (runtime.cross_entropy)."""
    (head,) = g.nodes(op="lm_head")
    after = [n for n in g.nodes(region="main") if n.op not in ("input", "context_order")]
    after = after[after.index(head) + 1 :]
    if [n.op for n in after] not in ([], ["softcap"]):  # the fused loss knows the cap and nothing else
        raise GraphError(f"the loss cannot follow the output head through {[str(n) for n in after]}")
    if head.attrs.quantize:
        g.update(head, loss="logits")
        g.attrs["loss_summary"] = (
            "runtime.cross_entropy on the whole logits (a quantized head; backends/lowering.py)"
        )
        return
    rules, mesh = dict(plan.logical_axis_rules), dict(plan.mesh)
    vocab = head.type.size("vocab")
    vocab_shards = math.prod(mesh[a] for a in rules["vocab"])
    per_position = plan.microbatch * -(-vocab // vocab_shards) * 4
    # Each context shard's positions go through the head apart (runtime/context.py).
    context_shards = math.prod(mesh[a] for a in rules["seq"])
    chunk = dict((k, v) for k, v, _ in g.attrs["config"])["seq_len"] // context_shards
    while chunk % 2 == 0 and chunk * per_position > plan.chip.hbm_bytes * LOSS_CHUNK_OF_HBM:
        chunk //= 2
    g.update(head, loss="fused", loss_chunk=chunk, loss_soft_cap=after[0].attrs.cap if after else None)
    g.attrs["loss_summary"] = (
        f"runtime.lm_head_cross_entropy, the output head fused with the cross-entropy {chunk} positions at a time"
        f"{', logits soft-capped' if after else ''}; no whole logits in a training step (backends/lowering.py)"
    )


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


def kernel_switches(g: Graph, plan: Plan) -> None:
    """The value of each kernel constant the program prints (ATTENTION_IMPL, GROUPED_MATMUL_IMPL): the target's
    kernel its nodes run, and, for a kernel that needs its chip, the XLA path that AXGEN_XLA_KERNELS=1 swaps in so
    the program runs on CPU (`*_stand_in`, by runtime/kernels.py: the attention fallback that takes what the
    nodes need, the grouped matmul's `stand_in`). Nodes on a path of their own (`kernel_why`, ragged_dot for a
    `grouped_matmul_why`) name it in their call and read no constant."""
    on_target = [n for n in g.nodes(op="attention") if n.attrs.kernel_why is None]
    g.attrs["attention_kernel"] = _one({n.attrs.kernel for n in on_target}, "attention kernels")
    chip_only = [n for n in on_target if ATTENTION_KERNELS[n.attrs.kernel].chip_only]
    g.attrs["attention_stand_in"] = _one(
        {_attention_fallback(n, plan).name for n in chip_only}, "attention paths standing in for the kernel"
    )
    matmuls = {n.attrs.grouped_matmul for n in g.nodes(op="moe") if n.attrs.tiles}
    tiles = {(n.attrs.tiles, n.attrs.tiles_source) for n in g.nodes(op="moe") if n.attrs.tiles}
    g.attrs["grouped_matmul"] = _one(matmuls, "grouped matmul kernels")
    g.attrs["grouped_matmul_stand_in"] = _one(
        {GROUPED_MATMUL_KERNELS[m].stand_in for m in matmuls}, "grouped matmuls standing in for the kernel"
    )
    g.attrs["grouped_matmul_tiles"] = _one(tiles, "grouped matmul tiles (experts of different widths)")


def config(g: Graph, plan: Plan) -> None:
    """CONFIG: the spec's facts from_spec recorded, with the parameter count and FLOPs per token of this graph (a
    training step's; with DPO's reference, its forward pass besides)."""
    params = cost.num_params(g)
    seq_len = dict((k, v) for k, v, _ in g.attrs["config"])["seq_len"]
    flops, why = cost.flops_per_token(g, seq_len), "6 x matmul weights used + causal attention"
    (head,) = g.nodes(op="lm_head")
    if head.attrs.reference:  # DPO runs the reference model forward on every pair too
        flops, why = flops + cost.forward_flops_per_token(g, seq_len), why + " + the reference's forward pass"
    g.attrs["config"] = (
        *g.attrs["config"],
        ("num_params", params, f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"),
        ("flops_per_token", flops, why),
    )


def summary(g: Graph, plan: Plan) -> None:
    """The header's line of what the target chose: a backend's remat default, kernels, dot dtypes."""
    chosen = [
        f"remat(policy={policy['name']}) ({policy['source']})"
        for policy in [g.attrs["remat_policy"]]
        if policy and policy["source"] == plan.remat_source
    ]
    if any(RESIDUAL_EMBED in (n.attrs.constrain or ()) for n in g.nodes()):
        chosen.append(f"residual stream over model ({plan.rule.provenance})")
    kernels = {(n.attrs.kernel, n.attrs.block) for n in g.nodes(op="attention")}
    chosen += [
        f"attention {kernel}" + (f" (blocks of {block})" if block else "")
        for kernel, block in sorted(kernels, key=str)
    ]
    matmuls = {n.attrs.grouped_matmul for n in g.nodes(op="moe") if not n.attrs.capacity_factor}
    chosen += [f"experts by {m}" for m in sorted(matmuls) if m != "ragged_dot"]
    dispatches = {n.attrs.dispatch for n in g.nodes(op="moe") if not n.attrs.capacity_factor}
    chosen += [f"expert tokens by {d}" for d in sorted(dispatches) if d != "all_gather"]
    chosen += _quantized(g)
    g.attrs["lowering_summary"] = " · ".join(chosen) + f" ({plan.backend_file})"


def _quantized(g: Graph) -> list[str]:
    """The header's words for which products are quantized dots: the dtypes, then each region's quantized nodes
    (the routed experts by their `moe` node), and whether the routed experts are among them, with why not where
    the spec asked and the target declined."""
    quantized = [n for n in g.nodes() if getattr(n.attrs, "quantize", None)]
    experts = list(g.nodes(op="moe"))
    declined = sorted({n.attrs.quantize_why for n in experts if n.attrs.quantize_why})
    if not quantized and not declined:
        return []
    by_region: dict[str, list[str]] = {}
    for node in quantized:
        by_region.setdefault(node.region, []).append(node.name)
    names = " ".join(
        f"{region}/{{{','.join(n)}}}" if len(n) > 1 else f"{region}/{n[0]}" for region, n in by_region.items()
    )
    if any(n.attrs.quantize for n in experts):
        names += "; routed experts quantized"
    elif experts:
        names += f"; routed experts unquantized{''.join(f' ({why})' for why in declined)}"
    dtypes = sorted({n.attrs.quantize for n in quantized})
    return [f"{'/'.join(dtypes)} dots: {names}" if quantized else f"no quantized dots{names}"]


def _one(values: set, what: str):
    """The one value a program-level constant takes, None when no node asks for one; nodes that disagree are a
    program one constant cannot print."""
    if len(values) > 1:
        raise GraphError(
            f"the program prints one of each, and its nodes need several {what}: {sorted(values)}"
        )
    return next(iter(values), None)


def _aux(node: Node) -> tuple[str, ...]:
    """The auxiliary outputs a node makes itself (a scan only passes on its blocks')."""
    return () if node.op == "scan" else getattr(node.attrs, "aux", ())


STEPS: tuple[Callable[[Graph, Plan], None], ...] = (
    target,
    shard,
    mesh,
    context,
    attention_kernel,
    dot_kind,
    grouped_matmul,
    moe_dispatch,
    stack_cast,
    remat,
    scan_grouping,
    aux_losses,
    loss,
    pipeline,  # after the loss: 1F1B takes the fused loss into the last stage
    kernel_switches,
    config,
    summary,
)


def lower(g: Graph, plan: Plan) -> None:
    for step in STEPS:
        step(g, plan)
