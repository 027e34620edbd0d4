"""The demo corpus: the source of a fixed list of standard-library modules, present in every Python >= 3.12,
as one text document per module (about 2 MB), for `axgen tokenizer train` and `axgen data`."""

from __future__ import annotations

import sysconfig
from pathlib import Path

# Pure-Python single-file modules of every CPython from 3.12 on (none deprecated for removal); sixty, so a 5%
# eval split holds a few documents.
MODULES = (
    "argparse",
    "ast",
    "base64",
    "calendar",
    "cmd",
    "code",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "difflib",
    "dis",
    "enum",
    "filecmp",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "imaplib",
    "inspect",
    "ipaddress",
    "locale",
    "mimetypes",
    "numbers",
    "operator",
    "optparse",
    "pprint",
    "queue",
    "random",
    "selectors",
    "shlex",
    "shutil",
    "smtplib",
    "socketserver",
    "statistics",
    "string",
    "subprocess",
    "tabnanny",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "types",
    "typing",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "zipapp",
)


def module_sources() -> dict[str, str]:
    """{module name: its source}, in the order of MODULES."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return {name: (stdlib / f"{name}.py").read_text(encoding="utf-8") for name in MODULES}


def write_corpus(directory: Path) -> list[Path]:
    """Writes `<module>.txt` per module into `directory`; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, source in module_sources().items():
        path = directory / f"{name}.txt"
        path.write_text(source, encoding="utf-8")
        written.append(path)
    return written
