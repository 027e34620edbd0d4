"""Causal attention in a packed sequence, by the kernel the lowering chose for each attention node: the Pallas splash
kernel (TPU), cuDNN's fused attention (H100), jax.nn.dot_product_attention's XLA path, or plain XLA ops (every chip;
the only path for a soft-cap or sinks where the kernel lacks them). What each takes is its entry in
runtime/kernels.py. A program passes each node's kernel and every option; everything here is shared.

Shapes: q [batch, seq, heads, head_dim], k [batch, seq, kv_heads, head_dim], v [batch, seq, kv_heads, v_head_dim]
(v_head_dim may differ from q/k's, as DeepSeek's MLA has it), segment_ids [batch, seq] (which document each
position belongs to: a query sees keys of its own document only). The output has v's head dim.
"""

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axgen.runtime.context import (
    attention_over_context,
    context_shards,
    gathered_in_sequence_order,
    split_context,
    sequence_index,
)
from axgen.runtime.kernels import ATTENTION_KERNELS
from axgen.runtime.sharding import logical_to_mesh, shards


def causal_attention(
    q,
    k,
    v,
    segment_ids,
    *,
    implementation,
    block,
    rules,
    window,
    softcap,
    scale,
    sinks,
    context=None,
    interpret=False,
):
    """Causal attention by the kernel `implementation` names in runtime/kernels.py's ATTENTION_KERNELS, which the
    program's lowering chose: "xla" (jax.nn.dot_product_attention), "xla_ops" (plain XLA ops), "splash" (Pallas,
    in blocks of `block`) or "cudnn". `rules` (the program's LOGICAL_AXIS_RULES) split the chip kernels' work over
    the devices. With a `window`, each query sees only the last `window` positions, itself included; a `softcap`
    squashes each score to softcap * tanh(score / softcap) before the softmax; `sinks` [heads] is a learned logit
    per head that joins every query's softmax without a value (gpt-oss); the scores are q.k * `scale` (None:
    head_dim**-0.5). Each is None where the node has none. A kernel whose entry takes one head dim gets v
    zero-padded to q/k's, its output sliced back. `context="all_gather"`: the sequence is in context order
    (runtime/context.py) wherever `rules` split it over devices, and each device attends with its own queries to
    the keys and values gathered over those devices. `interpret=True` (tests) runs splash in its interpreter, on
    CPU."""
    kernel = ATTENTION_KERNELS[implementation]
    options = {"window": window, "softcap": softcap, "scale": scale, "sinks": sinks}
    refused = kernel.refuses(frozenset(n for n, value in options.items() if value is not None), q.dtype.name)
    if refused:
        raise ValueError(f"attention by {implementation}: {refused}")
    by_kernel = _by_kernel
    if context is not None and split_context(rules, *q.shape[:2])[1] > 1:
        by_kernel = _over_context
    if not kernel.v_head_dim and v.shape[-1] != q.shape[-1]:
        padded = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - v.shape[-1])))
        return by_kernel(q, k, padded, segment_ids, implementation, block, rules, interpret, options)[
            ..., : v.shape[-1]
        ]
    return by_kernel(q, k, v, segment_ids, implementation, block, rules, interpret, options)


def _over_context(q, k, v, segment_ids, implementation, block, rules, interpret, options):
    """A sequence split over context shards: each device's queries against the gathered keys, the mask built from
    the positions' indices in the sequence (a dense [queries, keys] one on XLA's paths and cuDNN's; splash reads
    the queries' indices itself)."""
    if implementation == "splash":
        return splash_attention(
            q, k, v, segment_ids, block=block, rules=rules, interpret=interpret, context=True, **options
        )
    window, softcap, scale, sinks = (options[name] for name in ("window", "softcap", "scale", "sinks"))

    def attend(q, k, v, q_segments, kv_segments, q_index, *sinks):
        visible = visible_keys(q_segments, kv_segments, q_index, jnp.arange(k.shape[1]), window)
        if implementation == "xla_ops":
            return _attention_by_mask(
                q, k, v, visible, softcap=softcap, scale=scale, sinks=sinks[0] if sinks else None
            )
        return jax.nn.dot_product_attention(q, k, v, mask=visible, scale=scale, implementation=implementation)

    return attention_over_context(attend, q, k, v, segment_ids, rules, sinks)


