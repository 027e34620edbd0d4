"""IR dumps before/after passes, emitted programs, determinism, and what a spec without a feature leaves out."""

import ast
import importlib
import os

import black
import pytest

from axgen.build import build, default_output, lowered
from axgen.cli import main as axgen
from axgen.ir import GraphError, Op, from_spec
from axgen.loader import load_spec
from axgen.passes import PassError, run_passes
from axgen.passes.manager import RegisteredPass, order
from tests.conftest import ROOT

TINY = ROOT / "axgen/specs/llama_tiny.py"
# The module, not the function `axgen.codegen` exports under its name.
EMIT_MODULE = importlib.import_module("axgen.codegen.emit")


def test_dump_before_and_after_rope(snapshot):
    spec = load_spec(TINY)
    graph = from_spec(spec)
    before = graph.dump()
    run_passes(graph, spec.features)
    assert before == snapshot(name="before")
    assert graph.dump() == snapshot(name="after_rope")
    assert len(list(graph.nodes(op="rope"))) == 2


@pytest.mark.parametrize(("name", "target"), [("llama_tiny", "tpu-v5e-8"), ("features_tiny", "gpu-h100-8")])
def test_dump_after_lowering_shows_every_target_decision(name, target, snapshot):
    graph, _, _ = lowered(load_spec(ROOT / f"axgen/specs/{name}.py"), target)
    assert graph.dump() == snapshot


def test_graph_command_prints_each_stage(capsys):
    for after, present, absent in [
        ("spec", "attention(q=q, k=k, v=v, segment_ids=segment_ids)", "rope("),
        ("passes", "rope(x=q, positions=positions)", "kernel="),
        ("lowering", "kernel=splash block=128", "kernel=None"),
    ]:
        assert axgen(["graph", "llama_tiny", "--target", "tpu-v5e-8", "--after", after]) == 0
        out = capsys.readouterr().out
        assert present in out and absent not in out, (after, out)


def test_emitted_cpu_program(snapshot):
    assert build(TINY, "cpu-1").source == snapshot


def test_build_is_deterministic():
    assert build(TINY, "gpu-h100-8").source == build(TINY, "gpu-h100-8").source


def test_generated_tree_is_current():
    """`axgen build --all --check` in test form: the committed file equals what the compiler emits now."""
    assert default_output(TINY, "cpu-8", ROOT / "generated").read_text() == build(TINY, "cpu-8").source


def test_black_formats_a_source_once_and_the_same_source_is_read_back(monkeypatch, tmp_path):
    """The format cache: a source black has not seen is formatted and kept; built again (here or in another
    process) it is read back; another source is formatted anew, and the oldest entries go past the cache's size;
    a cache that cannot be written, or none, costs nothing else."""
    formats = []
    black_format = black.format_str
    monkeypatch.setattr(EMIT_MODULE, "FORMAT_CACHE", tmp_path / "cache")
    monkeypatch.setattr(EMIT_MODULE, "FORMAT_CACHE_ENTRIES", 2)
    monkeypatch.setattr(
        "black.format_str", lambda source, mode: formats.append(source) or black_format(source, mode=mode)
    )
    program = build(TINY, "cpu-1").source
    assert len(formats) == 1 and [p.read_text() for p in (tmp_path / "cache").iterdir()] == [program]
    assert build(TINY, "cpu-1").source == program and len(formats) == 1
    assert build(TINY, "cpu-8").source != program and len(formats) == 2
    for kept in (tmp_path / "cache").iterdir():  # cpu-8's the older, whatever the clock's resolution
        os.utime(kept, (0, 1 if kept.read_text() == program else 0))
    newest = build(TINY, "tpu-v5e-8").source
    assert sorted(p.read_text() for p in (tmp_path / "cache").iterdir()) == sorted([program, newest])
    (tmp_path / "a-file").touch()
    monkeypatch.setattr(EMIT_MODULE, "FORMAT_CACHE", tmp_path / "a-file" / "cache")
    assert build(TINY, "cpu-1").source == program and len(formats) == 4
    monkeypatch.setattr(EMIT_MODULE, "FORMAT_CACHE", None)  # no home directory
    assert build(TINY, "cpu-1").source == program and len(formats) == 5


def test_a_template_that_renders_invalid_python_is_a_compiler_error_naming_it(monkeypatch, tmp_path):
    """black's grammar is more lenient than Python's (it formats a `return` outside any function); the compile
    after it is what turns such a template bug into an error naming the template, not a broken program."""
    from axgen.codegen.emit import EmitError

    monkeypatch.setattr(EMIT_MODULE, "FORMAT_CACHE", tmp_path)
    monkeypatch.setattr("black.format_str", lambda source, mode: "step = 1\nreturn step\n")
    with pytest.raises(EmitError, match="templates/program.py.j2 rendered invalid Python for cpu-1"):
        build(TINY, "cpu-1")


