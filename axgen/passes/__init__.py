"""Feature passes. Each file registers one pass; importing this package imports every file, so a new pass is
registered by adding its file."""

import importlib
import pkgutil

from axgen.passes.manager import PassError, register, run_passes

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["PassError", "register", "run_passes"]
