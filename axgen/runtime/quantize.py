"""Quantized dots: jnp.einsum(spec, x, w) on int8 or fp8 operands, as a quantized projection's program calls it
(passes/quantize.py sets which dots and dtypes; the program prints one call per dot). The quantizers are shared
with the routed experts' quantized grouped matmuls (runtime/quantized_experts.py).

`int8_einsum`: AQT-style, one scale per token of x and per output channel of w, int32 accumulation, the bf16
gradient (straight-through). `fp8_einsum`: e4m3 values with per-tensor scales from this step's values (current
scaling), float32 accumulation, the gradient multiplied as e5m2. `fp8_delayed_einsum`: the same, each scale taken
from a history of the last steps' amaxes that the train step carries.
"""

import functools

import jax
import jax.numpy as jnp


def einsum_operands(spec):
    """ "bse,ehd->bshd" -> ("bse", "ehd", "bshd", positions of x's and of w's contracted axes)."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    contracted = set(x) & set(w) - set(out)
    x_axes = tuple(i for i, a in enumerate(x) if a in contracted)
    return x, w, out, x_axes, tuple(i for i, a in enumerate(w) if a in contracted)


def quantize_int8(x, axes):
    """Symmetric int8 with one float32 scale per slice over `axes`: x ~ q * scale with |q| <= 127."""
    scale = jnp.max(jnp.abs(x), axis=axes, keepdims=True).astype(jnp.float32) / 127
    scale = jnp.where(scale == 0, 1.0, scale)
    return jnp.round(x / scale).astype(jnp.int8), scale


def quantize_fp8(x, dtype, axes=None):
    """x in an fp8 `dtype` with one float32 scale per slice over `axes` (all of x without), chosen from this x
    (current scaling) so that the slice's max|x| lands on the format's largest value."""
    scale = jnp.max(jnp.abs(x), axis=axes, keepdims=axes is not None).astype(jnp.float32)
    scale = scale / float(jnp.finfo(dtype).max)
    scale = jnp.where(scale == 0, 1.0, scale)
    return (x / scale).astype(dtype), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def int8_einsum(spec, x, w):
    """jnp.einsum(spec, x, w) on int8 values with int32 accumulation, AQT-style: x has one scale per token (over
    its contracted axes), w one per output channel. Each output is off by at most
    sum_k(|x_k| * w_scale + |w_k| * x_scale) / 2 + K * x_scale * w_scale / 4 over its K products, where a scale is
    its slice's max|.| / 127. The backward pass is the bf16 einsum's (straight-through)."""
    _, _, _, x_axes, w_axes = einsum_operands(spec)
    qx, x_scale = quantize_int8(x, x_axes)
    qw, w_scale = quantize_int8(w, w_axes)
    # The scales keep their contracted axes at size 1, so the same einsum broadcasts them onto the output.
    scale = jnp.einsum(spec, x_scale, w_scale)
    return (jnp.einsum(spec, qx, qw, preferred_element_type=jnp.int32) * scale).astype(x.dtype)


def _int8_einsum_forward(spec, x, w):
    return int8_einsum(spec, x, w), (x, w)


def _int8_einsum_backward(spec, residuals, grad):
    x, w = residuals
    _, vjp = jax.vjp(lambda x, w: jnp.einsum(spec, x, w), x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    dx, dw = vjp(grad.astype(jnp.bfloat16))
    return dx.astype(x.dtype), dw.astype(w.dtype)


int8_einsum.defvjp(_int8_einsum_forward, _int8_einsum_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(spec, x, w):
    """jnp.einsum(spec, x, w) on e4m3 values (3 mantissa bits: each value within 2^-4 relative, or 2^-10 * scale
    absolute near zero) with float32 accumulation. The backward pass multiplies the gradient as e5m2 (wider range,
    for gradients) by the saved e4m3 operands, accumulating in float32."""
    return _fp8_einsum_forward(spec, x, w)[0]


def _fp8_einsum_forward(spec, x, w):
    qx, x_scale = quantize_fp8(x, jnp.float8_e4m3fn)
    qw, w_scale = quantize_fp8(w, jnp.float8_e4m3fn)
    out = jnp.einsum(spec, qx, qw, preferred_element_type=jnp.float32) * (x_scale * w_scale)
    # Zero-size arrays carry x's and w's dtypes to the backward pass.
    return out.astype(x.dtype), (qx, x_scale, qw, w_scale, jnp.zeros(0, x.dtype), jnp.zeros(0, w.dtype))


def _fp8_einsum_backward(spec, residuals, grad):
    qx, x_scale, qw, w_scale, x_dtype, w_dtype = residuals
    x, w, out, _, _ = einsum_operands(spec)
    qg, g_scale = quantize_fp8(grad, jnp.float8_e5m2)
    dx = jnp.einsum(f"{out},{w}->{x}", qg, qw, preferred_element_type=jnp.float32) * (g_scale * w_scale)
    dw = jnp.einsum(f"{x},{out}->{w}", qx, qg, preferred_element_type=jnp.float32) * (x_scale * g_scale)
    return dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype)


fp8_einsum.defvjp(_fp8_einsum_forward, _fp8_einsum_backward)


def delayed_scale(amax_history, current_amax, dtype):
    """Delayed scaling: the largest amax of the last steps sets the scale, so no reduction over this step's tensor
    waits in front of the matmul; this step's own amax stands in until there is a history."""
    amax = jnp.max(amax_history).astype(jnp.float32)
    return jnp.where(amax > 0, amax, current_amax) / float(jnp.finfo(dtype).max)


