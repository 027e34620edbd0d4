"""The next-token loss every program trains on, with a gradient written by hand so a step holds no more
logits-sized buffers than the logits themselves, and which targets it trains."""

import jax
import jax.numpy as jnp

from axgen.runtime.context import context_shards
from axgen.runtime.sharding import constrain, logical_to_mesh, shards


@jax.custom_vjp
def cross_entropy(logits, labels):
    """-log softmax(logits)[label] in float32 for logits [..., vocab] of any float dtype and int labels [...]: what
    optax.softmax_cross_entropy_with_integer_labels gives on the logits cast to float32.

    Under autodiff that form keeps the float32 copy of the logits for the backward pass, beside the logits
    themselves (7.9 GiB per chip at a 128k vocabulary on a TPU v5p slice). Here the backward pass keeps the logits
    as they came and the log-sum-exp of each row, and rebuilds softmax - one_hot from them in one fused pass.
    """
    return _losses(logits, labels)[0]


def _losses(logits, labels):
    x = logits.astype(jnp.float32)
    log_norm = jax.nn.logsumexp(x, axis=-1)
    # The label's logit by a one-hot sum rather than a gather: exact (the other terms are zeros), and XLA's
    # partitioner fails (a check in spmd_partitioner_util.cc, jax 0.12.0.1) on a gather along a vocabulary split
    # over devices inside pipeline stages (runtime.pipelined_loss) on a mesh of three axes or more.
    is_label = labels[..., None] == jnp.arange(x.shape[-1])
    return log_norm - jnp.sum(jnp.where(is_label, x, 0), axis=-1), log_norm


def _forward(logits, labels):
    losses, log_norm = _losses(logits, labels)
    return losses, (logits, labels, log_norm)


def _backward(residuals, grad):
    logits, labels, log_norm = residuals
    x = logits.astype(jnp.float32)
    is_label = jax.nn.one_hot(labels, x.shape[-1], dtype=jnp.float32)
    return _d_logits(x, is_label, log_norm[..., None], grad[..., None]).astype(logits.dtype), None


def _d_logits(logits, is_label, log_norm, grad):
    """The cross-entropy's gradient w.r.t. float32 logits: (softmax - one_hot) times each position's `grad`, for
    `is_label` (1 at each position's label) and log_norm and grad broadcast against the logits."""
    return (jnp.exp(logits - log_norm) - is_label) * grad


cross_entropy.defvjp(_forward, _backward)


def trained_targets(segment_ids, loss_mask):
    """[batch, seq] of a [batch, seq + 1] window: whether each target (the tokens after the first) is trained. It
    must continue the document of the token that predicts it (padding, segment 0, and the first token of the next
    document never count) and be one the dataset trains: loss_mask 1, which is every token of plain text and the
    assistant's turns of a conversation (`axgen data --chat`)."""
    return (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0) & (loss_mask[:, 1:] != 0)


def lm_head_cross_entropy(hidden, w, labels, *, chunk, rules, tied=False, soft_cap=None):
    """The output head and cross_entropy in one: -log softmax(cap(hidden @ w))[label] in float32 for hidden
    [batch, seq, embed], the head's weight w [embed, vocab] ([vocab, embed] when `tied` to the input embedding)
    and int labels [batch, seq]; `soft_cap` squashes each logit to soft_cap * tanh(logit / soft_cap) first (Gemma
    2's final cap). What cross_entropy gives on the head's logits, without the [batch, seq, vocab] logits: the
    positions go through the head `chunk` at a time (the last chunk padded), so a step holds one chunk's float32
    logits at a time, in the forward pass and again in the backward pass, which recomputes them from `hidden` and
    w and keeps only each target's log-sum-exp between the two (MaxText's vocabulary tiling, with a gradient
    written out instead of jax.vjp per chunk). `rules` are the program's logical-axis rules: each chunk's logits
    shard as ("batch", "seq", "vocab"), so on a mesh that shards the vocabulary the log-sum-exp reduces across its
    shards. The logits multiply in hidden's dtype and accumulate in float32.

    What crosses the mesh is what one pass over the whole logits would move: the weight is gathered whole along
    `embed` once before each pass (not once a chunk), and its gradient is reduced across the batch's devices once
    in all, not once a chunk (that moved 188 of 286 GiB a chip a step for Llama 3 8B on tpu-v5p-128;
    docs/maxtext.md). So the backward pass holds one gradient in float32 until its loop ends, the smaller: going
    through the positions a chunk at a time, each device's partial of the weight's gradient, [embed, vocab /
    vocab's shards] (2 GiB a chip at Llama 3's vocabulary); where a device has fewer positions than vocabulary
    columns, it goes through each device's columns in `chunks` runs instead, all its positions at a time (a run's
    logits as large as a chunk's), so each run's columns of the weight's gradient are whole when the run ends and
    go into the weight's shards then, and it holds the hidden states' gradient, [rows, seq, embed] a device.

    Where `rules` split the sequence over context shards (runtime/context.py), each shard's positions are rows of
    their own, so no chunk spans devices."""
    axes, count = context_shards(rules, *hidden.shape[:2])
    if count > 1:
        # [batch, seq, ...] -> [shards x batch, seq / shards, ...]: the shards lead the rows, as their devices do.
        def as_rows(x):
            x = x.reshape(x.shape[0], count, x.shape[1] // count, *x.shape[2:])
            return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])

        losses = _lm_head_cross_entropy(
            as_rows(hidden),
            w,
            as_rows(labels),
            chunk=chunk,
            rules={**rules, "batch": (*axes, *rules["batch"]), "seq": ()},
            tied=tied,
            soft_cap=soft_cap,
        )
        return jnp.swapaxes(losses.reshape(count, *labels.shape[:1], -1), 0, 1).reshape(labels.shape)
    return _lm_head_cross_entropy(hidden, w, labels, chunk=chunk, rules=rules, tied=tied, soft_cap=soft_cap)


