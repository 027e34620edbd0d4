"""`axgen explain`: what each feature pass and each lowering step did to a spec's graph, and what it costs to read.

The paper's measure of modularity is the lines a feature takes, however many layers and models it touches; this
prints both sides of it from the compiler itself: the nodes a pass made or changed, the layers those nodes run in,
and the logic lines of the pass's file (no docstrings, comments, imports or blank lines), or of the lowering step's
function. Lowering steps are replayed on a copy of the graph to see which nodes each one changes.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

from axgen.backends import lowering
from axgen.build import Built, lowered
from axgen.ir import Graph, Node
from axgen.passes.manager import AppliedPass


@dataclass(frozen=True)
class PassReport:
    name: str
    feature: str
    origin: str
    nodes: int  # in the graph, where a block's node stands for all its layers
    instances: int  # in the model: a block's nodes count once per layer
    layers: int
    main_nodes: int
    logic_lines: int
    file_lines: int
    file: str


def explain(built: Built) -> list[PassReport]:
    total_layers = sum(region.repeat for region in built.graph.blocks())
    return [_report(built, applied, total_layers) for applied in built.passes] + _lowering_reports(built)


def _lowering_reports(built: Built) -> list[PassReport]:
    graph, plan, _ = lowered(built.spec, built.target, after="passes")
    reports = []
    for step in lowering.STEPS:
        before, blocks_before = _attrs_by_node(graph), _attrs_by_block(graph)
        step(graph, plan)
        touched = [n for n in graph.nodes() if before.get(str(n)) != repr(n.attrs)]
        regions = [name for name, attrs in _attrs_by_block(graph).items() if blocks_before[name] != attrs]
        source = inspect.getsource(step)
        name = f"lower.{step.__name__}"
        reports.append(
            _summary(graph, name, plan.backend_file, touched, source, "backends/lowering.py", regions)
        )
    return reports


def _attrs_by_node(graph: Graph) -> dict[str, str]:
    return {str(n): repr(n.attrs) for n in graph.nodes()}


def _attrs_by_block(graph: Graph) -> dict[str, str]:
    return {r.name: repr(r.attrs) for r in graph.blocks()}


def _report(built: Built, applied: AppliedPass, total_layers: int) -> PassReport:
    name = applied.registered.name
    touched = [node for node in built.graph.nodes() if name in node.passes]
    path = Path(inspect.getsourcefile(applied.registered.fn))
    regions = [r.name for r in built.graph.blocks() if name in r.passes]
    summary = _summary(
        built.graph,
        name,
        str(applied.feature.origin),
        touched,
        path.read_text(),
        f"passes/{path.name}",
        regions,
    )
    return dataclasses.replace(summary, feature=applied.feature.summary())


def _summary(
    graph: Graph, name: str, origin: str, touched: list[Node], source: str, file: str, regions=()
) -> PassReport:
    """`regions`: blocks whose own attrs (a remat policy) changed, besides those of the `touched` nodes."""
    regions = {node.region for node in touched if node.region != "main"} | set(regions)
    return PassReport(
        name=name,
        feature="",
        origin=origin,
        nodes=len(touched),
        instances=sum(graph.regions[node.region].repeat for node in touched),
        layers=sum(graph.regions[r].repeat for r in regions),
        main_nodes=sum(node.region == "main" for node in touched),
        logic_lines=logic_lines(textwrap.dedent(source)),
        file_lines=len(source.splitlines()),
        file=file,
    )


def logic_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring or an import."""
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and _is_docstring(body[0]):
            skipped.update(range(body[0].lineno, body[0].end_lineno + 1))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skipped.update(range(node.lineno, node.end_lineno + 1))
    code = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline) if _is_code(tok)}
    return len(code - skipped)


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def _is_code(tok: tokenize.TokenInfo) -> bool:
    skip = (
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    )
    return tok.type not in skip


def render(built: Built, reports: list[PassReport]) -> str:
    total_layers = sum(region.repeat for region in built.graph.blocks())
    lines = [
        f"{built.spec.name} for {built.target}: {total_layers} layers, {len(built.passes)} feature passes, then the "
        "target's lowering steps. Nodes each made or changed; LoC counts code lines, not docstrings, comments or "
        "imports."
    ]
    header = ("pass", "feature", "graph nodes", "model nodes", "layers", "pass LoC", "")
    rows = [header]
    for r in reports:
        where = f"{r.layers} of {total_layers}" + (f" + {r.main_nodes} in main" if r.main_nodes else "")
        loc = f"{r.logic_lines} ({r.file_lines} in {r.file})"
        rows.append((r.name, r.feature, str(r.nodes), str(r.instances), where, loc, r.origin))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines) + "\n"
