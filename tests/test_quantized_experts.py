"""runtime.int8_ragged_dot / fp8_ragged_dot, the routed experts' quantized grouped matmuls: they stay within the
dense quantized dots' error bounds with one weight scale per expert, and their gradients pass straight through.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axgen.runtime import fp8_ragged_dot, int8_ragged_dot

GROUPS = np.array([70, 0, 81, 20])  # an empty group, and 29 rows after the last group
ROWS, IN, OUT = 200, 64, 48


def operands(seed):
    keys = jax.random.split(jax.random.key(seed), 2)
    x = np.asarray(jax.random.normal(keys[0], (ROWS, IN)))
    # Each expert's weights at its own size, so one scale for them all would lose the small ones.
    w = (
        np.asarray(jax.random.normal(keys[1], (len(GROUPS), IN, OUT)))
        * np.array([0.05, 1, 0.01, 0.2])[:, None, None]
    )
    return x, w


def expert_of_rows():
    """Each row's expert, -1 after the last group."""
    return np.concatenate([np.repeat(np.arange(len(GROUPS)), GROUPS), -np.ones(ROWS - GROUPS.sum(), int)])


def exact(x, w):
    expert = expert_of_rows()
    out = np.zeros((ROWS, OUT))
    for e in range(len(GROUPS)):
        out[expert == e] = x[expert == e].astype(np.float64) @ w[e].astype(np.float64)
    return out


def per_row(w_of_expert):
    """An expert's [experts, ...] array as each row's, zero after the last group."""
    expert = expert_of_rows()
    return np.where((expert >= 0)[:, None], w_of_expert[np.maximum(expert, 0)], 0)


def test_int8_error_is_within_the_dense_bound_with_one_scale_per_expert_channel():
    x, w = operands(0)
    got = np.asarray(int8_ragged_dot(jnp.asarray(x), jnp.asarray(w), jnp.asarray(GROUPS, jnp.int32)))
    want = exact(x, w)
    x_scale = np.abs(x).max(axis=1, keepdims=True) / 127  # [rows, 1]
    w_scale = per_row(np.abs(w).max(axis=1) / 127)  # [rows, out]: each row's expert's channel scales
    w_abs = np.stack([np.abs(w[max(e, 0)]) * (e >= 0) for e in expert_of_rows()])  # [rows, in, out]
    bound = (
        np.abs(x) @ np.ones((IN, 1)) * w_scale / 2
        + np.einsum("ri,rio->ro", np.broadcast_to(x_scale, x.shape), w_abs) / 2
        + x_scale * w_scale * IN / 4
    )
    assert np.all(np.abs(got - want) <= bound * (1 + 1e-5) + 1e-6)
    assert np.abs(got - want).max() > 0, "an exact result means nothing was quantized"
    assert np.all(got[GROUPS.sum() :] == 0)
    # The smallest expert keeps its precision: its own scales, not the largest expert's.
    small = expert_of_rows() == 2
    assert np.linalg.norm(got[small] - want[small]) < 0.02 * np.linalg.norm(want[small])


def test_fp8_error_is_within_the_dense_bound_with_one_scale_per_expert():
    x, w = operands(1)
    got = np.asarray(fp8_ragged_dot(jnp.asarray(x), jnp.asarray(w), jnp.asarray(GROUPS, jnp.int32)))
    want = exact(x, w)
    # Each operand is within 2^-4 relative or 2^-10 * its scale (max|.| / 448: the rows', each expert's) absolute.
    rel = 2.0**-4
    x_err = rel * np.abs(x) + 2.0**-10 * np.abs(x).max() / 448
    w_err = rel * np.abs(w) + 2.0**-10 * np.abs(w).max(axis=(1, 2), keepdims=True) / 448
    bound = exact(np.abs(x), w_err) + exact(x_err, np.abs(w) + w_err)
    assert np.all(np.abs(got - want) <= bound * (1 + 1e-5) + 1e-6)
    assert np.linalg.norm(got - want) < 0.1 * np.linalg.norm(want)
    small = expert_of_rows() == 2
    assert np.linalg.norm(got[small] - want[small]) < 0.1 * np.linalg.norm(want[small])


@pytest.mark.parametrize("matmul, tolerance", [(int8_ragged_dot, 0.01), (fp8_ragged_dot, 0.1)])
def test_gradients_pass_straight_through(matmul, tolerance):
    x, w = (jnp.asarray(a) for a in operands(2))
    groups = jnp.asarray(GROUPS, jnp.int32)
    cotangent = jax.random.normal(jax.random.key(3), (ROWS, OUT))
    got = jax.grad(lambda x, w: jnp.sum(matmul(x, w, groups) * cotangent), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(jax.lax.ragged_dot(x, w, groups) * cotangent), argnums=(0, 1))(x, w)
    # int8 differentiates the bf16 ragged_dot; fp8 multiplies e5m2 gradients by the e4m3 operands.
    for g, e in zip(got, want):
        assert np.linalg.norm(np.asarray(g) - np.asarray(e)) < tolerance * np.linalg.norm(np.asarray(e))
    assert np.all(np.asarray(got[0])[GROUPS.sum() :] == 0), "rows in no group take no gradient"