def _lm_head_cross_entropy(hidden, w, labels, *, chunk, rules, tied, soft_cap):
    batch, seq, _ = hidden.shape
    chunks = -(-seq // chunk)
    pad = chunks * chunk - seq
    w_axes = ("vocab", "embed") if tied else ("embed", "vocab")
    whole_embed = tuple(None if axis == "embed" else axis for axis in w_axes)  # what each chunk's logits take
    logits_equation = "bce,ve->bcv" if tied else "bce,ev->bcv"
    vocab = w.shape[0 if tied else 1]
    mesh = jax.sharding.get_abstract_mesh()
    # How many parts the rows and the vocabulary split into.
    row_shards, vocab_shards = (
        (1, 1)
        if mesh.empty
        else (
            shards(logical_to_mesh(rules, (axis,), (size,), mesh.shape)[0], mesh.shape)
            for axis, size in (("batch", batch), ("vocab", vocab))
        )
    )

    def to_chunks(x):  # [batch, seq, ...] -> [chunks, batch, chunk, ...], padded at the end of seq
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(batch, chunks, chunk, *x.shape[2:]), 1, 0)

    def from_chunks(x):  # the inverse, padding dropped
        return jnp.moveaxis(x, 0, 1).reshape(batch, chunks * chunk, *x.shape[3:])[:, :seq]

    def capped_logits(equation, h, w, axes):
        logits = constrain(jnp.einsum(equation, h, w, preferred_element_type=jnp.float32), axes, rules)
        return logits if soft_cap is None else soft_cap * jnp.tanh(logits / soft_cap)

    def d_uncapped(logits, is_label, norm, g):
        """_d_logits w.r.t. the logits before the cap, from the capped ones."""
        d_logits = _d_logits(logits, is_label, norm, g)
        # d(cap * tanh(z / cap)) / dz = 1 - tanh^2
        return d_logits if soft_cap is None else d_logits * (1 - jnp.square(logits / soft_cap))

    def forward(hidden, w, labels):
        w = constrain(w, whole_embed, rules)

        def one_chunk(_, xs):
            h, y = xs
            return None, _losses(capped_logits(logits_equation, h, w, ("batch", "seq", "vocab")), y)

        _, (losses, log_norm) = jax.lax.scan(one_chunk, None, (to_chunks(hidden), to_chunks(labels)))
        return from_chunks(losses), (hidden, w, labels, log_norm)

    def backward(residuals, grad):
        # A loop over the positions sums each device's part of the weight's gradient until its last step, [embed,
        # vocab / vocab's shards] in float32; a loop over the vocabulary sums the hidden states' gradient, [rows /
        # row shards, seq, embed]. The smaller of the two is held.
        if batch // row_shards * seq < vocab // vocab_shards:
            return backward_by_vocabulary(residuals, grad)
        return backward_by_positions(residuals, grad)

    def backward_by_positions(residuals, grad):
        hidden, w, labels, log_norm = residuals
        w_whole = constrain(w, whole_embed, rules)

        def by_row_shard(x):  # [batch, ...] -> [row_shards, batch / row_shards, ...]
            return x.reshape(row_shards, -1, *x.shape[1:])

        def one_chunk(grad_w, xs):
            h, y, norm, g = xs
            logits = capped_logits(logits_equation, h, w_whole, ("batch", "seq", "vocab"))
            is_label = jax.nn.one_hot(y, logits.shape[-1], dtype=jnp.float32)
            d_logits = d_uncapped(logits, is_label, norm[..., None], g[..., None]).astype(h.dtype)
            d_h = jnp.einsum("bcv,ve->bce" if tied else "bcv,ev->bce", d_logits, w_whole)
            # Each device sums its own rows' part, [row_shards, *w.shape], reduced across them after the last chunk.
            d_w = jnp.einsum(
                "rbcv,rbce->rve" if tied else "rbce,rbcv->rev",
                *(
                    (by_row_shard(d_logits), by_row_shard(h))
                    if tied
                    else (by_row_shard(h), by_row_shard(d_logits))
                ),
                preferred_element_type=jnp.float32,
            )
            return constrain(grad_w + d_w, ("batch", *whole_embed), rules), d_h

        grad_w = constrain(jnp.zeros((row_shards, *w.shape), jnp.float32), ("batch", *whole_embed), rules)
        xs = (to_chunks(hidden), to_chunks(labels), log_norm, to_chunks(grad))
        grad_w, d_hidden = jax.lax.scan(one_chunk, grad_w, xs)
        return from_chunks(d_hidden), constrain(grad_w.sum(0), w_axes, rules).astype(w.dtype), None

    def backward_by_vocabulary(residuals, grad):
        hidden, w, labels, log_norm = residuals
        log_norm = from_chunks(log_norm)
        # Each device's vocabulary shard goes through `runs` runs of `width` columns, so a run's float32
        # logits for all of the device's positions are about one chunk's: [batch, seq, shards, width].
        per_shard = vocab // vocab_shards
        width = -(-per_shard // chunks)
        runs = -(-per_shard // width)
        slice_axis = 1 if tied else 2
        w_by_shard = constrain(w, whole_embed, rules).reshape(
            (vocab_shards, per_shard, -1) if tied else (w.shape[0], vocab_shards, per_shard)
        )
        run_axes = ("vocab", None, "embed") if tied else ("embed", "vocab", None)

        def one_run(carry, index):
            grad_w, d_hidden = carry
            # The last run ends at the shard's end and overlaps the one before it; the columns that one took
            # get no gradient here.
            start = jnp.minimum(index * width, per_shard - width)
            columns = start + jnp.arange(width)
            w_run = jax.lax.dynamic_slice_in_dim(w_by_shard, start, width, axis=slice_axis)
            logits = capped_logits(
                "bqe,sve->bqsv" if tied else "bqe,esv->bqsv", hidden, w_run, ("batch", "seq", "vocab", None)
            )
            ids = jnp.arange(vocab_shards)[:, None] * per_shard + columns
            d_logits = d_uncapped(
                logits, labels[..., None, None] == ids, log_norm[..., None, None], grad[..., None, None]
            )
            d_logits = jnp.where(columns >= index * width, d_logits, 0).astype(hidden.dtype)
            # Each vocabulary shard's part of the hidden states' gradient, summed across shards after the last run.
            d_hidden = d_hidden + constrain(
                jnp.einsum(
                    "bqsv,sve->sbqe" if tied else "bqsv,esv->sbqe",
                    d_logits,
                    w_run,
                    preferred_element_type=jnp.float32,
                ),
                ("vocab", "batch", "seq", None),
                rules,
            )
            # The run's columns of the weight's gradient are whole: summed across the rows' devices into the
            # weight's shards now, in the weight's dtype, as one dot over all the positions would.
            d_w = constrain(
                jnp.einsum("bqe,bqsv->sve" if tied else "bqe,bqsv->esv", hidden, d_logits), run_axes, rules
            )
            done = jax.lax.dynamic_slice_in_dim(grad_w, start, width, axis=slice_axis)
            return (
                jax.lax.dynamic_update_slice_in_dim(grad_w, done + d_w, start, axis=slice_axis),
                d_hidden,
            ), None

        grad_w = constrain(jnp.zeros(w_by_shard.shape, w.dtype), run_axes, rules)
        d_hidden = constrain(
            jnp.zeros((vocab_shards, *hidden.shape), jnp.float32), ("vocab", "batch", "seq", None), rules
        )
        (grad_w, d_hidden), _ = jax.lax.scan(one_run, (grad_w, d_hidden), jnp.arange(runs))
        # Summed in hidden's dtype, as one dot over the whole vocabulary would reduce across its shards.
        d_hidden = d_hidden.astype(hidden.dtype).sum(0)
        return d_hidden, constrain(grad_w.reshape(w.shape), w_axes, rules), None

    fused = jax.custom_vjp(lambda hidden, w, labels: forward(hidden, w, labels)[0])
    fused.defvjp(forward, backward)
    return fused(hidden, w, labels)
