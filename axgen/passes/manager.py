"""The pass manager: registration by name, ordering constraints, and running the passes a spec asks for.

A pass is `fn(graph, feature_config)`, registered with the names of passes it must run before or after. The run
order is a topological sort of those constraints (ties broken by name, so it is deterministic); a cycle or a
feature with no registered pass is a clear error.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass

import networkx as nx

from axgen.ir import Graph
from axgen.spec import Feature, SpecError, suggest


class PassError(ValueError):
    pass


class FeatureConflict(Exception):
    """Raised by a pass that cannot work with what another pass made; the manager names both features."""

    def __init__(self, other_pass: str, reason: str):
        super().__init__(reason)
        self.other_pass, self.reason = other_pass, reason


@dataclass(frozen=True)
class RegisteredPass:
    name: str
    fn: Callable[[Graph, Feature], None]
    before: tuple[str, ...]
    after: tuple[str, ...]


_REGISTRY: dict[str, RegisteredPass] = {}


def register(name: str, before: tuple[str, ...] | list[str] = (), after: tuple[str, ...] | list[str] = ()):
    def decorate(fn):
        if name in _REGISTRY:
            raise PassError(f"pass {name!r} registered twice")
        _REGISTRY[name] = RegisteredPass(name, fn, tuple(before), tuple(after))
        return fn

    return decorate


def order(names: list[str], registry: dict[str, RegisteredPass] | None = None) -> list[str]:
    """The run order of the named passes under every registered before/after constraint."""
    registry = _REGISTRY if registry is None else registry
    constraints = nx.DiGraph()
    constraints.add_nodes_from(names)
    for p in registry.values():
        constraints.add_edges_from((p.name, later) for later in p.before)
        constraints.add_edges_from((earlier, p.name) for earlier in p.after)
    try:
        full = list(nx.lexicographical_topological_sort(constraints))
    except nx.NetworkXUnfeasible:
        cycle = " -> ".join(a for a, _ in nx.find_cycle(constraints))
        raise PassError(f"pass ordering constraints form a cycle: {cycle}") from None
    return [n for n in full if n in names]


@dataclass(frozen=True)
class AppliedPass:
    registered: RegisteredPass
    feature: Feature


def run_passes(graph: Graph, features: typing.Sequence[Feature]) -> list[AppliedPass]:
    """Applies each feature by its pass, in dependency order; returns the passes run."""
    by_name = {f.pass_name: f for f in features}
    for feature in features:
        if feature.pass_name not in _REGISTRY:
            raise SpecError(
                f"{feature.origin}: feature {feature.pass_name!r} has no pass in axgen/passes/"
                f"{suggest(feature.pass_name, _REGISTRY)}"
            )
    ran = []
    for name in order(list(by_name)):
        registered_pass = _REGISTRY[name]
        feature = by_name[name]
        with graph.applying(name, feature.provenance):
            try:
                registered_pass.fn(graph, feature)
            except FeatureConflict as conflict:
                other = by_name[conflict.other_pass]
                raise SpecError(
                    f"{feature.origin}: {feature.summary()} cannot be combined with {other.summary()} "
                    f"({other.origin}): {conflict.reason}"
                ) from None
        ran.append(AppliedPass(registered_pass, by_name[name]))
    graph.attrs["passes"] = tuple(
        applied.feature.summary() for applied in ran
    )  # the program's header lists them
    return ran
