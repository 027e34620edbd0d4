"""Shared fixtures. Every test sees 8 fake CPU devices (set before jax starts)."""

import os

# Emitted programs run as a user runs them: they set their own fake device count, which the user's XLA_FLAGS
# would override.
PROGRAM_ENV = dict(os.environ, JAX_PLATFORMS="cpu")
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import ast  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from axgen.corpus import module_sources  # noqa: E402
from axgen.data import write_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^step (\d+) \| loss ([0-9.]+)", re.MULTILINE)


def byte_documents() -> list[np.ndarray]:
    """The demo corpus's documents as byte tokens: a vocabulary of 256 with NUL, which source never holds, as EOS."""
    return [np.frombuffer(text.encode(), np.uint8) for text in module_sources().values()]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A dataset directory of the demo corpus in byte tokens, with an eval split."""
    path = tmp_path_factory.mktemp("data") / "bytes"
    write_dataset(path, byte_documents(), vocab_size=256, bos_id=None, eos_id=0, eval_fraction=0.05)
    return path


def train(program: Path, data: Path, run_dir: Path, steps: int, *extra: str) -> dict[int, float]:
    """Runs an emitted program as a user would; returns {step: loss} from its log."""
    return {
        int(step): float(loss)
        for step, loss in STEP_LINE.findall(train_log(program, data, run_dir, steps, *extra))
    }


def train_log(program: Path, data: Path, run_dir: Path, steps: int, *extra: str) -> str:
    """Runs an emitted program as a user would, logging every step; returns what it printed."""
    return run_python(str(program), *program_args(data, run_dir, steps), *extra)


def program_args(data: Path, run_dir: Path, steps: int) -> list[str]:
    return ["--data", str(data), "--run-dir", str(run_dir), "--steps", str(steps), "--log-every", "1"]


def run_python(*argv: str) -> str:
    """Runs `python *argv` from the project root; returns its stdout, failing the test on a non-zero exit."""
    result = python_result(*argv)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def python_result(*argv: str) -> subprocess.CompletedProcess:
    """Runs `python *argv` from the project root, as a user would; returns its exit code and output."""
    return subprocess.run(
        [sys.executable, *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=PROGRAM_ENV,
    )


def moe_calls(source: str) -> list[dict[str, str]]:
    """The keywords of each runtime.moe_dropless / runtime.moe_with_capacity call in a program's source, as
    source text: what the program passes the library for each moe node."""
    return [
        {k.arg: ast.unparse(k.value) for k in call.keywords}
        for call in ast.walk(ast.parse(source))
        if isinstance(call, ast.Call)
        and ast.unparse(call.func) in ("runtime.moe_dropless", "runtime.moe_with_capacity")
    ]


def moe_options(program) -> dict:
    """The options of a loaded program's first MoE call, evaluated in the program's namespace (its Routing, kernel
    switch, tiles, rules), less those that name its params (`p[...]`: the correction bias, the biases)."""
    first, *_ = moe_calls(Path(program.__file__).read_text())
    return {k: eval(v, vars(program)) for k, v in first.items() if "p[" not in v}
