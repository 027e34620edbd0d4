"""What a deviceless compile for a chip needs installed beyond the default environment, checked before any work
starts: the default install (`make demo`, `pip install axgen`) holds what the CPU path needs and no chip's
compiler (libtpu and the CUDA plugin are 2.7 GB together)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

from axgen.backends import Plan

# jax's platform name -> (the module that compiles for it without the chips, the extra that installs it)
COMPILERS = {"tpu": ("libtpu", "tpu"), "cuda": ("jax_cuda12_plugin", "gpu-aot")}


class MissingExtra(ValueError):
    """One line: the target, what is missing, and the command that installs it."""


def check_compiler(plan: Plan, command: str) -> None:
    """Refuses, naming the extra to install, a compile for a chip whose compiler this environment lacks."""
    module, extra = COMPILERS.get(plan.platform, (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        raise MissingExtra(
            f"axgen {command} for {plan.target} compiles with {module}, which this environment lacks: install "
            f"axgen's extra [{extra}]: pip install {' '.join(_requirements(extra))} (make test's environment has it)"
        )


def _requirements(extra: str) -> list[str]:
    """The extra's packages as the installed axgen's metadata pins them (pyproject.toml's optional-dependencies)."""
    marker = re.compile(rf";\s*extra\s*==\s*[\"']{re.escape(extra)}[\"']\s*$")
    pinned = [r for r in importlib.metadata.requires("axgen") or () if marker.search(r)]
    return [f"'{marker.sub('', r).strip()}'" for r in pinned]
