"""The demo corpus: byte tokens of a fixed list of standard-library modules' source, present in every Python."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

MODULES = (
    "argparse.py",
    "dataclasses.py",
    "difflib.py",
    "fractions.py",
    "heapq.py",
    "textwrap.py",
    "statistics.py",
    "string.py",
    "shlex.py",
    "calendar.py",
)


def corpus_bytes() -> bytes:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return b"\n\n".join((stdlib / name).read_bytes() for name in MODULES)


def write_token_file(path: Path) -> int:
    """Writes the corpus as flat uint16 byte tokens (vocabulary 256); returns the token count."""
    tokens = np.frombuffer(corpus_bytes(), dtype=np.uint8).astype(np.uint16)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens.tofile(path)
    return len(tokens)
