"""What every emitted program runs on, tested once: the dataset reader, checkpoints with checksums, fault
handling, metrics, flags and the main loop (`run.main`), and the few helpers programs call (params, sharding,
gradients, rotary embedding, attention by each kernel, the cross-entropy, the routed experts: routing, the
dropless and capacity paths, their grouped matmuls). A program holds what its spec and target decide and hands
it to `main`.

This package imports jax, optax, orbax, numpy and tensorboardX, and nothing of the compiler: a training host
needs axgen installed (`pip install --no-deps axgen` beside its own jax works) but none of the compiler's
dependencies.
"""

from axgen.runtime.attention import causal_attention, soft_cap
from axgen.runtime.losses import cross_entropy, lm_head_cross_entropy, trained_targets
from axgen.runtime.moe import Routing, expert_mlp, grouped_matmul, moe_dropless, moe_with_capacity, route
from axgen.runtime.params import ParamSpec, init_params
from axgen.runtime.quantized_experts import fp8_ragged_dot, int8_ragged_dot
from axgen.runtime.rope import rope, rope_frequencies
from axgen.runtime.run import main
from axgen.runtime.sharding import (
    constrain,
    logical_to_mesh,
    param_shardings,
    shards,
    varying_axes,
    varying_over,
)
from axgen.runtime.training import apply_gradients, gradients, summed_over_microbatches

__all__ = [
    "ParamSpec",
    "Routing",
    "apply_gradients",
    "causal_attention",
    "constrain",
    "cross_entropy",
    "expert_mlp",
    "fp8_ragged_dot",
    "gradients",
    "grouped_matmul",
    "init_params",
    "int8_ragged_dot",
    "lm_head_cross_entropy",
    "logical_to_mesh",
    "main",
    "moe_dropless",
    "moe_with_capacity",
    "param_shardings",
    "rope",
    "rope_frequencies",
    "route",
    "shards",
    "soft_cap",
    "summed_over_microbatches",
    "trained_targets",
    "varying_axes",
    "varying_over",
]
