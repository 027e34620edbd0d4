"""What every backend shares: chip facts, mesh rules with modifiers, the logical-axis table, and the plan."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field

from axgen.ir.types import LOGICAL_AXES
from axgen.runtime.kernels import ATTENTION_KERNELS
from axgen.spec import MESH_AXES, MeshRule, Model, Remat, SpecError

GIB = 1024**3
# MeshRule.stack_cast where neither the rule nor the chip's family names one. Compiled both ways (docs/aot.md), a
# cast before the layers left the GPU rows' peaks within 0.9 GiB, dense and MoE, and raised their eval peaks 1.6 to
# 4.6 GiB (the eval step holds a bf16 copy of the model).
STACK_CAST = "per_layer"

# Logical axis -> mesh axes, in MaxText's style. A mesh axis already used by an earlier dimension of the same
# tensor is skipped, and one that would not divide the dimension with those taken before it (later axes are
# fallbacks), so activations [batch, seq, embed] shard batch over data x fsdp and leave embed whole, while
# weights [embed, heads, head_dim] shard embed over fsdp and heads over model. Outside the experts, the expert
# mesh axis is one more data-parallel axis and one more fsdp axis of the weights, as in MaxText (its `embed`
# and `q_lora`/`kv_lora` rules); the experts' own weights [expert, embed, mlp] have given it to `expert`. The
# `context` axis splits each sequence (runtime/context.py) and, as MaxText's does, the weights as one more fsdp
# axis: its devices hold different positions of the same rows, so they share the weights' gradients. The `stage`
# axis splits a block's stacked layers into pipeline stages (runtime/stages.py): stage s holds the s-th run of
# consecutive layers, and runs them.
# Every logical axis the IR names has a rule; those not listed here are replicated.
_SHARDED = {
    "batch": ("data", "fsdp", "expert"),
    "seq": ("context",),
    "embed": ("fsdp", "expert", "context"),
    "heads": ("model",),
    "kv_heads": ("model",),
    "mlp": ("model",),
    "vocab": ("model",),
    "expert": ("expert",),
    # MLA's up-projections [latent, heads, head_dim] would otherwise be whole on every device of an fsdp mesh
    # (heads go to `model`): DeepSeek-V3's are 3.2B params a device, 37 GB with their Adam moments.
    "latent": ("fsdp", "expert", "context"),
    "layers": ("stage",),
    # The residual stream between layers under MeshRule.shard_residual: over `model`, which the layers' weights
    # give heads and mlp, never embed.
    "residual_embed": ("model",),
}
LOGICAL_AXIS_RULES: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (axis, _SHARDED.get(axis, ())) for axis in LOGICAL_AXES
)
# 1F1B stages whose layers do not divide the stacked layers (Llama 3.1 405B's 126 on 64 stages): the stack cannot
# split over `stage` by layer, so its weights split over it on their embed or mlp dimension instead (the last
# fallback, where fsdp, context and model leave room) and runtime.pipelined_loss sends each stage its own layers
# once a step (an all-to-all over the stage axis). Activations meet `stage` only inside the stages, where it is
# manual.
UNEVEN_STAGE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (axis, (*mesh_axes, "stage") if axis in ("embed", "mlp") else mesh_axes)
    for axis, mesh_axes in LOGICAL_AXIS_RULES
)


@dataclass(frozen=True)
class Chip:
    """Published per-device facts; `axgen plan` estimates a step's time from the rates."""

    name: str
    peak_bf16_flops: float  # dense, per device
    hbm_bytes: int  # per device
    devices_per_host: int
    capabilities: frozenset[str] = frozenset()  # what features may need: host_offload, int8, fp8
    hbm_bandwidth: float = field(kw_only=True)  # bytes/s
    link_bandwidth: float = field(kw_only=True)  # bytes/s one way, to the devices of the same slice or host
    host_bandwidth: float = field(kw_only=True)  # bytes/s one way, to the host's memory
    # Bytes/s one way from a device to devices on other hosts, where the fast links end at the host (GPUs); None
    # where they span the slice (TPU's ICI) or are not modelled.
    network_bandwidth: float | None = field(default=None, kw_only=True)
    # Devices that are one host's cores (fake CPU devices) share its memory: hbm_bytes is the host's, split among
    # the devices on it.
    shares_host_memory: bool = field(default=False, kw_only=True)
    # False where peak_bf16_flops is an estimate for plans (a host's core), not a chip's published rate: a run
    # there shows tokens/s and no MFU.
    published_peak: bool = field(default=True, kw_only=True)


