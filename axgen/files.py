"""Output files and folders: checked before a command does its work, and written whole or not at all.

A file (or a folder: a dataset, a checkpoint, an HF model) is written into a hidden temporary sibling,
`.NAME.axgen-tmp-PID-XXXXXXXX`, and renamed over NAME once complete, so NAME never holds half of one. A writer
killed before the rename (kill -9, a lost machine) leaves its temporary behind; the next write into that folder
removes every such temporary whose writer no longer runs.

Ctrl-C or SIGTERM stops a command before it renames anything (`stop_on_signal`, `check_not_stopped`).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import typing
from pathlib import Path

TEMP_MARK = ".axgen-tmp-"
# Only names this module makes: a leading dot, the mark, the writer's pid and 8 hex digits.
_TEMP_NAME = re.compile(r"\..+" + re.escape(TEMP_MARK) + r"(\d+)-[0-9a-f]{8}")


# The signals a command has received. Its handler raises KeyboardInterrupt, but Python prints and drops one raised
# while a garbage-collection callback runs (jax registers one), and the command would go on to publish its output
# and exit 0; so each is also recorded here, and raised again before every rename that publishes an output.
_received_signals: list[int] = []


def stop_on_signal(number: int, frame) -> typing.NoReturn:
    """The handler of Ctrl-C and SIGTERM while a command runs."""
    _received_signals.append(number)
    raise KeyboardInterrupt


def check_not_stopped() -> None:
    """Raises KeyboardInterrupt again when a signal arrived whose own KeyboardInterrupt may have been dropped."""
    if _received_signals:
        raise KeyboardInterrupt


def forget_signals() -> None:
    """Forgets the stops received: a command starts and ends with none, so a process that goes on (a test, a
    notebook) writes its later outputs."""
    _received_signals.clear()


class OutputError(ValueError):
    """One line naming an output path that cannot be written, and why."""


def check_output_file(path: Path, *, force: bool, header: re.Pattern[str] | None = None) -> None:
    """Refuses a file output that could not be written (a folder already at `path`, or a parent that is a file
    or not writable) or that would replace a file without `force`. A file whose first line matches `header` is
    one axgen wrote for the same thing (a program of the same spec file), which the command regenerates: it is
    replaced without `force`."""
    if path.is_dir():
        raise OutputError(f"{path}: is a directory; a file is expected here")
    _check_parent(path)
    if header is None or not _begins_with(path, header):
        check_replaceable(path, force)


def check_output_dir(path: Path, *, force: bool) -> None:
    """Refuses a folder output that could not be written (a file already at `path`, or a parent that is a file
    or not writable) or that is already there without `force`."""
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path}: is not a directory; a directory is expected here")
    _check_parent(path)
    check_replaceable(path, force)


def _begins_with(path: Path, header: re.Pattern[str]) -> bool:
    if not path.is_file():  # a FIFO or a device would block the read, and is no file axgen wrote
        return False
    try:
        with path.open("rb") as f:
            first_line = f.readline(4096)
    except OSError:
        return False
    return header.fullmatch(first_line.decode("utf-8", "replace").rstrip("\r\n")) is not None


def _check_parent(path: Path) -> None:
    """The nearest existing ancestor is where the missing folders, then the output, will be created."""
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{path}: cannot write: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: cannot write: {ancestor} is not writable")


def check_replaceable(out: Path, overwrite: bool, marker: str | None = None) -> None:
    """An existing output is replaced only when asked; a folder (an output with a `marker`) only when it holds
    `marker` (or nothing): a mistyped --out never deletes somebody's other files."""
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise OutputError(f"{out}: already exists (pass --force to replace it)")
    if marker is not None and (not out.is_dir() or (any(out.iterdir()) and not (out / marker).exists())):
        raise OutputError(f"{out}: exists and has no {marker}, so --force will not replace it")


def write_atomically(path: Path, content: str | bytes) -> None:
    """Writes `content` (text as UTF-8) to `path` through a temporary sibling; an OSError becomes an
    OutputError and leaves `path` as it was."""
    data = content.encode() if isinstance(content, str) else content
    try:
        tmp = _temporary_sibling(path)
        # 0o644 whatever the umask: a program, spec or report is as readable as any source file.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as err:
        raise OutputError(f"{path}: cannot write ({err.strerror})") from None
    try:
        with open(fd, "wb") as f:
            os.fchmod(fd, 0o644)
            f.write(data)
        check_not_stopped()
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{path}: cannot write ({err.strerror})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def staging_dir(path: Path) -> Path:
    """A new, empty temporary sibling folder of `path` (0o755) to fill and then rename to `path` (after
    `check_not_stopped()`); the caller removes it if the work fails."""
    tmp = _temporary_sibling(path)
    try:
        tmp.mkdir(mode=0o755)
    except OSError as err:
        raise OutputError(f"{path}: cannot write ({err.strerror})") from None
    tmp.chmod(0o755)  # whatever the umask: an output folder is as readable as any other output
    return tmp


def publish_dir(staging: Path, out: Path) -> None:
    """Renames a filled `staging_dir` to `out` unless a signal asked the command to stop, replacing a folder at
    `out` (which the command's checks let it replace)."""
    check_not_stopped()
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


def _temporary_sibling(path: Path) -> Path:
    # The checks before the work cannot tell every folder that will not be made (root may write anywhere, but
    # not under /proc): this one line is the answer there.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"{path}: cannot create {err.filename} ({err.strerror})") from None
    remove_stale_temporaries(path.parent)
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def remove_stale_temporaries(directory: Path) -> None:
    """Removes the temporaries that killed writers left in `directory`; a running writer's is left alone."""
    for candidate in directory.iterdir():
        match = _TEMP_NAME.fullmatch(candidate.name)
        if match and not _running(int(match.group(1))):
            if candidate.is_dir() and not candidate.is_symlink():
                shutil.rmtree(candidate, ignore_errors=True)
            else:
                candidate.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
