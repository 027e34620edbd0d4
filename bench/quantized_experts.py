"""The routed experts' grouped matmul on one Hopper GPU, bf16 against quantized: the Mosaic GPU kernel (bf16, what
gpu-h100 programs run), XLA's ragged_dot in bf16, and runtime.fp8_ragged_dot / int8_ragged_dot (XLA's ragged_dot
on quantized operands, the only grouped matmul that takes them there). Mixtral's expert widths (embed 4096, mlp
14336), 8192 rows (4096 tokens x top 2), with the 8 experts a device holds at expert=1 and with one expert.

    python bench/quantized_experts.py        # on the GPU; prints one markdown table (ms per call, median of 10)

It also checks each quantized product on the chip against the float32 one (relative error of the output).
"""

import importlib.util
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

# The module alone: the runtime package's __init__ imports the training loop's dependencies.
_spec = importlib.util.spec_from_file_location(
    "quantized_experts", Path(__file__).resolve().parent.parent / "axgen/runtime/quantized_experts.py"
)
quantized_experts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quantized_experts)

EMBED, MLP, ROWS = 4096, 14336, 8192
TILES = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=4)  # gpu.py's


def timed(f, *args) -> float:
    f = jax.jit(f)
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(10):
        began = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def main() -> None:
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}\n")
    print("| experts | path | forward ms | forward+backward ms | rel. error vs f32 |")
    print("|---|---|---|---|---|")
    for experts in (8, 1):
        keys = jax.random.split(jax.random.key(0), 3)
        rows = jax.random.normal(keys[0], (ROWS, EMBED), jnp.bfloat16)
        weights = (jax.random.normal(keys[1], (experts, EMBED, MLP), jnp.float32) / 64).astype(jnp.bfloat16)
        group_sizes = jnp.full((experts,), ROWS // experts, jnp.int32)
        exact = jax.lax.ragged_dot(
            rows.astype(jnp.float32), weights.astype(jnp.float32), group_sizes, precision="highest"
        )
        paths = {
            "ragged_dot_mgpu bf16": lambda x, w, g: ragged_dot_mgpu.ragged_dot(x, w, group_sizes=g, **TILES),
            "XLA ragged_dot bf16": jax.lax.ragged_dot,
            "fp8_ragged_dot": quantized_experts.fp8_ragged_dot,
            "int8_ragged_dot": quantized_experts.int8_ragged_dot,
        }
        for name, f in paths.items():
            try:
                forward = timed(f, rows, weights, group_sizes)
                out = jax.jit(f)(rows, weights, group_sizes).astype(jnp.float32)
                error = float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))
            except Exception as err:  # a path the chip cannot run: its first line is the row
                print(f"| {experts} | {name} | {str(err).splitlines()[0][:120]} | | |")
                continue
            if name.startswith("ragged_dot_mgpu"):
                both = "(kernel has no VJP here)"
            else:
                loss = lambda x, w, g, f=f: jnp.sum(f(x, w, g).astype(jnp.float32))
                both = f"{timed(jax.grad(loss, argnums=(0, 1)), rows, weights, group_sizes):.2f}"
            print(f"| {experts} | {name} | {forward:.2f} | {both} | {error:.4f} |")


if __name__ == "__main__":
    main()