@dataclass(frozen=True)
class GroupedMatmul:
    """A chip's kernel for the MoE experts' grouped matmuls (a name in runtime/kernels.py's table, which says what
    it takes), and its tiles for expert widths (embed, mlp per device), or the reason it cannot run them."""

    kernel: str
    tiles: Callable[[int, int], dict[str, int] | str]
    # Quantized experts the kernel does not take: whether the chip's XLA multiplies every row by each expert a
    # device holds (a masked dense dot, as XLA's GPU compiler rewrites ragged_dot): then the experts stay on the
    # kernel in bf16 unless a device holds one expert.
    ragged_dot_dense: bool = False


@dataclass(frozen=True)
class Family:
    """A backend's targets: a name pattern whose first group is the device count (per slice, where a second group
    counts slices), chip facts, mesh rules, and the defaults a rule may override."""

    name: str
    pattern: str  # e.g. r"gpu-h100-(\d+)"
    display: str  # e.g. "gpu-h100-N"
    chip: Chip
    rules: tuple[MeshRule, ...]
    compute_dtype: str
    attention: str  # the default kernel, one of `kernels`
    kernels: tuple[str, ...] = ("xla",)  # attention kernels this chip can run
    platform: str = "cpu"  # jax's name for the backend: cpu, tpu, cuda, neuron
    flags_variable: str = "XLA_FLAGS"  # the environment variable the runtime reads the flags from
    xla_flags: tuple[str, ...] = ()
    # Fake devices: the flag, formatted with the target's device count, that makes jax show that many (on one host).
    device_count_flag: str | None = None
    remat: Remat | None = None  # the default when the spec has no remat feature
    quantize_dtype: str = "int8"  # what `quantize(dtype=None)` becomes
    # Devices per slice -> the topology `axgen aot` compiles for without the chips; None: fake CPU devices.
    topology: Callable[[int], str] | None = None
    # Topology -> which of its dimensions close into a ring (wraparound links), as the chips are wired; None: the
    # compiler's default.
    topology_wrap: Callable[[str], tuple[bool, ...]] | None = None
    grouped_matmul: GroupedMatmul | None = None  # None: MoE experts use XLA's ragged_dot
    stack_cast: str = STACK_CAST  # MeshRule.stack_cast's default on this chip
    # How a dropless MoE whose experts are split over devices moves its token copies (MeshRule.moe_dispatch), and
    # the collective that `all_to_all` becomes here: XLA:CPU has no ragged-all-to-all, so the CPU's is
    # jax.lax.all_to_all with room for every local copy per destination.
    moe_dispatch: str = "all_gather"
    moe_all_to_all: str = "all_to_all"
    # The share of each device's memory the emitted program's allocator takes; None: the runtime's own (TPU and
    # CPU programs, whose compiler or host decides).
    memory_fraction: float | None = None

    def parse(self, target: str) -> tuple[int, int] | None:
        """(devices per slice, slices) of a target this family owns, else None."""
        match = re.fullmatch(self.pattern, target)
        if match is None:
            return None
        slices = match.group(2) if match.re.groups > 1 else None
        return int(match.group(1)), int(slices or 1)


