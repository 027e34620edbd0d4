"""What every emitted program runs on, tested once: the dataset reader, checkpoints with checksums, fault
handling, metrics, flags and the main loop (`run.main`), and the few helpers programs call (params, sharding,
gradients, the cross-entropy). A program holds what its spec and target decide and hands it to `main`.

This package imports jax, optax, orbax, numpy and tensorboardX, and nothing of the compiler: a training host
needs axgen installed (`pip install --no-deps axgen` beside its own jax works) but none of the compiler's
dependencies.
"""

from axgen.runtime.losses import cross_entropy, lm_head_cross_entropy, trained_targets
from axgen.runtime.params import ParamSpec, init_params
from axgen.runtime.run import main
from axgen.runtime.sharding import constrain, logical_to_mesh, param_shardings, shards
from axgen.runtime.training import apply_gradients, gradients, summed_over_microbatches

__all__ = [
    "ParamSpec",
    "apply_gradients",
    "constrain",
    "cross_entropy",
    "gradients",
    "init_params",
    "lm_head_cross_entropy",
    "logical_to_mesh",
    "main",
    "param_shardings",
    "shards",
    "summed_over_microbatches",
    "trained_targets",
]
