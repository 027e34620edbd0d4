"""axgen.runtime is a library the programs call: it stands apart from the compiler, and refuses a program it
cannot run. (That a changed runtime changes no program is tests/test_wheel.py's, on an installed copy.)"""

from tests.conftest import ROOT, python_result

TINY_CPU_1 = ROOT / "generated/llama_tiny/cpu_1.py"
COMPILER_MODULES = (
    "axgen.codegen",
    "axgen.ir",
    "axgen.passes",
    "axgen.backends",
    "axgen.spec",
    "jinja2",
    "libcst",
)


def test_the_runtime_imports_nothing_of_the_compiler():
    """A training host needs jax, optax, orbax, numpy and tensorboardX, not the compiler's dependencies."""
    probe = (
        "import sys, axgen.runtime, axgen.runtime.run;"
        f"print(sorted(m for m in sys.modules if m.startswith({COMPILER_MODULES!r})))"
    )
    result = python_result("-c", probe)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_a_program_of_another_axgen_is_refused_in_one_line(tmp_path):
    program = tmp_path / "old.py"
    source = TINY_CPU_1.read_text()
    assert source.count('AXGEN_VERSION = "') == 1
    program.write_text(source.replace('AXGEN_VERSION = "', 'AXGEN_VERSION = "0.1.0"  # was "', 1))
    result = python_result(program, "--data", tmp_path, "--run-dir", tmp_path / "run")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "was built by axgen 0.1.0" in result.stderr and "rebuild it with `axgen build`" in result.stderr
    assert not (tmp_path / "run").exists()