def to_fp8(x, scale, dtype):
    """x / scale in `dtype`, clipped: a delayed scale can be too small for this step's values."""
    limit = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_delayed_einsum(spec, x, w, amax_history):
    """jnp.einsum(spec, x, w) on e4m3 values, e5m2 gradients and float32 accumulation, with each operand's scale
    taken from `amax_history` [steps, (x, w, gradient)]. Backward returns the history rolled by one step with this
    step's amaxes in front, in place of a gradient; the train step writes it over the old history."""
    return _fp8_delayed_einsum_forward(spec, x, w, amax_history)[0]


def _fp8_delayed_einsum_forward(spec, x, w, amax_history):
    x_amax, w_amax = jnp.max(jnp.abs(x)).astype(jnp.float32), jnp.max(jnp.abs(w)).astype(jnp.float32)
    x_scale = delayed_scale(amax_history[:, 0], x_amax, jnp.float8_e4m3fn)
    w_scale = delayed_scale(amax_history[:, 1], w_amax, jnp.float8_e4m3fn)
    qx, qw = to_fp8(x, x_scale, jnp.float8_e4m3fn), to_fp8(w, w_scale, jnp.float8_e4m3fn)
    out = jnp.einsum(spec, qx, qw, preferred_element_type=jnp.float32) * (x_scale * w_scale)
    saved = (
        qx,
        x_scale,
        x_amax,
        jnp.zeros(0, x.dtype),
        qw,
        w_scale,
        w_amax,
        jnp.zeros(0, w.dtype),
        amax_history,
    )
    return out.astype(x.dtype), saved


def _fp8_delayed_einsum_backward(spec, residuals, grad):
    qx, x_scale, x_amax, x_dtype, qw, w_scale, w_amax, w_dtype, amax_history = residuals
    x, w, out, _, _ = einsum_operands(spec)
    g_amax = jnp.max(jnp.abs(grad)).astype(jnp.float32)
    g_scale = delayed_scale(amax_history[:, 2], g_amax, jnp.float8_e5m2)
    qg = to_fp8(grad, g_scale, jnp.float8_e5m2)
    dx = jnp.einsum(f"{out},{w}->{x}", qg, qw, preferred_element_type=jnp.float32) * (g_scale * w_scale)
    dw = jnp.einsum(f"{x},{out}->{w}", qx, qg, preferred_element_type=jnp.float32) * (x_scale * g_scale)
    amaxes = jnp.stack([x_amax, w_amax, g_amax]).astype(amax_history.dtype)
    next_history = jnp.roll(amax_history, 1, axis=0).at[0].set(amaxes)
    return dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype), next_history


fp8_delayed_einsum.defvjp(_fp8_delayed_einsum_forward, _fp8_delayed_einsum_backward)
