"""Context parallelism: each sequence split over the mesh axes the program's rules give `seq` (the `context` axis),
so a 128k-token row is not one device's activations.

Causal attention's work is uneven along a sequence: the last query sees every key, the first sees one. Cut into c
contiguous shards, the last shard would do 2c - 1 times the first's work. So the sequence is cut into 2c chunks and
shard i holds chunks i and 2c - 1 - i (MaxText's `context_parallel_load_balance`, torchtitan's head-tail): each
shard attends over as many (query, key) pairs as any other. The model puts its inputs into that order once
(`to_context_order`) and its logits back (`from_context_order`; a training step's loss keeps the hidden states in
context order and moves the labels and losses instead); every op between them is per position except attention,
which gathers the keys and values over the context axes and masks by each position's index in the sequence
(`attention_over_context`). Outside a mesh, or with one context shard, all three are the identity.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from axgen.runtime.sharding import logical_to_mesh, mesh_axes, shards


def context_shards(rules: dict, batch: int, seq: int) -> tuple[tuple[str, ...], int]:
    """(the mesh axes that split a [batch, seq] activation's sequence, how many shards they make) under the mesh
    being traced for: ((), 1) outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), 1
    entry = logical_to_mesh(rules, ("batch", "seq"), (batch, seq), mesh.shape)[1]
    return mesh_axes(entry), shards(entry, mesh.shape)


def split_context(rules: dict, batch: int, seq: int) -> tuple[tuple[str, ...], int, bool]:
    """(the context axes, how many shards they make, whether an enclosing shard_map made them manual): inside
    runtime.pipelined_loss's stages each device holds its own context shard of every sequence as a whole array
    [batch, seq / shards, ...], so the reorderings and attention's gathers run on it directly; elsewhere
    `context_shards`, and ((), 1, False) outside a mesh."""
    axes, count = context_shards(rules, batch, seq)
    mesh = jax.sharding.get_abstract_mesh()
    if count > 1 or mesh.empty:
        return axes, count, False
    manual = tuple(a for a in rules.get("seq", ()) if a in mesh.manual_axes and mesh.shape[a] > 1)
    return manual, math.prod(mesh.shape[a] for a in manual), bool(manual)


def to_context_order(x, rules: dict):
    """x [batch, seq, ...] in sequence order -> the same positions in context order: shard i of c holds the
    sequence's chunks i and 2c - 1 - i of 2c. Two collective permutes of half a shard each."""
    return _reordered(x, rules, to_context=True)


def from_context_order(x, rules: dict):
    """The inverse of to_context_order: x [batch, seq, ...] in context order -> in sequence order."""
    return _reordered(x, rules, to_context=False)


def sequence_index(seq: int, shards: int) -> np.ndarray:
    """[seq]: the position in the sequence of each position in context order, for `shards` context shards."""
    chunks = np.arange(seq).reshape(2 * shards, -1)
    return np.stack([chunks[:shards], chunks[shards:][::-1]], axis=1).reshape(-1)


