"""axgen installs from a wheel. Built from the checkout and installed into a fresh virtualenv outside it, it
builds a program (from a bundled spec, and from a user's spec that derives from one), imports a Hugging Face
config and prepares a dataset, and the program it wrote trains: all in a directory that never sees the
checkout.

The fresh virtualenv borrows the dev environment's third-party packages (jax and friends, ~700 MB) through a
`.pth` line naming the dev site-packages. A directory a `.pth` line adds is not a site dir, so its own `.pth`
files, the editable install's finder among them, never run: the test checks that `axgen` is the wheel's copy.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tests.conftest import ROOT, STEP_LINE

import axgen

# The wheel is built from a copy of what a clean clone holds: an in-place setuptools build writes build/lib
# into the checkout, and a file left there (a template since deleted) would go into every later wheel.
LEFT_BEHIND = ".git .venv build dist *.egg-info __pycache__ .pytest_cache .hypothesis .whl generated"
NOT_COPIED = shutil.ignore_patterns(*LEFT_BEHIND.split())
HF_CONFIG = ROOT / "tests" / "fixtures" / "hf_configs" / "published" / "llama-2-7b-hf.json"
DEV_SITE = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))  # ordered, no repeats
DEV_PREFIX = Path(sys.prefix).resolve()
# pip's words when no index or link it is configured with offers setuptools for an isolated build.
NO_INDEX = re.compile(r"No matching distribution found for setuptools|satisfies the requirement setuptools")


def tail(text: str | bytes | None, chars: int = 4000) -> str:
    text = text.decode(errors="replace") if isinstance(text, bytes) else text or ""
    return text[-chars:]


def run(argv: list, *, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Runs a command as a user would; fails the test with its stderr and stdout tails if it exits non-zero or
    runs past `timeout` seconds."""
    argv = [str(a) for a in argv]
    shown = " ".join(argv)
    try:
        result = subprocess.run(
            argv, cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(
            f"timed out after {timeout}s: {shown}\n"
            f"--- stderr\n{tail(err.stderr)}\n--- stdout\n{tail(err.stdout)}"
        )
    if result.returncode != 0:
        pytest.fail(
            f"exit {result.returncode}: {shown}\n(in {cwd})\n"
            f"--- stderr\n{tail(result.stderr)}\n--- stdout\n{tail(result.stdout, 2000)}"
        )
    return result


def user_env() -> dict:
    """A user's shell: no PYTHONPATH, no active virtualenv, none of the tests' XLA flags (a program sets its
    own fake device count), jax on CPU."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "XLA_FLAGS")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    return env | {"JAX_PLATFORMS": "cpu", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1"}


def in_parallel(*steps):
    """Runs independent steps at once and returns their results; the first failure fails the test."""
    with ThreadPoolExecutor(len(steps)) as pool:
        futures = [pool.submit(step) for step in steps]
    return [future.result() for future in futures]


def has_setuptools() -> bool:
    """Whether this interpreter can build the wheel itself (pyproject.toml asks for setuptools >= 69)."""
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 69


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from a copy of the checkout, which `source_of(wheel)` names."""
    tmp = tmp_path_factory.mktemp("wheel")
    source, out = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, source, ignore=NOT_COPIED)
    # Without setuptools here, pip builds in isolation, with setuptools from the indexes it is set up with.
    isolation = ["--no-build-isolation"] if has_setuptools() else []
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", out, source]
    result = subprocess.run(
        [str(a) for a in argv], cwd=tmp, env=user_env(), capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0 and not isolation and NO_INDEX.search(result.stdout + result.stderr):
        pytest.skip(
            "cannot build the wheel: this environment has no setuptools>=69 and pip could not fetch it for "
            f"an isolated build: {tail(result.stderr, 300)}"
        )
    if result.returncode != 0:
        pytest.fail(f"pip wheel failed\n--- stderr\n{tail(result.stderr)}\n--- stdout\n{tail(result.stdout)}")
    (built,) = out.glob("axgen-*.whl")
    return built


def source_of(wheel: Path) -> Path:
    return wheel.parents[1] / "src"


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtualenv outside the checkout holding the wheel. pip installs it before the dev environment's
    packages are linked in, so it never sees the dev install of axgen."""
    path = tmp_path_factory.mktemp("venv") / "env"
    assert not path.is_relative_to(ROOT)
    # Without pip of its own (seeding one costs seconds): this environment's pip installs into it.
    run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent, timeout=120)
    python = path / "bin" / "python"
    run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel],
        cwd=path.parent,
        timeout=120,
    )
    site = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=path.parent,
        timeout=60,
    )
    (Path(site.stdout.strip()) / "axgen_dev_packages.pth").write_text("".join(f"{d}\n" for d in DEV_SITE))
    return path


def test_the_wheel_ships_every_module_template_and_spec_as_in_the_checkout(wheel):
    archive, root = zipfile.ZipFile(wheel), source_of(wheel)  # the copy: the checkout may be edited meanwhile
    names = set(archive.namelist())
    assert wheel.name.startswith(f"axgen-{axgen.__version__}-"), wheel.name
    assert "axgen/templates/program.py.j2" in names
    assert "axgen/runtime/run.py" in names
    assert any(re.fullmatch(r"axgen/templates/ops/[^/]+\.j2", n) for n in names)

    # Every module of the package, every template, every bundled spec, byte for byte; and nothing the source
    # does not hold (a template since deleted, say).
    expected = {
        f"axgen/{p.relative_to(root / 'axgen')}": p
        for p in (root / "axgen").rglob("*")
        if p.suffix in (".py", ".j2")
    }
    shipped = {n for n in names if n.startswith("axgen/")}
    missing = sorted(expected.keys() - shipped)
    assert not missing, f"missing from {wheel.name}: {missing}"
    extra = sorted(shipped - expected.keys())
    assert not extra, f"in {wheel.name}, not in its source: {extra}"
    differ = sorted(name for name, path in expected.items() if archive.read(name) != path.read_bytes())
    assert not differ, f"{wheel.name} holds other bytes than its source: {differ}"

    entry_points = archive.read(f"axgen-{axgen.__version__}.dist-info/entry_points.txt").decode()
    assert re.search(r"^axgen = axgen\.cli:main$", entry_points, re.MULTILINE), entry_points


# Where the fresh virtualenv's python finds axgen, its metadata, its parts and jax, and what it imported. It
# imports only the light parts (a CLI run imports the rest in every step below) and locates the others.
PROBE = """
import importlib.metadata, importlib.util, json, sys
import axgen, axgen.spec, axgen.specs, axgen.templates
found = {name: importlib.util.find_spec(name).origin for name in ("axgen.runtime.run", "axgen.cli", "jax")}
print(json.dumps({
    "axgen": axgen.__file__,
    "specs": axgen.specs.__file__,
    "templates": axgen.templates.__file__,
    "metadata": str(importlib.metadata.distribution("axgen").locate_file("axgen")),
    "version": importlib.metadata.version("axgen"),
    "found": found,
    "modules": {name: getattr(m, "__file__", None) for name, m in list(sys.modules.items())},
    "finders": [repr(f) for f in sys.meta_path],
}))
"""


def installed_axgen(venv: Path, cwd: Path) -> None:
    """Checks that the fresh virtualenv imports the wheel's axgen, not the checkout's, and jax from the dev
    environment."""
    probe = run([venv / "bin" / "python", "-c", PROBE], cwd=cwd, timeout=120)
    seen = json.loads(probe.stdout.splitlines()[-1])
    installed = venv.resolve()
    for where in ("axgen", "specs", "templates", "metadata"):
        assert Path(seen[where]).resolve().is_relative_to(installed), (where, seen[where])
    for name in ("axgen.runtime.run", "axgen.cli"):
        assert Path(seen["found"][name]).resolve().is_relative_to(installed), (name, seen["found"][name])
    assert any(Path(seen["found"]["jax"]).resolve().is_relative_to(Path(d).resolve()) for d in DEV_SITE), seen
    assert seen["version"] == axgen.__version__
    # The dev virtualenv may live inside the checkout (.venv): its third-party packages are meant to be seen.
    from_checkout = sorted(
        name
        for name, file in seen["modules"].items()
        if file and (p := Path(file).resolve()).is_relative_to(ROOT) and not p.is_relative_to(DEV_PREFIX)
    )
    assert not from_checkout, f"imported from the checkout {ROOT}: {from_checkout[:20]}"
    assert not any("editable" in finder.lower() for finder in seen["finders"]), seen["finders"]


# slow tier: a fresh virtualenv with the wheel installed, and programs run in it (20 s each on 2 cores)
@pytest.mark.slow
def test_a_user_of_the_installed_wheel_builds_imports_prepares_data_and_trains(venv, tmp_path):
    assert not tmp_path.is_relative_to(ROOT)
    python = venv / "bin" / "python"

    def user(*argv, timeout=120):
        """`axgen ARGV...`, the fresh virtualenv's console script, run in the user's directory."""
        return run([venv / "bin" / "axgen", *argv], cwd=tmp_path, timeout=timeout)

    def compiler():
        installed_axgen(venv, tmp_path)
        user("build", "llama_tiny", "--target", "cpu-1", "--out", "prog.py")  # a bundled spec, by name
        # A user's own spec, deriving from a bundled one.
        derived = 'from axgen.specs.llama_tiny import spec as base\n\nspec = base.replace(name="mine")\n'
        (tmp_path / "mine.py").write_text(derived)
        user("build", "mine.py", "--target", "cpu-1", "--out", "mine_prog.py")

    def data():  # the demo's path for a user's text; 512 tokens is llama_tiny's vocab_size
        user("corpus", "corpus")
        user("tokenizer", "train", "corpus", "--vocab-size", "512", "--out", "tokenizer.json")
        user("data", "corpus", "--tokenizer", "tokenizer.json", "--eval-fraction", "0.05", "--out", "dataset")

    def train():
        argv = "--data dataset --run-dir run --steps 3 --log-every 1".split() + ["--compilation-cache", ""]
        return run([python, "prog.py", *argv], cwd=tmp_path, timeout=300)

    def import_hf():  # it loads the spec it writes before it keeps it
        shutil.copy(HF_CONFIG, tmp_path / "config.json")
        return user("import-hf", "config.json", "--out", "imported.py", "--steps", "1", "--seq-len", "64")

    # Each step mostly waits on one CPU for its imports: two chains at a time.
    in_parallel(compiler, data)
    trained, imported = in_parallel(train, import_hf)

    program = (tmp_path / "prog.py").read_text()
    assert re.search(r"^from axgen\.runtime import ", program, re.MULTILINE)
    assert str(ROOT) not in program and str(venv) not in program
    assert "# Regenerate: axgen build llama_tiny --target cpu-1" in program
    assert '"model": "mine"' in (tmp_path / "mine_prog.py").read_text()
    assert "6,738,415,616 parameters" in imported.stdout + imported.stderr
    assert "from axgen.spec import" in (tmp_path / "imported.py").read_text()
    losses = {int(step): float(loss) for step, loss in STEP_LINE.findall(trained.stdout)}
    log = f"--- stdout\n{tail(trained.stdout)}\n--- stderr\n{tail(trained.stderr)}"
    assert sorted(losses) == [1, 2, 3], log
    assert all(0 < loss < 100 for loss in losses.values()), losses


# slow tier: a fresh virtualenv with the wheel installed, and programs run in it (20 s each on 2 cores)
@pytest.mark.slow
def test_a_changed_runtime_changes_no_generated_program(venv, tmp_path):
    """The committed programs stay current when the runtime changes: with the installed copy's runtime edited (a
    function's body and a new name), `axgen build --all --check` passes on the checkout's specs. So a change to
    the run machinery is reviewed once, as a change to axgen.runtime, never as a diff of every program."""
    python = venv / "bin" / "python"
    where = run([python, "-c", "import axgen.runtime.run as r; print(r.__file__)"], cwd=venv, timeout=60)
    runtime = Path(where.stdout.strip())
    assert runtime.resolve().is_relative_to(venv.resolve())
    source = runtime.read_text()
    changed = source.replace(
        "return loss_sum / max(targets, 1), targets", "return loss_sum / targets, targets"
    )
    assert changed != source
    # The checkout's programs, outside it: run there, `python -c` would import the checkout's axgen. The specs are
    # the installed copy's (axgen.specs), the checkout's as the wheel was built.
    shutil.copytree(ROOT / "generated", tmp_path / "generated", ignore=NOT_COPIED)
    try:
        runtime.write_text(changed + "\nEDITED_BY_TEST = True\n")
        check = "import axgen.runtime.run as r, axgen.cli as c, sys; r.EDITED_BY_TEST; sys.exit(c.main(sys.argv[1:]))"
        checked = run([python, "-c", check, "build", "--all", "--check"], cwd=tmp_path, timeout=600)
    finally:
        runtime.write_text(source)
    programs = len(list((ROOT / "generated").glob("*/*.py")))
    assert f"generated/ matches the compiler ({programs} programs)" in checked.stdout, checked.stdout
