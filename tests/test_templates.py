"""The printer only prints: a template branches on a node's op and attrs, or on a program-level value that
lowering computed (the graph's attrs, `program` in a template), and on nothing else."""

import inspect
from pathlib import Path

import jinja2
from jinja2 import nodes

from axgen.codegen.emit import emit
from tests.conftest import ROOT

TEMPLATES = sorted((ROOT / "templates").rglob("*.j2"))
# What emit's context offers a branch: the lowered graph's attrs, and what it derived from the graph's nodes and
# regions. (The version and the file's name are printed, never branched on.)
GRAPH_DERIVED = {
    "program",
    "blocks",
    "groups",
    "regroup",
    "main_aux",
    "logged_metrics",
    "op_imports",
    "fused_loss",  # the output head's lowered `loss` attrs
}


def test_the_printer_takes_only_the_lowered_graph():
    assert list(inspect.signature(emit).parameters) == ["graph", "output_name"]


def test_templates_branch_only_on_nodes_and_lowered_values():
    problems = []
    for path in TEMPLATES:
        problems += _branch_problems(path)
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_branch_on_the_plan_and_on_the_first_node(tmp_path):
    """The check itself: a branch on something outside the graph, or on one node's attr for all of them."""
    bad = tmp_path / "bad.j2"
    bad.write_text(
        "{% macro helpers(nodes, program) %}{% if plan.num_slices > 1 %}x{% endif %}"
        "{% set kernel = nodes[0].attrs.kernel %}{% if kernel == 'splash' %}y{% endif %}{% endmacro %}"
    )
    problems = _branch_problems(bad)
    assert any("reads ['plan']" in p for p in problems) and any("nodes[0]" in p for p in problems)


def _branch_problems(path: Path) -> list[str]:
    tree = jinja2.Environment().parse(path.read_text())
    allowed = set(GRAPH_DERIVED)
    for macro in tree.find_all(nodes.Macro):
        allowed |= {arg.name for arg in macro.args}
    for loop in tree.find_all(nodes.For):
        allowed |= set(_names(loop.target)) | {"loop"}
    if isinstance(getattr(tree, "target", None), nodes.Name):
        allowed.add(tree.target.name)
    for imported in tree.find_all(nodes.Import):
        allowed.add(imported.target)
    decided = [(assign.node, f"set {_names(assign.target)}") for assign in tree.find_all(nodes.Assign)]
    for assign in tree.find_all(nodes.Assign):
        allowed |= set(_names(assign.target))
    decided += [(branch.test, "if") for branch in tree.find_all(nodes.If)]
    decided += [(branch.test, "if-expression") for branch in tree.find_all(nodes.CondExpr)]
    decided += [(loop.test, "loop filter") for loop in tree.find_all(nodes.For) if loop.test is not None]
    problems = []
    for expression, kind in decided:
        where = f"{path.relative_to(path.parents[1]) if 'templates' in path.parts else path.name}:{expression.lineno}"
        outside = sorted({n.name for n in expression.find_all(nodes.Name)} - allowed)
        if outside:
            problems.append(f"{where}: {kind} reads {outside}, which no node or lowering step set")
        for item in expression.find_all(nodes.Getitem):
            if isinstance(item.arg, nodes.Const) and isinstance(item.arg.value, int):
                problems.append(
                    f"{where}: {kind} reads one item of a list by its place ([0]): one node's attrs would decide for all (nodes[0])"
                )
    return problems


def _names(target) -> list[str]:
    return (
        [n.name for n in target.find_all(nodes.Name)] if not isinstance(target, nodes.Name) else [target.name]
    )
