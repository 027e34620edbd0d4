"""A second checkout builds from its own specs and templates, never from those of the checkout whose editable
install the virtualenv holds: the bundled specs (`axgen.specs`) and the templates live inside the package, so
they resolve from the axgen that runs."""

import shutil
import subprocess
import sys

from tests.conftest import PROGRAM_ENV, ROOT


def test_a_second_checkout_builds_from_its_own_specs_and_templates(tmp_path):
    clone = tmp_path / "second"
    shutil.copytree(ROOT / "axgen", clone / "axgen", ignore=shutil.ignore_patterns("__pycache__"))
    # moe_tiny derives from llama_tiny (`from axgen.specs.llama_tiny import spec`): that import must be the
    # second checkout's too.
    tiny = clone / "axgen/specs/llama_tiny.py"
    tiny.write_text(tiny.read_text().replace("vocab_size=512", "vocab_size=640"))
    assert "vocab_size=640" in tiny.read_text()
    header = clone / "axgen/templates/header.py.j2"
    header.write_text(header.read_text() + "# Built by the second checkout.\n")

    built = subprocess.run(
        [sys.executable, "-m", "axgen.cli", "build", "moe_tiny", "--target", "cpu-1", "--out", "prog.py"],
        cwd=clone,
        env=PROGRAM_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    program = (clone / "prog.py").read_text()
    assert "# Built by the second checkout." in program
    assert '"vocab_size": 640' in program
    assert "# Regenerate: axgen build moe_tiny --target cpu-1" in program
