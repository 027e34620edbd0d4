"""What every emitted program runs on, tested once: the dataset reader, checkpoints with checksums, fault
handling, metrics, flags and the main loop (`run.main`), and the few helpers programs call (params, sharding,
gradients, rotary embedding, attention by each kernel, quantized dots, the cross-entropy, the routed experts:
routing, the dropless and capacity paths, their grouped matmuls). What each kernel takes is runtime/kernels.py's
table, which the compiler's lowering reads too. A program holds what its spec and target decide and hands
it to `main`.

This package imports jax, optax, orbax, numpy and tensorboardX, and nothing of the compiler: a training host
needs axgen installed (`pip install --no-deps axgen` beside its own jax works) but none of the compiler's
dependencies.
"""

import importlib
import sys

# The names are imported from their modules when a program first reads one (PEP 562), so the compiler can read
# runtime/kernels.py's table without importing jax.
_HOMES = {
    "ParamSpec": "params",
    "adapters_off": "params",
    "completion_logps": "preference",
    "dpo": "preference",
    "dropout_keys": "dropout",
    "Routing": "moe",
    "apply_gradients": "training",
    "causal_attention": "attention",
    "constrain": "sharding",
    "cross_entropy": "losses",
    "expert_mlp": "moe",
    "fp8_delayed_einsum": "quantize",
    "from_context_order": "context",
    "fp8_einsum": "quantize",
    "fp8_ragged_dot": "quantized_experts",
    "fold_rows": "dropout",
    "gradients": "training",
    "grouped_matmul": "moe",
    "in_compute_dtype": "params",
    "init_params": "params",
    "int8_einsum": "quantize",
    "int8_ragged_dot": "quantized_experts",
    "lm_head_cross_entropy": "losses",
    "lora_dropout": "dropout",
    "logical_to_mesh": "sharding",
    "main": "run",
    "moe_dropless": "moe",
    "moe_with_capacity": "moe",
    "param_shardings": "sharding",
    "pipeline": "stages",
    "pipelined_loss": "stages",
    "rope": "rotary",
    "rope_frequencies": "rotary",
    "route": "moe",
    "shards": "sharding",
    "simpo": "preference",
    "soft_cap": "attention",
    "summed_over_microbatches": "training",
    "to_context_order": "context",
    "trained": "params",
    "trained_targets": "losses",
    "varying_axes": "sharding",
    "varying_over": "sharding",
    "vocab_parallel_take": "sharding",
    "with_layer_keys": "dropout",
}


def __getattr__(name):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Every home at once, at the first name a program reads (its PARAMS, as it is imported): a module first imported
    # while a step is traced can add to jax's trace context (Pallas's flags do, by splash's import), and jit would
    # then trace and compile that step a second time at its second call.
    for home in sorted(set(_HOMES.values())):
        importlib.import_module(f"{__name__}.{home}")
    globals().update({n: getattr(sys.modules[f"{__name__}.{home}"], n) for n, home in _HOMES.items()})
    return globals()[name]


__all__ = sorted(_HOMES)
