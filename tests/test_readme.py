"""The README as a new user reads it: every `sh` block runs as written, in a fresh directory, with the virtualenv
activated as the README says (its `bin/` first on PATH)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PROGRAM_ENV, ROOT

BLOCKS = re.findall(r"^```sh\n(.*?)^```$", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)


def test_the_readme_says_to_activate_the_virtualenv_before_its_commands():
    readme = (ROOT / "README.md").read_text()
    assert readme.index("source .venv/bin/activate") < readme.index("```sh"), "activation is said first"
    assert readme.count("source .venv/bin/activate") == 1, "and once"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_a_readme_shell_block_runs_as_written_in_a_fresh_directory(block, tmp_path):
    env = dict(PROGRAM_ENV, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    ran = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, f"{block}\n--- stdout\n{ran.stdout[-3000:]}\n--- stderr\n{ran.stderr[-3000:]}"
    for out in re.findall(r"--(?:out|run-dir) (\S+)", block):
        assert (tmp_path / out).exists(), f"{out} was not made"
    outs = re.findall(r"--(?:out|run-dir) (\S+)", block)
    assert len(outs) == len(set(outs)), f"two commands write the same place: {outs}"


def test_the_readme_python_example_runs_from_the_checkout(monkeypatch):
    """ "Using an emitted program from Python", as written, in the checkout (it names generated/'s program)."""
    readme = (ROOT / "README.md").read_text()
    example = re.search(
        r"## Using an emitted program from Python\n\n```python\n(.*?)^```", readme, re.S | re.M
    )
    monkeypatch.chdir(ROOT)
    names: dict = {}
    exec(example.group(1), names)
    assert names["logits"].shape == (*names["tokens"].shape, names["spec"].vocab_size)
