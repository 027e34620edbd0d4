"""Attention sinks (gpt-oss): each head's learned logit joins every query's softmax without a value. The plain-XLA
path the lowering names for XLA and cuDNN targets, and the splash kernel's own sinks (interpreted, sharded), against
a reference written here from the definition, values and gradients, over rows that pack several documents."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axgen.cli import main as axgen
from axgen.interop import load_program
from axgen.runtime.attention import causal_attention, document_mask
from tests.conftest import ROOT


def sinks_spec(tmp_path, window):
    spec = tmp_path / "sinks.py"
    window_feature = f", F.sliding_window(window={window})" if window else ""
    spec.write_text(
        "from axgen.specs.llama_tiny import spec as tiny\nfrom axgen.spec import features as F\n"
        f"spec = tiny.replace(features=[*tiny.features, F.attention_sinks(){window_feature}])\n"
    )
    return spec


def reference(q, k, v, segment_ids, sinks, window):
    """softmax over [scores of the visible keys, the head's sink], the sink's share dropped: per head, in full."""
    heads, kv_heads, seq = q.shape[2], k.shape[2], q.shape[1]
    k, v = (jnp.repeat(x, heads // kv_heads, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    sink = jnp.broadcast_to(sinks[None, :, None, None], (*scores.shape[:-1], 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def inputs(seq, heads=4, kv_heads=2, head_dim=32):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (8, seq, heads, head_dim))
    k, v = (jax.random.normal(key, (8, seq, kv_heads, head_dim)) for key in keys[1:3])
    # Sinks near the scores' size, so that they take a share of the mass worth seeing.
    sinks = 2.0 * jax.random.normal(keys[3], (heads,))
    document_starts = np.random.default_rng(0).random((8, seq)) < 0.03
    segment_ids = jnp.asarray(np.cumsum(document_starts, axis=1) + 1, jnp.int32)
    assert segment_ids[:, -1].min() > 1, "every row packs several documents"
    return q, k, v, sinks, segment_ids


def check(attention, expected, q, k, v, sinks, jit=jax.jit):
    def loss(attention, q, k, v, sinks):
        return (attention(q, k, v, sinks) ** 2).sum()

    out = jit(attention)(q, k, v, sinks)
    grads = jit(jax.grad(functools.partial(loss, attention), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    expected_grads = jax.grad(functools.partial(loss, expected), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    np.testing.assert_allclose(out, expected(q, k, v, sinks), atol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads):
        np.testing.assert_allclose(grad, expected_grad, atol=1e-4 * float(jnp.abs(expected_grad).max()))
    assert float(jnp.abs(grads[3]).min()) > 0, "every sink takes a gradient"


@pytest.mark.parametrize("window", [None, 24])
def test_xla_path_with_sinks_equals_the_definition(window):
    q, k, v, sinks, segment_ids = inputs(96)
    expected = functools.partial(reference, segment_ids=segment_ids, window=window)
    ours = functools.partial(
        causal_attention,
        segment_ids=segment_ids,
        implementation="xla_ops",
        block=None,
        rules={},
        window=window,
        softcap=None,
        scale=None,
    )
    check(
        lambda q, k, v, s: ours(q, k, v, sinks=s),
        lambda q, k, v, s: expected(q, k, v, sinks=s),
        q,
        k,
        v,
        sinks,
    )
    # The sinks change the output: without them the softmax is plain attention's.
    plain = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=document_mask(segment_ids),
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
    )
    assert not np.allclose(ours(q, k, v, sinks=sinks), plain, atol=1e-2)
    np.testing.assert_allclose(ours(q, k, v, sinks=jnp.full((4,), -1e4)), plain, atol=1e-5)


@pytest.mark.parametrize("window", [None, 64])
def test_splash_kernel_takes_the_sinks_when_sharded(window):
    """The splash kernel's own sinks in interpret mode, the heads split over the mesh (so are the sinks)."""
    program = load_program(ROOT / "generated/llama_tiny/tpu_v5e_8.py")  # its rules and block length
    q, k, v, sinks, segment_ids = inputs(256)
    expected = functools.partial(reference, segment_ids=segment_ids, window=window)
    splash = functools.partial(
        causal_attention,
        segment_ids=segment_ids,
        implementation="splash",
        block=program.SPLASH_BLOCK,
        rules=program.LOGICAL_AXIS_RULES,
        window=window,
        softcap=None,
        scale=None,
        interpret=True,
    )
    mesh = jax.make_mesh(
        (1, 4, 1, 2), ("data", "fsdp", "expert", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 4
    )
    with jax.set_mesh(mesh):
        check(
            lambda q, k, v, s: splash(q, k, v, sinks=s),
            lambda q, k, v, s: expected(q, k, v, sinks=s),
            q,
            k,
            v,
            sinks,
        )


@pytest.mark.parametrize(
    ("target", "kernel"), [("cpu-1", "xla_ops"), ("gpu-h100-8", "xla_ops"), ("tpu-v5e-8", "splash")]
)
def test_the_lowering_names_the_path_that_takes_the_sinks(target, kernel, tmp_path, capsys):
    """cuDNN (through jax.nn.dot_product_attention) and XLA's fused call take no sinks: their targets run the
    plain-XLA path, which `axgen graph --after lowering` names; splash takes them itself."""
    assert axgen(["graph", str(sinks_spec(tmp_path, 16)), "--target", target, "--after", "lowering"]) == 0
    attentions = [line for line in capsys.readouterr().out.splitlines() if "= attention(" in line]
    assert attentions and all(f"sinks=True kernel={kernel} " in line for line in attentions), attentions