def _by_kernel(q, k, v, segment_ids, implementation, block, rules, interpret, options):
    if implementation == "splash":
        return splash_attention(
            q, k, v, segment_ids, block=block, rules=rules, interpret=interpret, **options
        )
    if implementation == "xla_ops":
        return attention_in_xla_ops(q, k, v, segment_ids, **options)
    window, scale = options["window"], options["scale"]
    return _dot_product_attention(
        q, k, v, segment_ids, implementation, rules=rules, window=window, scale=scale
    )


def _dot_product_attention(q, k, v, segment_ids, implementation, *, rules, window, scale):
    """jax.nn.dot_product_attention by its `implementation`, "xla" or "cudnn", with a dense document mask."""
    attend = functools.partial(
        jax.nn.dot_product_attention,
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        scale=scale,
        implementation=implementation,
    )
    mesh = jax.sharding.get_abstract_mesh()
    if implementation != "cudnn" or not mesh.manual_axes:
        return attend(q, k, v, mask=document_mask(segment_ids))
    # Inside runtime.gradients' shard_map, manual over the replicas, cuDNN's custom partitioning is handed a
    # GSPMDSharding it cannot read (jax 0.12: "'GSPMDSharding' object has no attribute 'spec'"), so each device runs
    # the kernel on its own batch rows and heads, split as `rules` split the activations, as splash's does.
    q_spec = logical_to_mesh(rules, ("batch", "seq", "heads", "head_dim"), q.shape, mesh.shape)
    kv_spec = logical_to_mesh(rules, ("batch", "seq", "kv_heads", "head_dim"), k.shape, mesh.shape)
    return jax.shard_map(
        lambda q, k, v, segment_ids: attend(q, k, v, mask=document_mask(segment_ids)),
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[0], q_spec[1])),
        out_specs=q_spec,
        check_vma=False,
    )(q, k, v, segment_ids)