def test_without_rope_feature_there_is_no_rope_anywhere():
    spec = load_spec(TINY).replace(features=[])
    graph = from_spec(spec)
    run_passes(graph, spec.features)
    assert not list(graph.nodes(op="rope"))


def test_emitted_files_import_only_the_allowed_libraries():
    """A program is its model and steps: jax, optax and numpy, a few stdlib modules for its kernels' switches, and
    axgen's runtime for what every program shares (never the compiler)."""
    allowed = {"functools", "math", "os", "sys", "jax", "numpy", "optax", "axgen.runtime"}
    for path in sorted((ROOT / "generated").glob("*/*.py")):
        imported = set()
        for stmt in ast.parse(path.read_text()).body:
            if isinstance(stmt, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in stmt.names}
            if isinstance(stmt, ast.ImportFrom):
                imported.add(stmt.module if stmt.module.startswith("axgen") else stmt.module.split(".")[0])
        imported = {"axgen.runtime" if name == "axgen" else name for name in imported}
        assert imported <= allowed, (path, imported - allowed)


def test_every_name_a_program_imports_or_defines_is_used_in_it():
    """A helper, switch or import that nothing reads means a template printed a path the program never takes (a
    kernel defined but not called). `forward` is the exception: the programs' API for those who import them; so
    are the names axgen's runtime reads from a program it runs.
    """
    from axgen.runtime.program import Program

    runtime_reads = set(Program.module_names().values())
    for path in sorted((ROOT / "generated").glob("*/*.py")):
        tree = ast.parse(path.read_text())
        defined = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined |= {target.id for target in node.targets if isinstance(target, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        read = {
            node.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
        }
        unread = defined - read - runtime_reads
        assert unread == {"forward"}, (path, sorted(unread - {"forward"}))


def test_unknown_feature_is_a_clear_error(tmp_path):
    from dataclasses import dataclass
    from typing import ClassVar

    from axgen.spec import Feature, SpecError

    @dataclass(frozen=True, kw_only=True)
    class Sparsify(Feature):
        pass_name: ClassVar[str] = "sparsify"

    spec = load_spec(TINY).replace(features=[Sparsify()])
    with pytest.raises(SpecError, match=r"feature 'sparsify' has no pass in axgen/passes/"):
        run_passes(from_spec(spec), spec.features)


def test_pass_ordering_follows_constraints_and_rejects_cycles():
    def noop(g, cfg):
        return None

    registry = {
        "a": RegisteredPass("a", noop, before=(), after=("b",)),
        "b": RegisteredPass("b", noop, before=(), after=()),
        "c": RegisteredPass("c", noop, before=("b",), after=()),
    }
    assert order(["a", "b", "c"], registry) == ["c", "b", "a"]
    registry["b"] = RegisteredPass("b", noop, before=("c",), after=())
    with pytest.raises(PassError, match="cycle"):
        order(["a", "b", "c"], registry)


def test_shape_rules_reject_an_ill_typed_rewrite():
    spec = load_spec(TINY)
    graph = from_spec(spec)
    attn = next(graph.nodes(op="attention"))
    with pytest.raises(
        GraphError, match=r"rope needs positions \[batch, seq\], got \[batch, seq, embed=128\]"
    ):
        graph.insert_on_input(attn, "q", Op("rope", theta=1.0), positions=graph.node("layers", "attn_norm"))


def test_one_vocabulary_of_axes_and_kernels():
    from axgen.backends import FAMILIES
    from axgen.backends.common import LOGICAL_AXIS_RULES
    from axgen.ir import TensorType
    from axgen.ir.types import LOGICAL_AXES
    from axgen.runtime.kernels import ATTENTION_FALLBACKS, ATTENTION_KERNELS, GROUPED_MATMUL_KERNELS
    from axgen.spec import ATTENTION_KERNELS as NAMED_BY_RULES

    assert [axis for axis, _ in LOGICAL_AXIS_RULES] == list(LOGICAL_AXES)
    # The runtime's table holds every kernel a mesh rule may name and the lowering's XLA paths, which no spec names;
    # each chip's kernels are in it, and a chip-only kernel's test switch has an XLA path that takes all it takes.
    assert set(ATTENTION_KERNELS) == set(NAMED_BY_RULES) | set(ATTENTION_FALLBACKS)
    assert {k for family in FAMILIES for k in family.kernels} <= set(NAMED_BY_RULES)
    for kernel in ATTENTION_KERNELS.values():
        if kernel.chip_only:
            assert any(kernel.options <= ATTENTION_KERNELS[name].options for name in ATTENTION_FALLBACKS)
    chips = [family.grouped_matmul.kernel for family in FAMILIES if family.grouped_matmul]
    assert set(chips) <= set(GROUPED_MATMUL_KERNELS)
    assert all(GROUPED_MATMUL_KERNELS[k].stand_in in GROUPED_MATMUL_KERNELS for k in chips)
    with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
        TensorType.of("batch", ("hidden", 4))