def _reordered(x, rules, to_context):
    axes, count, manual = split_context(rules, x.shape[0], x.shape[1])
    if count == 1:
        return x
    mesh = jax.sharding.get_abstract_mesh()
    spec = logical_to_mesh(rules, ("batch", "seq", *[None] * (x.ndim - 2)), x.shape, mesh.shape)

    # In sequence order shard j holds chunks 2j and 2j + 1; in context order, chunks j and 2c - 1 - j. Of the two
    # chunks a shard holds in either order, one is even and one odd, so the even chunks move by one permutation of
    # the shards and the odd ones by another.
    def home(chunk):  # the shard that holds `chunk` in context order
        return chunk if chunk < count else 2 * count - 1 - chunk

    def even_chunk(shard):  # in context order
        return shard if shard % 2 == 0 else 2 * count - 1 - shard

    def per_device(x):
        shard = jax.lax.axis_index(axes)
        first, second = jnp.split(x, 2, axis=1)
        if to_context:
            evens = jax.lax.ppermute(first, axes, [(j, home(2 * j)) for j in range(count)])
            odds = jax.lax.ppermute(second, axes, [(j, home(2 * j + 1)) for j in range(count)])
            front_is_even = shard % 2 == 0
            return jnp.concatenate(
                [jnp.where(front_is_even, evens, odds), jnp.where(front_is_even, odds, evens)], axis=1
            )
        front_is_even = shard % 2 == 0
        even, odd = jnp.where(front_is_even, first, second), jnp.where(front_is_even, second, first)
        evens = jax.lax.ppermute(even, axes, [(j, even_chunk(j) // 2) for j in range(count)])
        odds = jax.lax.ppermute(odd, axes, [(j, (2 * count - 1 - even_chunk(j)) // 2) for j in range(count)])
        return jnp.concatenate([evens, odds], axis=1)

    if manual:  # x is this device's shard already
        return per_device(x)
    return jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(x)


def gathered_in_sequence_order(x, axes, count: int):
    """Inside a shard_map over the context `axes`: every shard's x [batch, seq / count, ...] gathered into the whole
    [batch, seq, ...] in sequence order."""
    gathered = jax.lax.all_gather(x, axes, axis=1, tiled=True)
    # Shard i's front chunk is chunk i of the sequence, its back chunk 2 * count - 1 - i: the fronts in shard order,
    # then the backs in reverse. Slices and a reverse, not a gather, so the gradient is their transpose and no
    # scatter (which XLA pads).
    chunks = gathered.reshape(x.shape[0], count, 2, -1, *x.shape[2:])
    in_order = jnp.concatenate([chunks[:, :, 0], jnp.flip(chunks[:, :, 1], axis=1)], axis=1)
    return in_order.reshape(gathered.shape)


def attention_over_context(attend, q, k, v, segment_ids, rules: dict, sinks=None):
    """Attention of a sequence in context order: `attend(q, k, v, q_segments, kv_segments, q_index, sinks)` runs on
    each device with its own queries [batch, seq / c, heads, head_dim], their indices in the sequence [seq / c],
    and every key and value of its rows gathered over the context shards in sequence order. Gathering costs each
    device the whole sequence's keys and values, which GQA keeps small (Llama 3 8B at 128k tokens: 0.5 GiB a layer
    in bf16); a ring would hold two shards' worth but pass c - 1 times. Batch rows and heads split as `rules` split
    the activations."""
    batch, seq = q.shape[:2]
    axes, count, manual = split_context(rules, batch, seq)

    def per_device(q, k, v, segment_ids, index, *sinks):
        k, v, kv_segments = (gathered_in_sequence_order(x, axes, count) for x in (k, v, segment_ids))
        return attend(q, k, v, segment_ids, kv_segments, index, *sinks)

    with_sinks = () if sinks is None else (sinks,)
    mesh = jax.sharding.get_abstract_mesh()
    q_spec, kv_spec = attention_specs(rules, q.shape, k.shape)
    rows = P(q_spec[0], q_spec[1])
    sinks_spec = () if sinks is None else (P(q_spec[2]),)
    if manual:  # inside the 1F1B stages, q, k and v are this device's context shard already
        index = jnp.asarray(sequence_index(seq * count, count), jnp.int32).reshape(count, seq)
        # Manual over the other axes too, as below: cuDNN's partitioning rule fails on a partly manual mesh.
        return jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, rows, P(), *sinks_spec),
            out_specs=q_spec,
            axis_names=set(mesh.axis_names) - set(mesh.manual_axes),
            check_vma=False,
        )(q, k, v, segment_ids, index[jax.lax.axis_index(axes)], *with_sinks)
    index = jnp.asarray(sequence_index(seq, count), jnp.int32)
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, rows, P(q_spec[1]), *sinks_spec),
        out_specs=q_spec,
        check_vma=False,
    )(q, k, v, segment_ids, index, *with_sinks)


def attention_specs(rules: dict, q_shape, kv_shape) -> tuple[P, P]:
    """The PartitionSpecs of q [batch, seq, heads, head_dim] and of k and v [batch, seq, kv_heads, head_dim] on the
    mesh being traced for, as `rules` split them; the heads whole where the query heads split and their kv heads
    cannot (a device's query heads would not meet their kv heads)."""
    mesh = jax.sharding.get_abstract_mesh()
    q_spec = logical_to_mesh(rules, ("batch", "seq", "heads", "head_dim"), q_shape, mesh.shape)
    kv_spec = logical_to_mesh(rules, ("batch", "seq", "kv_heads", "head_dim"), kv_shape, mesh.shape)
    if q_spec[2] != kv_spec[2] and kv_shape[2] > 1:
        return P(q_spec[0], q_spec[1], None, None), P(kv_spec[0], kv_spec[1], None, None)
    return q_spec, kv_spec
