"""Spec file -> graph -> feature passes -> target lowering -> program text, and where each program lives in
`generated/`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from axgen.backends import Plan, lower, plan_for
from axgen.codegen import emit
from axgen.ir import Graph, from_spec
from axgen.loader import load_spec
from axgen.passes import run_passes
from axgen.passes.manager import AppliedPass
from axgen.spec import MeshRule, Model


@dataclass(frozen=True)
class Built:
    spec: Model
    target: str
    plan: Plan
    graph: Graph
    passes: list[AppliedPass]
    source: str


def output_name(target: str) -> str:
    """`gpu-h100-8` -> `gpu_h100_8.py`: an importable module name."""
    return target.replace("-", "_").replace(".", "_") + ".py"


def default_output(spec_path: str | Path, target: str, root: Path = Path("generated")) -> Path:
    return root / Path(spec_path).stem / output_name(target)


def lowered(spec: Model, target: str, after: str = "lowering") -> tuple[Graph, Plan, list[AppliedPass]]:
    """The spec's graph after `after`: `spec` (as built), `passes` (the spec's features) or `lowering` (the
    target's decisions too)."""
    plan = plan_for(spec, target)
    graph = from_spec(spec)
    passes = run_passes(graph, spec.features) if after != "spec" else []
    if after == "lowering":
        lower(graph, plan)
    return graph, plan, passes


def build(spec_path: str | Path, target: str, rule: MeshRule | None = None) -> Built:
    """The program of the spec file for `target`; with a `rule`, as if the spec's mesh rules began with it."""
    spec = load_spec(spec_path)
    if rule is not None:
        # dataclasses.replace, not Model.replace: the program still comes from the spec file, not from here.
        spec = replace(spec, mesh_rules=(rule, *spec.mesh_rules))
    graph, plan, passes = lowered(spec, target)
    source = emit(graph, output_name(target))
    return Built(spec, target, plan, graph, passes, source)
