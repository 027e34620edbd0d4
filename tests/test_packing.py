"""Packed documents with document masking: a packed row gives each document the losses it has alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.conftest import ROOT
from tests.test_mesh_rules import tiny_program_with

from axgen.interop import load_program

# Plain llama_tiny runs jax.nn's attention with a dense document mask; with a soft-cap it takes the XLA helper,
# here with a sliding window too; Gemma's block and MoE change what surrounds attention. (Quantization is left
# out: its scales are the whole batch's, so a document's logits depend on what it is packed with.)
FEATURES = {
    "plain": None,
    "window+softcap": "F.sliding_window(window=16), F.softcap(attention=5.0, final=3.0), F.qk_norm(eps=1e-6)",
    "gemma+moe": "F.gemma_block(), F.moe(num_experts=4, top_k=2, renormalize=True, aux_loss_weight=0.01, router_z_loss_weight=0.001)",
}


def packed_row(documents, length):
    """Documents back to back in one row of `length` tokens, padded with segment 0."""
    tokens = np.zeros(length, np.int32)
    segment_ids = np.zeros(length, np.int32)
    start = 0
    for number, document in enumerate(documents, 1):
        tokens[start : start + len(document)] = document
        segment_ids[start : start + len(document)] = number
        start += len(document)
    return tokens[None], segment_ids[None]


@pytest.mark.parametrize("features", FEATURES.values(), ids=FEATURES.keys())
def test_packed_row_gives_each_document_its_losses_alone(features, tmp_path):
    if features is None:
        program = load_program(ROOT / "generated/llama_tiny/cpu_1.py")
    else:
        program = tiny_program_with(tmp_path, features, "cpu-1")
    params = program.init_params(jax.random.key(0))
    rng = np.random.default_rng(0)
    documents = [rng.integers(1, program.CONFIG["vocab_size"], size) for size in (23, 40, 2, 17)]
    tokens, segment_ids = packed_row(documents, 96)

    every_token = np.ones_like(tokens)  # plain text: every target trains
    losses, counted, _ = program.target_losses(
        params, jnp.asarray(tokens), jnp.asarray(segment_ids), every_token
    )
    losses, counted = np.asarray(losses[0]), np.asarray(counted[0])
    start = 0
    for document in documents:
        ones = np.ones((1, len(document)), np.int32)
        alone, alone_counted, _ = program.target_losses(params, document[None], ones, ones)
        assert np.asarray(alone_counted).all()
        targets = slice(start, start + len(document) - 1)
        assert counted[targets].all()
        np.testing.assert_allclose(losses[targets], np.asarray(alone[0]), rtol=2e-5, atol=2e-5)
        assert not counted[start + len(document) - 1], "the next document's first token is not a target"
        start += len(document)
    assert not counted[start - 1 :].any(), "padding never counts"
    assert counted.sum() == sum(len(d) - 1 for d in documents)

    _, metrics = program.loss_fn(params, jnp.asarray(tokens), jnp.asarray(segment_ids))
    np.testing.assert_allclose(float(metrics["cross_entropy"]), losses[counted].mean(), rtol=1e-6)


def test_without_document_masking_a_document_sees_the_one_before():
    program = load_program(ROOT / "generated/llama_tiny/cpu_1.py")
    params = program.init_params(jax.random.key(0))
    rng = np.random.default_rng(1)
    tokens, segment_ids = packed_row([rng.integers(1, 256, 20), rng.integers(1, 256, 20)], 40)
    every_token = np.ones_like(tokens)
    masked, _, _ = program.target_losses(params, tokens, segment_ids, every_token)
    merged, _, _ = program.target_losses(params, tokens, np.minimum(segment_ids, 1), every_token)
    np.testing.assert_allclose(masked[0, :19], merged[0, :19], rtol=1e-6)
    assert not np.allclose(masked[0, 20:], merged[0, 20:], rtol=1e-3)


def test_positions_restart_at_each_document():
    program = load_program(ROOT / "generated/llama_tiny/cpu_1.py")
    segment_ids = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(
        program.document_positions(segment_ids), [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]]
    )
