"""Feature passes. Each file registers one pass; importing this package registers them all."""

from axgen.passes import moe, quantize, remat, rope  # noqa: F401  (each registers its pass)
from axgen.passes.manager import PassError, register, run_passes

__all__ = ["PassError", "register", "run_passes"]
