"""Backends: one file per target family. `plan_for(spec, target)` resolves a target string to a Plan."""

from axgen.backends import cpu, gpu, tpu, trainium
from axgen.backends.common import LOGICAL_AXIS_RULES, Chip, Family, Plan, make_plan
from axgen.backends.lowering import lower
from axgen.spec import MeshRule, Model, SpecError

FAMILIES: tuple[Family, ...] = (cpu.FAMILY, *tpu.FAMILIES, gpu.FAMILY, trainium.FAMILY)

__all__ = [
    "FAMILIES",
    "LOGICAL_AXIS_RULES",
    "Chip",
    "Family",
    "MeshRule",
    "Plan",
    "family_for",
    "lower",
    "plan_for",
]


def family_for(spec: Model, target: str) -> Family:
    """The family that owns `target`; an unknown target is an error that lists the known patterns."""
    family = next((f for f in FAMILIES if f.parse(target) is not None), None)
    if family is None:
        known = ", ".join(f.display for f in FAMILIES)
        raise SpecError(f"{spec.origin}: unknown target {target!r}; known targets: {known}")
    return family


def plan_for(spec: Model, target: str) -> Plan:
    return make_plan(family_for(spec, target), spec, target)
