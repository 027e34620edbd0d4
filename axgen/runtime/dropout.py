"""Dropout on F.lora's adapter inputs (PEFT's `lora_dropout`), drawn from keys the train step derives from the
seed and the step: a resumed run drops what the uninterrupted one would have, and any microbatching, sharding or
remat draws the same masks, since every mask follows from its row, layer and projection alone.

Keys travel as their raw data ([rows, 2] uint32 for threefry), so they split into microbatches and shard along
the batch as the token rows beside them do. A mask's key is its row's key folded with the names and indices on
the way to it: the scan's name and the layer's index, then the projection's param name, then each position's index
in the sequence, so a sequence split over context shards (runtime/context.py) drops what it would whole.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np

from axgen.runtime.context import context_shards, sequence_index


def dropout_keys(seed: int, step, rows: int):
    """A key per row of a step's batch, [rows, 2] uint32: the seed's, folded with the step, then the row."""
    step_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _number("dropout")), step)
    return jax.vmap(lambda row: jax.random.key_data(jax.random.fold_in(step_key, row)))(jnp.arange(rows))


def fold_rows(keys, data: int | str):
    """Each row's key folded with `data` (a name or an index); None stays None (no dropout: evaluation)."""
    if keys is None:
        return None
    data = _number(data) if isinstance(data, str) else data
    return jax.vmap(lambda key: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key), data)))(
        keys
    )


def with_layer_keys(stacked, keys, name: str):
    """(stacked params, keys [layers, rows, 2]): what a scan over the `name` stack's layers runs over, each layer
    with its own keys; (stacked, None) without keys."""
    if keys is None:
        return stacked, None
    keys = fold_rows(keys, name)
    layers = jax.tree.leaves(stacked)[0].shape[0]
    return stacked, jax.vmap(lambda layer: fold_rows(keys, layer))(jnp.arange(layers))


def lora_dropout(x, keys, rate: float, name: str, rules: dict):
    """x [rows, seq, ...] with each value dropped with probability `rate` and the rest scaled by 1 / (1 - rate), as
    torch's Dropout in training; x itself without keys. Each position draws its mask from its index in the
    sequence, which is not its place in x where `rules` (the program's logical-axis rules) split the sequence over
    context shards."""
    if keys is None:
        return x
    seq = x.shape[1]
    shards = context_shards(rules, *x.shape[:2])[1]
    index = jnp.asarray(sequence_index(seq, shards) if shards > 1 else np.arange(seq))

    def row_mask(key):
        key = jax.random.wrap_key_data(key)
        return jax.vmap(lambda i: jax.random.bernoulli(jax.random.fold_in(key, i), 1 - rate, x.shape[2:]))(
            index
        )

    keep = jax.vmap(row_mask)(fold_rows(keys, name))
    return jnp.where(keep, x / (1 - rate), 0).astype(x.dtype)


def _number(name: str) -> int:
    """A name as fold_in's data: its CRC-32, the same in every process and Python version."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF
