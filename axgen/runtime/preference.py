"""Preference losses on pairs (`axgen data --pairs`: a window holds a prompt with its chosen completion as
segment 1 and with its rejected one as segment 2), with the metrics TRL's trainers log under the same names.
"""

import jax
import jax.numpy as jnp


def completion_logps(losses, trained, segment_ids):
    """Each row's completions' log-probabilities, summed over their trained targets, [batch, 2] (chosen,
    rejected), and how many targets each sums, from the targets' cross-entropies `losses` and whether each
    trains `trained` ([batch, seq], as target_losses gives them) and the window's `segment_ids` [batch, seq + 1].
    """
    segments = segment_ids[:, 1:]  # each target's
    picked = jnp.stack([trained & (segments == segment) for segment in (1, 2)], axis=1)
    return -jnp.sum(losses[:, None] * picked, axis=-1), jnp.sum(picked, axis=-1)


def dpo(logps, reference, beta: float):
    """DPO's sigmoid loss of each pair, -log sigmoid(beta * ((chosen - ref chosen) - (rejected - ref rejected))),
    [batch], and the batch's metrics as TRL's DPOTrainer logs them, from the policy's and the reference's summed
    log-probabilities [batch, 2]."""
    rewards = beta * (logps - reference)
    return -jax.nn.log_sigmoid(rewards[:, 0] - rewards[:, 1]), _metrics(rewards, logps)


def simpo(logps, counts, beta: float, gamma: float):
    """SimPO's loss of each pair, -log sigmoid(beta * (mean chosen - mean rejected) - gamma), the means over each
    completion's tokens, [batch], and the batch's metrics as TRL's CPOTrainer logs them (loss_type "simpo").
    """
    means = logps / jnp.maximum(counts, 1)
    rewards = beta * means
    return -jax.nn.log_sigmoid(rewards[:, 0] - rewards[:, 1] - gamma), _metrics(rewards, means)


def _metrics(rewards, logps) -> dict:
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    return {
        "rewards/chosen": jnp.mean(chosen),
        "rewards/rejected": jnp.mean(rejected),
        "rewards/accuracies": jnp.mean((chosen > rejected).astype(jnp.float32)),
        "rewards/margins": jnp.mean(chosen - rejected),
        "logps/chosen": jnp.mean(logps[:, 0]),
        "logps/rejected": jnp.mean(logps[:, 1]),
    }
