"""Attention whose value head dim differs from the query/key one (DeepSeek's MLA: q/k 192, v 128): the shape rule,
the flops, the lowering's choice per kernel, and each kernel path's values and gradients against a plain reference.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axgen.backends.lowering import attention_kernel
from axgen.ir import Graph, GraphError
from axgen.ir.ops import OPS
from axgen.ir.types import TensorType
from axgen.runtime.attention import causal_attention

QK, V = 48, 24  # head dims: v narrower than q/k, as DeepSeek's 128 against 192


def attention_graph(v_dim: int = V) -> Graph:
    g = Graph("mla")
    g.add_region("main")
    inputs = {
        name: g.add("main", name, "input", type=TensorType.of("batch", "seq", heads, ("head_dim", dim)))
        for name, heads, dim in [
            ("q", ("heads", 4), QK),
            ("k", ("kv_heads", 2), QK),
            ("v", ("kv_heads", 2), v_dim),
        ]
    }
    inputs["segment_ids"] = g.add("main", "segment_ids", "input", type=TensorType.of("batch", "seq"))
    g.add("main", "attention", "attention", inputs)
    return g


def test_the_output_has_v_s_head_dim_and_the_flops_count_both():
    g = attention_graph()
    [node] = g.nodes(op="attention")
    assert node.type == TensorType.of("batch", "seq", ("heads", 4), ("head_dim", V))
    ins = {slot: src.type for slot, src in g.inputs(node).items()}
    # causal: seq / 2 keys per query; 6 flops per multiply-add over the scores' QK and the values' V channels
    assert OPS["attention"].flops(ins, node.attrs, {}, 256) == 6 * 128 * 4 * (QK + V)


def test_k_and_v_must_agree_but_for_head_dim():
    g = Graph("bad")
    g.add_region("main")
    q = g.add("main", "q", "input", type=TensorType.of("batch", "seq", ("heads", 4), ("head_dim", QK)))
    k = g.add("main", "k", "input", type=TensorType.of("batch", "seq", ("kv_heads", 2), ("head_dim", QK)))
    v = g.add("main", "v", "input", type=TensorType.of("batch", "seq", ("kv_heads", 1), ("head_dim", V)))
    ids = g.add("main", "segment_ids", "input", type=TensorType.of("batch", "seq"))
    with pytest.raises(GraphError, match="differ in more than head_dim"):
        g.add("main", "attention", "attention", {"q": q, "k": k, "v": v, "segment_ids": ids})


@pytest.mark.parametrize(
    ("kernel", "v_dim", "pad_v"),
    [("splash", V, False), ("cudnn", V, True), ("xla", V, True), ("cudnn", QK, False), ("xla", QK, False)],
)
def test_the_lowering_pads_v_only_for_kernels_that_take_one_head_dim(kernel, v_dim, pad_v):
    """Splash sizes q/k and v blocks apart; jax.nn.dot_product_attention (XLA, cuDNN) requires v's head dim to be
    k's, so the lowering pads v there, and only where the dims differ."""
    g = attention_graph(v_dim)
    attention_kernel(
        g,
        SimpleNamespace(
            attention=kernel,
            attention_block=128 if kernel == "splash" else None,
            compute_dtype="bfloat16",
        ),
    )
    [node] = g.nodes(op="attention")
    assert (node.attrs.kernel, node.attrs.v_head_dim, node.attrs.pad_v) == (
        kernel,
        None if v_dim == QK else v_dim,
        pad_v,
    )


def reference(q, k, v, segment_ids, softcap=None):
    """Causal grouped attention inside each document in plain jnp, q/k head dim QK, v's V."""
    heads, kv_heads = q.shape[2], k.shape[2]
    k, v = (jnp.repeat(x, heads // kv_heads, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bshd->bhqs", q, k) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    seq = q.shape[1]
    visible = (jnp.arange(seq)[None, :] <= jnp.arange(seq)[:, None]) & (
        segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    )
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqs,bshd->bqhd", probs, v)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_each_kernel_path_equals_plain_attention_with_a_narrower_v(softcap):
    """Values and gradients of q, k, v: XLA (and so cuDNN's call, which differs only in `implementation`) with v
    padded and the output sliced back, or the soft-capped plain-XLA path; splash (in interpret mode, as on CPU it
    can only run so) with v as it is."""
    q, k, v = (
        jax.random.normal(key, shape)
        for key, shape in zip(
            jax.random.split(jax.random.key(0), 3), [(2, 256, 4, QK), (2, 256, 2, QK), (2, 256, 2, V)]
        )
    )
    document_starts = np.random.default_rng(0).random((2, 256)) < 0.02
    segment_ids = jnp.asarray(np.cumsum(document_starts, axis=1) + 1, jnp.int32)
    options = dict(rules={}, window=None, softcap=softcap, scale=None, sinks=None)
    paths = {
        "xla": functools.partial(
            causal_attention, implementation="xla" if softcap is None else "xla_ops", block=None, **options
        ),
        "splash": functools.partial(
            causal_attention, implementation="splash", block=128, interpret=True, **options
        ),
    }
    expected = reference(q, k, v, segment_ids, softcap)
    loss = lambda f, q, k, v: (f(q, k, v, segment_ids) ** 2).sum()
    expected_grads = jax.grad(functools.partial(loss, reference_with(softcap)), argnums=(0, 1, 2))(q, k, v)
    for name, path in paths.items():
        out = jax.jit(path)(q, k, v, segment_ids)
        assert out.shape == (2, 256, 4, V), name
        np.testing.assert_allclose(out, expected, atol=2e-5, err_msg=name)
        grads = jax.jit(jax.grad(functools.partial(loss, path), argnums=(0, 1, 2)))(q, k, v)
        for grad, expected_grad in zip(grads, expected_grads):
            np.testing.assert_allclose(grad, expected_grad, atol=1e-4 * float(jnp.abs(expected_grad).max()))


def reference_with(softcap):
    return lambda q, k, v, segment_ids: reference(q, k, v, segment_ids, softcap)
