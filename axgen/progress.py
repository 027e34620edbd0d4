"""Progress of long commands, drawn by tqdm on stderr: on a terminal only, and not with the CLI's --quiet. What
a command prints when it is done (its summary line) is not progress and shows either way."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from tqdm import tqdm

# The CLI's --quiet turns it off for the whole command.
enabled = True


def bar(
    iterable: Iterable | None = None, *, total: float | None = None, desc: str, unit: str, **options
) -> tqdm:
    """A tqdm bar that draws only where someone watches; it still counts (and iterates) when it does not."""
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=not shown(),
        leave=False,
        dynamic_ncols=True,
        **options,
    )


def shown() -> bool:
    return enabled and sys.stderr.isatty()


def reading(files: list[Path], desc: str = "reading") -> tuple[Iterator[Path], tqdm]:
    """The files, in order, and a bar of their bytes that moves as each is read through (a reader asks for the
    next file once it is done with the last): a rate and an ETA for input of many files."""
    sizes = {path: os.path.getsize(path) for path in files}
    progress = bar(total=sum(sizes.values()), desc=desc, unit="B", unit_scale=True, unit_divisor=1024)

    def paths() -> Iterator[Path]:
        for path in files:
            yield path
            progress.update(sizes[path])

    return paths(), progress


def counted(documents: Iterable, progress: tqdm, every: int = 1000) -> Iterator:
    """The documents (token id arrays, or (ids, mask) pairs), with their rate and their tokens' on the bar."""
    count = tokens = 0
    for document in documents:
        count += 1
        tokens += len(document[0] if isinstance(document, tuple) else document)
        if count % every == 0 and not progress.disable:
            elapsed = max(progress.format_dict["elapsed"], 1e-9)
            progress.set_postfix_str(f"{count / elapsed:,.0f} documents/s, {tokens / elapsed:,.0f} tokens/s")
        yield document
