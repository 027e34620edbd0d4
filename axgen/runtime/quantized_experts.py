"""Quantized grouped matmuls for a dropless MoE's routed experts, with jax.lax.ragged_dot's contract: rows
[rows, in] in contiguous groups, one per expert (`group_sizes`), times weights [experts, in, out] -> [rows, out];
rows after the last group give zeros and take no gradient.

The recipes are the programs' quantized dots' (runtime/quantize.py, whose quantizers they share) with one weight
scale per expert: `int8_ragged_dot` scales each row by its own max and each expert's output channels by their own
(AQT-style, int32 accumulation, the bf16 gradient: straight-through); `fp8_ragged_dot` scales the rows by their
max and each expert's weights by theirs (e4m3 values, float32 accumulation; the gradient multiplied as e5m2 by the
saved e4m3 operands).
Both multiply by XLA's ragged_dot: the chips' grouped matmul kernels (megablox, ragged_dot_mgpu) take no int8 or
fp8 operands (backends/lowering.py says per target which products run quantized). Under the MoE's shard_map each
device scales what it holds: fp8's row scale is the max of the rows it computes.
"""

import jax
import jax.numpy as jnp

from axgen.runtime.quantize import quantize_fp8, quantize_int8
from axgen.runtime.sharding import varying_axes

# Each expert's weight gradient: the groups' rows, transposed, times their output gradient ([in, out] per group).
_PER_GROUP = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


def group_of_rows(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group of each of `rows` rows; rows after the last group take the last group's index (their products
    are zero, so any scale does)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.minimum(jnp.searchsorted(ends, jnp.arange(rows), side="right"), group_sizes.shape[0] - 1)


@jax.custom_vjp
def int8_ragged_dot(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """jax.lax.ragged_dot(rows, weights, group_sizes) on int8 values with int32 accumulation: each row has one
    scale (its max|.| / 127), each expert one per output channel. Each output is off by at most
    sum_k(|x_k| * w_scale + |w_k| * x_scale) / 2 + K * x_scale * w_scale / 4 over its K products, as the dense
    int8 dot's. The backward pass is the bf16 ragged_dot's (straight-through)."""
    qx, x_scale = quantize_int8(rows, (1,))  # [rows, 1]
    qw, w_scale = quantize_int8(weights, (1,))  # [experts, 1, out]
    out = jax.lax.ragged_dot(qx, qw, group_sizes, preferred_element_type=jnp.int32)
    scale = x_scale * w_scale[group_of_rows(group_sizes, rows.shape[0]), 0]  # [rows, out]
    return (out * scale).astype(rows.dtype)


def _int8_forward(rows, weights, group_sizes):
    return int8_ragged_dot(rows, weights, group_sizes), (rows, weights, group_sizes)


def _int8_backward(saved, grad):
    rows, weights, group_sizes = saved
    _, vjp = jax.vjp(
        lambda x, w: jax.lax.ragged_dot(x, w, group_sizes),
        rows.astype(jnp.bfloat16),
        weights.astype(jnp.bfloat16),
    )
    d_rows, d_weights = vjp(grad.astype(jnp.bfloat16))
    return d_rows.astype(rows.dtype), d_weights.astype(weights.dtype), None


int8_ragged_dot.defvjp(_int8_forward, _int8_backward)


@jax.custom_vjp
def fp8_ragged_dot(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """jax.lax.ragged_dot(rows, weights, group_sizes) on e4m3 values (3 mantissa bits: each value within 2^-4
    relative, or 2^-10 * its scale absolute near zero) with float32 accumulation: the rows share one scale, each
    expert's weights have their own. The backward pass quantizes the output gradient to e5m2 (wider range, for
    gradients) with one scale and multiplies it by the saved e4m3 operands, accumulating in float32."""
    return _fp8_forward(rows, weights, group_sizes)[0]


def _fp8_forward(rows, weights, group_sizes):
    qx, x_scale = quantize_fp8(rows, jnp.float8_e4m3fn)
    qw, w_scale = quantize_fp8(weights, jnp.float8_e4m3fn, (1, 2))  # [experts, 1, 1]
    row_scale = w_scale[group_of_rows(group_sizes, rows.shape[0]), 0]  # [rows, 1]: each row's expert's
    out = jax.lax.ragged_dot(qx, qw, group_sizes, preferred_element_type=jnp.float32) * (x_scale * row_scale)
    # Zero-size slices carry the rows' and weights' dtypes, and the mesh axes they vary over, to the backward pass.
    saved = (qx, x_scale, qw, row_scale, group_sizes, rows[:0], weights[:0])
    return out.astype(rows.dtype), saved


def _fp8_backward(saved, grad):
    qx, x_scale, qw, row_scale, group_sizes, rows_like, weights_like = saved
    qg, g_scale = quantize_fp8(grad, jnp.float8_e5m2)
    d_rows = jax.lax.ragged_dot(
        qg, jnp.swapaxes(qw, 1, 2), group_sizes, preferred_element_type=jnp.float32
    ) * (g_scale * row_scale)
    d_weights = jax.lax.ragged_dot_general(
        qx, qg, group_sizes, _PER_GROUP, preferred_element_type=jnp.float32
    ) * (x_scale * g_scale)
    return _like(d_rows, rows_like), _like(d_weights, weights_like), None


def _like(cotangent, primal):
    """`cotangent` in `primal`'s dtype, summed over the mesh axes it varies over and `primal` does not: inside a
    shard_map, weights the devices of a batch axis share take the sum of their devices' gradients (what jax's own
    transpose of a shared input does)."""
    extra = tuple(sorted(varying_axes(cotangent) - varying_axes(primal)))
    return (jax.lax.psum(cotangent, extra) if extra else cotangent).astype(primal.dtype)


fp8_ragged_dot.defvjp(_fp8_forward, _fp8_backward)