def document_mask(segment_ids):
    """[batch, 1, seq, seq]: whether each query (row) and key (column) lie in the same document."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def visible_keys(q_segments, kv_segments, q_index, kv_index, window):
    """[batch, 1, queries, keys]: which keys each query sees: those of its own document (by the segment ids
    [batch, queries] and [batch, keys]) at its own position or before (by their indices in the sequence
    [queries] and [keys]), and with a `window`, only the last `window` of those."""
    earlier = kv_index[None, :] <= q_index[:, None]
    if window is not None:
        earlier = earlier & (kv_index[None, :] > q_index[:, None] - window)
    return (q_segments[:, :, None] == kv_segments[:, None, :])[:, None] & earlier


def soft_cap(x, cap):
    """cap * tanh(x / cap): x squashed smoothly into (-cap, cap), as Gemma 2 caps attention scores and logits."""
    return cap * jnp.tanh(x / cap)


def attention_in_xla_ops(q, k, v, segment_ids, *, window, softcap, scale, sinks):
    """Attention in plain XLA ops, every option included: the soft-capped or sunk attention that
    jax.nn.dot_product_attention cannot run."""
    index = jnp.arange(q.shape[1])
    visible = visible_keys(segment_ids, segment_ids, index, index, window)
    return _attention_by_mask(q, k, v, visible, softcap=softcap, scale=scale, sinks=sinks)


def _attention_by_mask(q, k, v, visible, *, softcap, scale, sinks):
    """attention_in_xla_ops with the keys each query sees given: `visible` [batch, 1, queries, keys]."""
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    scale = head_dim**-0.5 if scale is None else scale
    scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped * scale, k).astype(jnp.float32)
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    visible = visible[:, :, None]  # [batch, kv_heads=1, group=1, queries, keys]
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the sink is one more column of every query's scores; its probability is dropped with it
        sink = sinks.astype(jnp.float32).reshape(1, kv_heads, heads // kv_heads, 1, 1)
        sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v)
    return out.reshape(batch, seq, heads, v.shape[-1])


def splash_attention(
    q, k, v, segment_ids, *, block, rules, window, softcap, scale, sinks, interpret, context=False
):
    """The Pallas splash kernel, which skips the blocks the causal mask (and a window) hides, masks across documents
    by the segment ids and groups query heads over kv heads itself; q/k and v may have different head dims. Each
    device runs it on its own batch rows and heads, split as `rules` split the activations. `block`: the query and
    key/value block length (at most the sequence). With `context`, a sequence the rules split over context shards
    is in context order (runtime/context.py): each device runs its own queries against every key and value of its
    rows, gathered in sequence order, and the kernel's mask reads each query's index in the sequence (its
    `q_sequence`, split over the shards as the queries are: q_seq_shards), as MaxText's load-balanced mask does.
    `interpret=True` runs the kernel's interpreter, so it can be checked on CPU."""
    batch, seq, heads, head_dim = q.shape
    axes, count = context_shards(rules, batch, seq) if context else ((), 1)
    block = min(block, seq)
    block_sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    if window is None:
        one_head = splash_mask.CausalMask(shape=(seq, seq))
    else:
        one_head = splash_mask.LocalMask(shape=(seq, seq), window_size=(window - 1, 0), offset=0)
    if count > 1:
        one_head = copy.copy(one_head)
        one_head.q_sequence = sequence_index(seq, count).astype(np.int32)
    mask = splash_mask.MultiHeadMask([one_head] * heads)
    mesh = jax.sharding.get_abstract_mesh()
    q_spec = (
        P()
        if mesh.empty
        else logical_to_mesh(rules, ("batch", "seq", "heads", "head_dim"), q.shape, mesh.shape)
    )
    kv_spec = (
        P()
        if mesh.empty
        else logical_to_mesh(rules, ("batch", "seq", "kv_heads", "head_dim"), k.shape, mesh.shape)
    )
    head_shards = 1 if mesh.empty else shards(q_spec[2], mesh.shape)
    kernel = splash.make_splash_mha(
        mask,
        block_sizes=block_sizes,
        attn_logits_soft_cap=softcap,
        head_shards=head_shards,
        q_seq_shards=count,
        interpret=interpret,
    )
    scale = head_dim**-0.5 if scale is None else scale

    def per_device(kernel, q, k, v, segment_ids, *sinks):
        # The kernel takes one sequence as [heads, seq, head_dim] and does not scale the scores itself; the sinks
        # [heads] are the same for every row of the batch.
        kv_segments = segment_ids
        if count > 1:
            k, v, kv_segments = (gathered_in_sequence_order(x, axes, count) for x in (k, v, segment_ids))
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q * scale, k, v))
        options = {"sinks": sinks[0]} if sinks else {}
        one_row = lambda q, k, v, q_ids, kv_ids: kernel(
            q, k, v, segment_ids=splash.SegmentIds(q=q_ids, kv=kv_ids), **options
        )
        return jnp.swapaxes(jax.vmap(one_row)(q, k, v, segment_ids, kv_segments), 1, 2)

    with_sinks = () if sinks is None else (sinks,)
    if mesh.empty:
        return per_device(kernel, q, k, v, segment_ids, *with_sinks)
    # The kernel's mask follows the heads' split; it reads the split off a sharding, which a shard_map's manual
    # axes (runtime.gradients' replicas) have none of.
    heads_split = NamedSharding(
        jax.sharding.AbstractMesh(mesh.axis_sizes, mesh.axis_names), P(q_spec[2], q_spec[1])
    )
    sinks_spec = () if sinks is None else (P(q_spec[2]),)
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(
            kernel.manual_sharding_spec(heads_split),
            q_spec,
            kv_spec,
            kv_spec,
            P(q_spec[0], q_spec[1]),
            *sinks_spec,
        ),
        out_specs=q_spec,
        check_vma=False,
    )(kernel, q, k, v, segment_ids, *with_sinks)
