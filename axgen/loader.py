"""Loads a spec file by path and returns its validated `spec`; every failure becomes one `SpecError` line."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from axgen import spec as spec_module
from axgen.spec import Model, SpecError, display_path, suggest

_AXGEN_DIR = str(Path(__file__).resolve().parent)
# The bundled specs, resolved from the axgen that runs (never another checkout's): `axgen build llama_tiny`.
BUNDLED_SPECS = Path(__file__).resolve().parent / "specs"
_UNEXPECTED = re.compile(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'")
_MISSING = re.compile(r"(\w+)\.__init__\(\) missing \d+ required keyword-only arguments?: (.+)")
_POSITIONAL = re.compile(
    r"(\w+)\.__init__\(\) takes (\d+) positional arguments? but (\d+) (?:were|was) given"
)
# A spec builds a few dataclasses in milliseconds; one still running after this long loops forever.
SPEC_LOAD_SECONDS = 60.0


class _LoadTimeout(BaseException):
    """Raised inside a spec that runs past SPEC_LOAD_SECONDS; not an Exception, so the spec's own
    `except Exception` cannot swallow it."""


def bundled_specs() -> list[Path]:
    return sorted(p for p in BUNDLED_SPECS.glob("*.py") if p.name != "__init__.py")


def spec_path(argument: str | Path) -> Path:
    """A spec file's path; a bundled spec's name (`llama_tiny`); or an importable module's dotted path
    (`axgen.specs.llama_tiny`, `mypackage.specs.model`): as the path of that spec's file."""
    path = Path(argument)
    if path.exists():
        return path
    bundled = BUNDLED_SPECS / f"{argument}.py"
    if re.fullmatch(r"\w+", str(argument)) and bundled.is_file():
        return bundled
    if re.fullmatch(r"\w+(\.\w+)+", str(argument)) and path.suffix != ".py":
        try:
            found = importlib.util.find_spec(str(argument))
        except (ImportError, ValueError):
            found = None
        if found is not None and found.origin and found.origin.endswith(".py"):
            return Path(found.origin)
    return path


def is_bundled(path: Path) -> bool:
    return path.resolve().parent == BUNDLED_SPECS


def load_spec(path: str | Path) -> Model:
    argument, path = str(path), spec_path(path)
    if not path.is_file() and re.fullmatch(r"\w+", argument):
        names = [p.stem for p in bundled_specs()]
        hint = suggest(argument, names) or f"; the bundled specs: {', '.join(names)}"
        raise SpecError(f"{argument}: no such spec file, nor a bundled spec's name{hint}")
    if not path.is_file():
        raise SpecError(f"{path}: no such spec file")
    if path.suffix != ".py":
        raise SpecError(f"{path}: a spec file is Python and ends in .py")
    module = _import(path.resolve())
    spec = getattr(module, "spec", None)
    if not isinstance(spec, Model):
        found = "nothing" if spec is None else type(spec).__name__
        raise SpecError(f"{display_path(str(path))}: must bind `spec` to an axgen.spec.Model, found {found}")
    return spec


_READ = "__axgen_read_mtime__"


def _import(path: Path):
    """Imports the file: a bundled spec as `axgen.specs.<name>`, the module other specs derive from; another in
    a `specs/` folder as `specs.<name>`, so the specs there can derive from each other."""
    if is_bundled(path):
        importlib.import_module("axgen.specs")
        name = f"axgen.specs.{path.stem}"
    else:
        in_specs = path.parent.name == "specs"
        root = path.parent.parent if in_specs else path.parent
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        name = f"specs.{path.stem}" if in_specs else f"axgen_spec_{path.stem}"
    cached = sys.modules.get(name)
    written = path.stat().st_mtime_ns  # a spec rewritten since (axgen plan --write) is read again
    if (
        cached is not None
        and Path(cached.__file__).resolve() == path
        and cached.__dict__.get(_READ) == written
    ):
        return cached
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        with _time_limit(SPEC_LOAD_SECONDS):
            module_spec.loader.exec_module(module)
    except SpecError:
        raise
    except _LoadTimeout as err:
        raise SpecError(
            f"{_user_frame(err)}: the spec did not finish loading within {SPEC_LOAD_SECONDS:g} s"
        ) from None
    except (
        Exception,
        SystemExit,
        KeyboardInterrupt,
    ) as err:  # whatever user code raises: one line, its spec line
        raise SpecError(f"{_user_frame(err)}: {_describe(err)}") from None
    module.__dict__[_READ] = written
    sys.modules[name] = module
    return module


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Interrupts the code run inside after `seconds` with _LoadTimeout, at the line it is executing. Only the
    main thread receives signals; elsewhere the code runs unlimited."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise _LoadTimeout

    previous_handler = signal.signal(signal.SIGALRM, interrupt)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay:  # a caller's own timer (a test runner's, say) goes on with the time it had left
            left = max(previous_delay - (time.monotonic() - start), 1e-6)
            signal.setitimer(signal.ITIMER_REAL, left, previous_interval)


def _user_frame(err: Exception) -> str:
    """file:line of the innermost frame in the user's files (not axgen, not the standard library)."""
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if (f.filename.startswith(str(BUNDLED_SPECS)) or not f.filename.startswith((_AXGEN_DIR, "<")))
        and "/lib/python3" not in f.filename
    ]
    if isinstance(err, SyntaxError) and err.filename:
        return f"{display_path(err.filename)}:{err.lineno}"
    if not frames:
        return "<spec>"
    return f"{display_path(frames[-1].filename)}:{frames[-1].lineno}"


def _describe(err: Exception) -> str:
    message = str(err)
    if isinstance(err, AttributeError) and err.obj is spec_module.features:
        known = [name for name in vars(spec_module.features) if not name.startswith("_")]
        return f"features has no {err.name!r}{suggest(err.name, known) or '; it has ' + ', '.join(known)}"
    positional = _POSITIONAL.search(message)
    if positional and _fields(positional.group(1)):
        cls_name, takes, given = positional.groups()  # both count `self`
        return (
            f"{cls_name} was given too many positional arguments ({int(given) - 1}, it takes "
            f"{int(takes) - 1}); name its fields: {', '.join(_fields(cls_name))}"
        )
    unexpected = _UNEXPECTED.search(message)
    if unexpected:
        cls_name, field_name = unexpected.groups()
        return f"{cls_name} has no field {field_name!r}{suggest(field_name, _fields(cls_name))}"
    missing = _MISSING.search(message)
    if missing:
        cls_name, names = missing.groups()
        hf_keys = getattr(getattr(spec_module, cls_name, None), "HF_KEYS", {})
        sources = [f"{name}: {hf_keys[name]}" for name in re.findall(r"'(\w+)'", names) if name in hf_keys]
        where = f"; Hugging Face configs give {', '.join(sources)}" if sources else ""
        return f"{cls_name} needs {names.replace(' and ', ', ')} (they have no default{where})"
    return f"{type(err).__name__}: {message}"


def _fields(cls_name: str) -> list[str]:
    """The fields a spec class takes; none for a class that is not one."""
    cls = getattr(spec_module, cls_name, None)
    return (
        [f.name for f in dataclasses.fields(cls) if f.name != "origin"]
        if dataclasses.is_dataclass(cls)
        else []
    )