@dataclass(frozen=True)
class Plan:
    """Every target-specific choice the emitted program makes."""

    target: str
    family: str
    backend_file: str
    chip: Chip
    platform: str
    num_devices: int  # over all slices
    num_slices: int
    mesh: tuple[tuple[str, int], ...]  # over all devices
    rule: MeshRule
    compute_dtype: str
    attention: str
    attention_block: int | None
    microbatch: int  # sequences per device per forward/backward pass
    grad_accum_steps: int
    pipeline_microbatches: int  # each pass's, through the pipeline stages (where there are stages)
    pipeline_repeats: int  # rounds of the stages a microbatch takes: 1, GPipe; more, circular
    pipeline_schedule: str  # PIPELINE_SCHEDULES: the rule's, else circular with rounds, else GPipe
    flags_variable: str
    xla_flags: tuple[str, ...]
    topology: str | None  # for ahead-of-time compilation; None: fake CPU devices with this mesh
    topology_wrap: tuple[bool, ...] | None  # which of the topology's dimensions wrap around
    remat: Remat | None  # the rule's or the backend's default, for blocks whose spec names no policy
    remat_source: str | None  # where that default was set, by file and name: what the program prints
    quantize_dtype: str  # what a quantized dot whose spec names no dtype becomes
    grouped_matmul: GroupedMatmul | None
    moe_dispatch: str  # all_gather, or the collective the target's all_to_all dispatch takes
    moe_dispatch_source: str  # the rule or backend default it came from
    moe_receive_capacity: float | None  # the rule's bound on the all-to-all's receive buffer (MeshRule's)
    shard_residual: bool  # the residual stream between layers split over `model` too (MeshRule's)
    stack_cast: str  # when the stacked layers' params become compute_dtype (STACK_CASTS)
    stack_cast_source: str  # the rule or backend default it came from
    memory_fraction: float | None
    logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...] = LOGICAL_AXIS_RULES

    @property
    def num_hosts(self) -> int:
        return self.num_slices * math.ceil(self.num_devices // self.num_slices / self.chip.devices_per_host)

    @property
    def stages(self) -> int:
        """Pipeline stages: how many parts the mesh axes the rules give `layers` split a block's stacked layers into."""
        return math.prod(dict(self.mesh)[a] for a in dict(self.logical_axis_rules)["layers"])

    @property
    def usable_bytes(self) -> int:
        """Per device: what the program's allocator may take, which is what a compiled step must fit in."""
        usable = int(self.chip.hbm_bytes * (self.memory_fraction or 1))
        if self.chip.shares_host_memory:
            return usable // min(self.num_devices // self.num_slices, self.chip.devices_per_host)
        return usable

    @property
    def dcn_mesh(self) -> tuple[tuple[str, int], ...]:
        """The mesh across slices: slices split `data`, every other axis stays inside a slice."""
        return tuple((axis, self.num_slices if axis == "data" else 1) for axis, _ in self.mesh)


def _device_count_flags(family: Family, num_devices: int) -> tuple[str, ...]:
    if family.device_count_flag is None or num_devices == 1:
        return ()
    return (family.device_count_flag.format(num_devices),)


def make_plan(family: Family, spec: Model, target: str) -> Plan:
    per_slice, slices = family.parse(target)
    if not per_slice or not slices:
        raise SpecError(f"{spec.origin}: target {target!r} needs at least one device and one slice")
    rule = next(r for r in (*spec.mesh_rules, *family.rules) if r.matches(target))
    mesh = tuple(
        (axis, size * slices if axis == "data" else size)
        for axis, size in _mesh_shape(rule, per_slice, slices, target)
    )
    if spec.train is None:
        raise SpecError(f"{spec.origin}: Model.train is needed to build a training program (for {target})")
    batch_shards = math.prod(n for a, n in mesh if a in dict(LOGICAL_AXIS_RULES)["batch"])
    per_device_batch = spec.train.global_batch // batch_shards
    if spec.train.global_batch % batch_shards:
        spec.train.fail(
            "global_batch",
            f"is not divisible by the {batch_shards} batch shards (data x fsdp x expert) of target {target}",
        )
    microbatch = min(rule.microbatch or per_device_batch, per_device_batch)
    attention = rule.attention or family.attention
    if per_device_batch % microbatch:
        raise SpecError(
            f"{rule.origin}: MeshRule.microbatch={rule.microbatch} does not divide the {per_device_batch} sequences "
            f"per device that Train.global_batch={spec.train.global_batch} gives on target {target} ({spec.train.origin})"
        )
    plan = Plan(
        target=target,
        family=family.name,
        backend_file=f"backends/{family.name}.py",
        chip=family.chip,
        platform=family.platform,
        num_devices=per_slice * slices,
        num_slices=slices,
        mesh=mesh,
        rule=rule,
        compute_dtype=rule.compute_dtype or family.compute_dtype,
        attention=attention,
        attention_block=_attention_block(rule, attention, spec, dict(mesh)["context"]),
        microbatch=microbatch,
        grad_accum_steps=per_device_batch // microbatch,
        pipeline_microbatches=rule.pipeline_microbatches or microbatch,
        pipeline_repeats=rule.pipeline_repeats or 1,
        pipeline_schedule=rule.pipeline_schedule
        or ("circular" if (rule.pipeline_repeats or 1) > 1 else "gpipe"),
        flags_variable=family.flags_variable,
        xla_flags=family.xla_flags + _device_count_flags(family, per_slice * slices) + rule.xla_flags,
        topology=family.topology(per_slice) if family.topology else None,
        topology_wrap=family.topology_wrap(family.topology(per_slice)) if family.topology_wrap else None,
        remat=rule.remat or family.remat,
        remat_source=_remat_source(rule, family),
        quantize_dtype=rule.quantize_dtype or family.quantize_dtype,
        grouped_matmul=family.grouped_matmul,
        moe_dispatch=_moe_dispatch(rule.moe_dispatch or family.moe_dispatch, family),
        moe_dispatch_source=(
            rule.provenance if rule.moe_dispatch else f"backends/{family.name}.py: moe_dispatch default"
        ),
        moe_receive_capacity=rule.moe_receive_capacity,
        shard_residual=bool(rule.shard_residual),
        **_stack_cast(rule, family),
        memory_fraction=rule.memory_fraction or family.memory_fraction,
    )
    if plan.pipeline_schedule == "1f1b" and spec.decoder.num_layers % max(plan.stages, 1):
        plan = dataclasses.replace(plan, logical_axis_rules=UNEVEN_STAGE_RULES)
    _check_attention(plan, family, spec)
    _check_context(plan, spec)
    _check_stages(plan, spec)
    _check_capabilities(plan, spec)
    _check_residual(plan)
    return plan


def _check_residual(plan: Plan) -> None:
    rule = plan.rule
    refused = residual_refused(dict(plan.mesh)) if plan.shard_residual else None
    if refused:
        raise SpecError(
            f"{rule.origin}: MeshRule.shard_residual=True (pattern {rule.pattern!r}) on {plan.target}: {refused}"
        )


def residual_refused(mesh: dict[str, int]) -> str | None:
    """Why the residual stream cannot be split over `model` on this mesh, or None: what a rule asking for it is
    refused with, and what keeps `axgen plan` from trying it. Where two mesh axes split the batch (data x fsdp,
    data x expert, fsdp x expert), XLA's SPMD partitioner (jax 0.12.0.1 and 0.11.2) computes a layer's output
    projection onto the split residual with two devices' batch rows swapped: it permutes the input's rows into
    the order of the axis that also splits the weight, for the weight's gather, and never permutes them back
    (tests/test_mesh_rules.py keeps the smallest case). A wrong model is refused, not emitted."""
    if mesh["model"] == 1:
        return "the mesh has model=1; give it a model axis or drop shard_residual"
    batch = [f"{axis}={mesh[axis]}" for axis in dict(LOGICAL_AXIS_RULES)["batch"] if mesh[axis] > 1]
    if len(batch) > 1:
        return (
            f"the mesh splits the batch over {' x '.join(batch)}, and XLA's partitioner swaps batch rows between "
            "devices where two axes split the batch and the residual is split over model (a wrong model, not an "
            "error); split the batch over one axis or drop shard_residual"
        )
    return None


def _check_context(plan: Plan, spec: Model) -> None:
    """A sequence split over `context` shards is cut into twice as many equal chunks (runtime/context.py)."""
    context = dict(plan.mesh)["context"]
    moe = spec.feature("moe")
    if context > 1 and moe is not None and moe.capacity_factor is not None:
        raise SpecError(
            f"{plan.rule.origin}: MeshRule.mesh context={context} (pattern {plan.rule.pattern!r}) splits sequences, "
            f"and the experts of {moe.origin} have MoE.capacity_factor={moe.capacity_factor}: a capacity per "
            "sequence keeps its first tokens, which a split sequence no longer holds in order; use dropless "
            "routing (capacity_factor=None) with context parallelism"
        )
    if context > 1 and spec.train.seq_len % (2 * context):
        raise SpecError(
            f"{plan.rule.origin}: MeshRule.mesh context={context} (pattern {plan.rule.pattern!r}) does not cut "
            f"Train.seq_len={spec.train.seq_len} into {2 * context} equal chunks (each context shard holds a "
            f"front and a back chunk, so causal attention's work is even; {spec.train.origin})"
        )


def _check_stages(plan: Plan, spec: Model) -> None:
    """Pipeline stages split one stack of identical layers into runs of consecutive layers (runtime/stages.py)."""
    stages, rule = plan.stages, plan.rule
    if stages == 1:
        for name in ("pipeline_microbatches", "pipeline_repeats", "pipeline_schedule"):
            if getattr(rule, name) is not None:
                raise SpecError(
                    f"{rule.origin}: MeshRule.{name}={getattr(rule, name)} (pattern {rule.pattern!r}) is for "
                    f"pipeline stages, and its mesh has none; give the mesh a stage axis or drop {name}"
                )
        return
    refused = stages_refused(spec, stages, uneven=plan.pipeline_schedule == "1f1b")
    if refused:
        raise SpecError(f"{rule.origin}: MeshRule.mesh stage={stages} (pattern {rule.pattern!r}) {refused}")
    if (plan.pipeline_schedule == "circular") != (plan.pipeline_repeats > 1):
        raise SpecError(
            f"{rule.origin}: MeshRule.pipeline_schedule={plan.pipeline_schedule!r} (pattern {rule.pattern!r}) with "
            f"pipeline_repeats={plan.pipeline_repeats}: only the circular schedule goes round the stages more than "
            "once; give it pipeline_repeats >= 2, or the others none"
        )
    context = dict(plan.mesh)["context"]
    if context > 1 and plan.shard_residual and stages & (stages - 1):
        # Compiled with context=2 (GPipe and 1F1B alike): the 405B's widths with model=8 at stage=2, 4 and 8, and
        # llama_tiny with model=2 at stage=6, compile; the 405B's at 3, 6, 42 and 63 and llama_tiny's at 3 and 5
        # abort in the partitioner. Refused short of a power of two, where none aborted.
        raise SpecError(
            f"{rule.origin}: MeshRule.mesh stage={stages} (pattern {rule.pattern!r}) with context={context} and "
            "shard_residual: XLA's partitioner aborts on such stage counts that are not a power of two (jax "
            "0.12.0.1, a check in mesh_and_axis.cc or named_sharding.cc); use 2, 4, 8, ... stages, or drop "
            "shard_residual"
        )
    refused = None if plan.pipeline_schedule == "1f1b" else runs_refused(spec, stages, plan.pipeline_repeats)
    if refused:
        raise SpecError(
            f"{rule.origin}: MeshRule.pipeline_repeats={plan.pipeline_repeats} (pattern {rule.pattern!r}) {refused}"
        )
    if plan.microbatch % plan.pipeline_microbatches:
        raise SpecError(
            f"{rule.origin}: MeshRule.pipeline_microbatches={rule.pipeline_microbatches} (pattern "
            f"{rule.pattern!r}) does not split a pass of {plan.microbatch} sequences per device "
            f"(MeshRule.microbatch on {plan.target}) into microbatches of as many sequences each"
        )


def runs_refused(spec: Model, stages: int, repeats: int) -> str | None:
    """Why the spec's layers cannot go round `stages` stages `repeats` times (the circular schedule), or None: what
    a rule asking for it is refused with, and what keeps `axgen plan` from trying it."""
    layers = spec.decoder.num_layers
    if layers % (stages * repeats):
        return (
            f"does not cut Decoder.num_layers={layers} into {stages} stages x {repeats} runs of as many layers "
            f"each ({spec.origin})"
        )
    return None


def stages_refused(spec: Model, stages: int, uneven: bool = False) -> str | None:
    """Why the spec's layers cannot run in `stages` pipeline stages, or None: what a rule asking for them is
    refused with, and what keeps `axgen plan` from trying them. `uneven` (1F1B): stages of ceil(layers / stages)
    layers each but the last ones, which hold none (Llama 3.1 405B's 126 layers on 64 stages: 63 of 2 and one that
    runs the head alone)."""
    layers = spec.decoder.num_layers
    if stages > layers:
        return f"is more stages than the {layers} layers of Decoder.num_layers ({spec.origin})"
    per_stage = -(-layers // stages)
    if uneven and layers % per_stage:
        return (
            f"does not split Decoder.num_layers={layers} into stages of {per_stage} layers and empty ones "
            f"({spec.origin})"
        )
    if layers % stages and not uneven:
        return (
            f"does not split Decoder.num_layers={layers} into stages of as many layers each ({spec.origin})"
        )
    moe, lora = spec.feature("moe"), spec.feature("lora")
    if moe is not None:
        return (
            f"and the routed experts of {moe.origin}: experts under pipeline stages are not built (their "
            "auxiliary losses and expert axis would cross the stages); use fsdp, expert and model"
        )
    if lora is not None and lora.dropout:
        return (
            f"and F.lora(dropout={lora.dropout}) ({lora.origin}): adapters' dropout under pipeline stages is not "
            "built; use dropout=0.0"
        )
    return None


def _stack_cast(rule: MeshRule, family: Family) -> dict[str, str]:
    """Plan.stack_cast and where it came from: the rule's, else the chip family's (Family.stack_cast)."""
    if rule.stack_cast:
        return {"stack_cast": rule.stack_cast, "stack_cast_source": rule.provenance}
    if family.stack_cast != STACK_CAST:
        return {
            "stack_cast": family.stack_cast,
            "stack_cast_source": f"backends/{family.name}.py: stack_cast",
        }
    return {"stack_cast": STACK_CAST, "stack_cast_source": "backends/common.py: STACK_CAST"}


def _moe_dispatch(dispatch: str, family: Family) -> str:
    """all_gather, or the collective that carries the all-to-all dispatch on this family's chips."""
    return family.moe_all_to_all if dispatch == "all_to_all" else dispatch


def _remat_source(rule: MeshRule, family: Family) -> str | None:
    """`backends/gpu.py: remat default`, or the mesh rule that overrides it, named as an emitted program names
    where a choice came from: by file and name, without a line."""
    if rule.remat is not None:
        return rule.provenance
    return family.remat.origin.provenance("remat default") if family.remat is not None else None


def _mesh_shape(rule: MeshRule, num_devices: int, slices: int, target: str) -> tuple[tuple[str, int], ...]:
    """The rule's mesh over `num_devices` (one slice's), every axis named, -1 resolved."""
    fixed = math.prod(n for n in rule.mesh.values() if n != -1)
    rest = [a for a, n in rule.mesh.items() if n == -1]
    if num_devices % fixed or (not rest and fixed != num_devices):
        per_slice = " per slice" if slices > 1 else ""
        raise SpecError(
            f"{rule.origin}: MeshRule.mesh={rule.mesh} (pattern {rule.pattern!r}) does not fit the "
            f"{num_devices} devices{per_slice} of target {target}"
        )
    sizes = {**{a: 1 for a in MESH_AXES}, **rule.mesh, **{a: num_devices // fixed for a in rest}}
    return tuple((a, sizes[a]) for a in MESH_AXES)


def _attention_block(rule: MeshRule, attention: str, spec: Model, context: int) -> int | None:
    """A blocked kernel's (splash attention's) block length: the rule's, else the largest of 128, 256, 512 that
    divides the queries of one context shard (seq_len / context)."""
    if not ATTENTION_KERNELS[attention].blocked:
        return None
    return rule.attention_block or math.gcd(spec.train.seq_len // context, 512)


def _check_attention(plan: Plan, family: Family, spec: Model) -> None:
    if plan.attention not in family.kernels:
        raise SpecError(
            f"{plan.rule.origin}: MeshRule.attention={plan.attention!r} is not a kernel of target {plan.target} "
            f"({plan.chip.name} runs {', '.join(family.kernels)})"
        )
    block, context = plan.attention_block, dict(plan.mesh)["context"]
    if block is not None and ((spec.train.seq_len // context) % block or block % 128):
        shard = f" / context={context}" if context > 1 else ""
        raise SpecError(
            f"{spec.train.origin}: Train.seq_len={spec.train.seq_len}{shard} is not a multiple of the {block}-long "
            f"blocks of splash attention on target {plan.target} (set by {plan.rule.origin}; blocks are multiples "
            "of 128)"
        )


def _check_capabilities(plan: Plan, spec: Model) -> None:
    """What the spec's features need, and the default remat when the spec names none, the chip must have."""
    defaults = (plan.remat,) if plan.remat and spec.feature("remat") is None else ()
    for feature in (*spec.features, *defaults):
        for need in feature.requires():
            if need not in plan.chip.capabilities:
                have = ", ".join(sorted(plan.chip.capabilities)) or "none of them"
                raise SpecError(
                    f"{feature.origin}: {feature.summary()} needs {need}, which target {plan.target} "
                    f"({plan.chip.name}) does not have (it has {have})"
                )
