"""Shared fixtures. Every test sees 8 fake CPU devices (set before jax starts)."""

import os

FAKE_DEVICES = "--xla_force_host_platform_device_count="
# The suite's programs are tiny, so compiling them costs far more than running them: XLA's LLVM backend at its
# lowest optimization level compiles the CPU steps in about 2/3 of the time. The optimized HLO (partitioning,
# fusion, buffers) is the same; results differ in the last bits (moe_tiny's loss and gradients on 8 devices: at
# most 7e-9 of the largest), well inside every tolerance here.
FAST_COMPILE = "--xla_backend_optimization_level=0"
# Emitted programs run as a user runs them: they set their own fake device count, which a count in XLA_FLAGS
# would override. (pytest-xdist's workers inherit the count this file sets in the process that starts them.)
PROGRAM_ENV = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=" ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(FAKE_DEVICES)]
        + [FAST_COMPILE]
    ),
)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"{PROGRAM_ENV['XLA_FLAGS']} {FAKE_DEVICES}8".strip()

import ast  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import fcntl  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from axgen.data.corpus import module_sources  # noqa: E402
from axgen.data.datasets import write_dataset  # noqa: E402
from axgen.interop import load_program  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^step (\d+) \| loss ([0-9.]+)", re.MULTILINE)
CPU_8 = ROOT / "generated/llama_tiny/cpu_8.py"
# The shared run evaluates twice, at steps 10 and 20.
EVAL = ("--eval-every", "10", "--eval-batches", "2")


def byte_documents() -> list[np.ndarray]:
    """The demo corpus's documents as byte tokens: a vocabulary of 256 with NUL, which source never holds, as EOS."""
    return [np.frombuffer(text.encode(), np.uint8) for text in module_sources().values()]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A dataset directory of the demo corpus in byte tokens, with an eval split."""
    path = tmp_path_factory.mktemp("data") / "bytes"
    write_dataset(path, byte_documents(), vocab_size=256, bos_id=None, eos_id=0, eval_fraction=0.05)
    return path


def losses_in(log: str) -> dict[int, float]:
    """{step: loss} of the step lines a run printed."""
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(log)}


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


def assert_gradients_close(grads, expected, relative: float, what: str) -> None:
    """Each gradient equals the expected one within `relative` of the expected one's largest magnitude."""
    import jax

    for (path, grad), want in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(
            grad, want, atol=relative * np.abs(want).max(), err_msg=f"{what} {jax.tree_util.keystr(path)}"
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


_LOADED: dict[Path, object] = {}


def run_in_process(program: Path, *argv) -> subprocess.CompletedProcess:
    """Runs an emitted program's `main(argv)` in this process, on its 8 fake CPU devices, and returns what
    `python PROGRAM *argv` would: the exit code, what it printed, and on stderr a SystemExit's message or an
    exception's traceback. The program is imported once, so a second run of it at the same batch reuses the
    compiled steps of the first: resume, fault and refusal cases cost their steps, not a process and a compile
    each. Where the point is a signal, a kill, a lock across processes or a second process, tests start one.
    """
    program = Path(program).resolve()
    module = _LOADED.get(program) or _LOADED.setdefault(program, load_program(program))
    sys.modules[module.__name__] = module  # main() finds its module there; a later load_program replaces it
    out, err = io.StringIO(), io.StringIO()
    environment = dict(os.environ)  # the program adds its target's flags there, for its own process
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = module.main([str(arg) for arg in argv])
        except SystemExit as exit:  # as the interpreter reports one: a message goes to stderr with exit 1
            code = exit.code
            if isinstance(code, str):
                print(code, file=sys.stderr)
                code = 1
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            os.environ.clear()
            os.environ.update(environment)
    return subprocess.CompletedProcess(
        [str(program), *map(str, argv)], code or 0, out.getvalue(), err.getvalue()
    )


def train_in_process(program: Path, data: Path, run_dir: Path, steps: int, *extra: str) -> str:
    """run_in_process with the usual flags, logging every step; returns what it printed, failing the test on a
    non-zero exit."""
    result = run_in_process(program, *program_args(data, run_dir, steps), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@dataclasses.dataclass(frozen=True)
class SharedRun:
    """The suite's one short training run of the tiny cpu-8 program, and the same run stopped and resumed, in
    folders of `root`.

    `uninterrupted`: 20 steps in a process of its own, as a user runs it, evaluated at steps 10 and 20, with a
    compilation cache folder (which a CPU mesh of several devices must leave unmade); its run dir holds the
    metrics, TensorBoard events and the step-20 checkpoint. `resumed`: the same run stopped after steps 2 and 4
    and resumed to 20 (in this process); `two_checkpoints`: a copy of it as it was at step 4, with checkpoints
    at steps 2 and 4, for tests that damage one. `logs` are what each leg printed, in order."""

    root: Path

    uninterrupted = property(lambda self: self.root / "uninterrupted")
    resumed = property(lambda self: self.root / "resumed")
    two_checkpoints = property(lambda self: self.root / "two_checkpoints")
    cache = property(lambda self: self.root / "cache")

    @property
    def uninterrupted_log(self) -> str:
        return (self.root / "uninterrupted.log").read_text()

    @property
    def logs(self) -> tuple[str, ...]:
        return tuple((self.root / f"resumed_{steps}.log").read_text() for steps in RESUMED_AT)

    @property
    def losses(self) -> dict[int, float]:
        """{step: loss} of the uninterrupted run's metrics.jsonl, as the program wrote them."""
        records = map(json.loads, (self.uninterrupted / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss"] for r in records if "loss" in r}


RESUMED_AT = (2, 4, 20)  # the steps each leg of the resumed run stops at


@pytest.fixture(scope="session")
def shared_run(corpus, tmp_path_factory) -> SharedRun:
    # Under pytest-xdist each worker is a session, in a folder of the whole run's: the first worker to get here
    # makes the run, the others read it.
    base = tmp_path_factory.getbasetemp()
    run = SharedRun((base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "shared_run")
    with open(run.root.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (run.root / "done").exists():
            make_shared_run(run, corpus)
            (run.root / "done").touch()
    return run


def make_shared_run(run: SharedRun, corpus: Path) -> None:
    log = run_python(
        str(CPU_8), *program_args(corpus, run.uninterrupted, 20), *EVAL, "--compilation-cache", str(run.cache)
    )
    (run.root / "uninterrupted.log").write_text(log)
    for steps in RESUMED_AT:
        log = train_in_process(CPU_8, corpus, run.resumed, steps, *EVAL)
        (run.root / f"resumed_{steps}.log").write_text(log)
        if steps == 4:
            shutil.copytree(run.resumed, run.two_checkpoints)
