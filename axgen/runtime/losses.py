"""The next-token loss every program trains on, with a gradient written by hand so a step holds no more
logits-sized buffers than the logits themselves, and which targets it trains."""

import jax
import jax.numpy as jnp


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
    return log_norm - jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0], log_norm


def _forward(logits, labels):
    losses, log_norm = _losses(logits, labels)
    return losses, (logits, labels, log_norm)


def _backward(residuals, grad):
    logits, labels, log_norm = residuals
    probs = jnp.exp(logits.astype(jnp.float32) - log_norm[..., None])
    one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
    return ((probs - one_hot) * grad[..., None]).astype(logits.dtype), None


cross_entropy.defvjp(_forward, _backward)


def trained_targets(segment_ids, loss_mask):
    """[batch, seq] of a [batch, seq + 1] window: whether each target (the tokens after the first) is trained. It
    must continue the document of the token that predicts it (padding, segment 0, and the first token of the next
    document never count) and be one the dataset trains: loss_mask 1, which is every token of plain text and the
    assistant's turns of a conversation (`axgen data --chat`)."""
    return (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0) & (loss_mask[:, 1:] != 0)
