"""What every backend shares: chip facts, mesh rules with modifiers, the logical-axis table, and the plan."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from axgen.spec import Feature, Model, Remat, SpecError

# Outermost first: `model` is innermost so its collectives use the fastest links between neighbouring devices.
MESH_AXES = ("data", "fsdp", "expert", "model")
GIB = 1024**3

# Logical axis -> mesh axes, in MaxText's style. A mesh axis already used by an earlier dimension of the same
# tensor is skipped, so activations [batch, seq, embed] shard batch over data x fsdp and leave embed whole, while
# weights [embed, heads, head_dim] shard embed over fsdp and heads over model. Outside the experts, the expert
# mesh axis is one more data-parallel axis, as in MaxText.
LOGICAL_AXIS_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("seq", ()),
    ("embed", ("fsdp",)),
    ("heads", ("model",)),
    ("kv_heads", ("model",)),
    ("head_dim", ()),
    ("mlp", ("model",)),
    ("vocab", ("model",)),
    ("expert", ("expert",)),
    ("amax_history", ()),
    ("fp8_operand", ()),
    ("layers", ()),
)


@dataclass(frozen=True)
class Chip:
    name: str
    peak_bf16_flops: float  # dense, per device
    hbm_bytes: int  # per device
    devices_per_host: int
    capabilities: frozenset[str] = frozenset()  # what features may need: host_offload, int8, fp8


@dataclass(frozen=True)
class MeshRule:
    """Regex over the target name -> mesh shape (-1 = the remaining devices) and modifiers. First match wins."""

    pattern: str
    mesh: dict[str, int]
    why: str
    compute_dtype: str | None = None
    attention: str | None = None
    xla_flags: tuple[str, ...] = ()
    remat: Remat | None = None
    quantize_dtype: str | None = None

    def matches(self, target: str) -> bool:
        return re.fullmatch(self.pattern, target) is not None

    def mesh_shape(self, num_devices: int, target: str) -> tuple[tuple[str, int], ...]:
        fixed = math.prod(n for n in self.mesh.values() if n != -1)
        rest = [a for a, n in self.mesh.items() if n == -1]
        if num_devices % fixed or len(rest) > 1 or (not rest and fixed != num_devices):
            raise SpecError(f"mesh rule {self.pattern!r} gives {self.mesh}, which does not fit {num_devices} devices of {target}")
        sizes = {**{a: 1 for a in MESH_AXES}, **self.mesh, **{a: num_devices // fixed for a in rest}}
        return tuple((a, sizes[a]) for a in MESH_AXES)


@dataclass(frozen=True)
class Family:
    """A backend's targets: a name pattern whose first group is the device count, chip facts, rules, defaults."""

    name: str
    pattern: str  # e.g. r"gpu-h100-(\d+)"
    display: str  # e.g. "gpu-h100-N"
    chip: Chip
    rules: tuple[MeshRule, ...]
    compute_dtype: str
    attention: str  # "xla" | "cudnn"
    xla_flags: tuple[str, ...] = ()
    remat: Remat | None = None  # the default when the spec has no remat feature
    quantize_dtype: str = "int8"  # what `quantize(dtype=None)` becomes

    def num_devices(self, target: str) -> int | None:
        match = re.fullmatch(self.pattern, target)
        return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Plan:
    """Every target-specific choice the emitted program makes."""

    target: str
    family: str
    backend_file: str
    chip: Chip
    num_devices: int
    mesh: tuple[tuple[str, int], ...]
    rule: MeshRule
    compute_dtype: str
    attention: str
    xla_flags: tuple[str, ...]
    features: tuple[Feature, ...]  # the spec's, completed for this target, and the backend's defaults
    logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...] = LOGICAL_AXIS_RULES
    constrained_ops: frozenset[str] = field(default=frozenset({"embed", "add", "lm_head"}))

    @property
    def num_hosts(self) -> int:
        return math.ceil(self.num_devices / self.chip.devices_per_host)

    def mesh_size(self, *axes: str) -> int:
        return math.prod(n for a, n in self.mesh if a in axes)


def make_plan(family: Family, spec: Model, target: str) -> Plan:
    num_devices = family.num_devices(target)
    if not num_devices:
        raise SpecError(f"{spec.origin}: target {target!r} needs at least one device")
    rule = next(r for r in family.rules if r.matches(target))
    plan = Plan(
        target=target,
        family=family.name,
        backend_file=f"backends/{family.name}.py",
        chip=family.chip,
        num_devices=num_devices,
        mesh=rule.mesh_shape(num_devices, target),
        rule=rule,
        compute_dtype=rule.compute_dtype or family.compute_dtype,
        attention=rule.attention or family.attention,
        xla_flags=family.xla_flags + rule.xla_flags,
        features=_features(spec, rule, family),
    )
    _check_capabilities(plan)
    batch_shards = plan.mesh_size(*dict(LOGICAL_AXIS_RULES)["batch"])
    if spec.train.global_batch % batch_shards:
        spec.train.fail(
            "global_batch", f"is not divisible by the {batch_shards} batch shards (data x fsdp x expert) of target {target}"
        )
    return plan


def _features(spec: Model, rule: MeshRule, family: Family) -> tuple[Feature, ...]:
    """The spec's features with target-chosen fields filled in, then the backend's defaults the spec lacks."""
    preferences = {"quantize_dtype": rule.quantize_dtype or family.quantize_dtype}
    chosen = tuple(f.for_target(preferences) for f in spec.features)
    defaults = [f for f in (rule.remat or family.remat,) if f is not None]
    return chosen + tuple(f for f in defaults if spec.feature(f.pass_name) is None)


def _check_capabilities(plan: Plan) -> None:
    for feature in plan.features:
        for need in feature.requires():
            if need not in plan.chip.capabilities:
                have = ", ".join(sorted(plan.chip.capabilities)) or "none of them"
                raise SpecError(
                    f"{feature.origin}: {feature.summary()} needs {need}, which target {plan.target} "
                    f"({plan.chip.name}) does not have (it has {have})"
                )
