"""Pipeline stages: a decoder's scanned layers split over the mesh axes the rules give `layers` (the `stage` axis),
each device running its own stage's layers on one microbatch while the others run theirs on theirs: GPipe, or a
circular schedule whose microbatches go round the stages several times."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from axgen.runtime.sharding import constrain
from axgen.runtime.training import traced_accumulation_steps

# The stages' slots [stages, rows, seq, embed]: stage s's on the devices that hold stage s's layers.
STAGE_AXES = ("layers", "batch", "seq", "embed")
# The microbatches waiting for stage 0 [stages, waiting, rows, seq, embed]: stage 0's devices' row is the queue.
QUEUE_AXES = ("layers", None, "batch", "seq", "embed")
# A pass's microbatches [microbatches, rows, seq, embed], in and out: each device keeps its own rows of every one.
MICROBATCH_AXES = (None, "batch", "seq", "embed")


def pipeline(
    step_fn, x, stacked, positions, segment_ids, *, stages: int, repeats: int, microbatch: int, rules: dict
):
    """`jax.lax.scan` of `step_fn(x, params, positions, segment_ids)` over the steps of `stacked` (params
    [steps, ...]), run in `stages` stages over x's rows [batch, seq, embed] in microbatches of `microbatch` rows
    per device. The steps are cut into stages x repeats runs of steps / (stages x repeats); stage s holds runs s,
    s + stages, s + 2 stages, ... and a microbatch goes round the stages `repeats` times, taking run r x stages + s
    at stage s in round r (1: GPipe, each stage one run of consecutive steps; more: the circular schedule, whose
    bubble is about `repeats` times smaller).

    Microbatch m holds rows m, m + M, ... of the M (as runtime.gradients' passes take them: no tokens move). Stage 0
    takes microbatch t at iteration t < M; each iteration every stage runs its slot and hands the result to the
    next stage (a collective permute over the stage axis). Under the circular schedule the last stage's result goes
    on to stage 0's devices, where it waits in a queue of M - stages slots (none for fewer microbatches than
    stages) until every microbatch has started the round: a microbatch is back at stage 0 P = max(M, stages)
    iterations after it entered it, and at iteration t stage s runs round (t - s) // P of its slot. The queue costs
    M - stages microbatches' activations a device and no traffic. A slot that holds no microbatch (in the first and
    last stages - 1 iterations, and P - M of each later round's) is run and its result dropped: the bubble
    (`bubble`). Autodiff runs the iterations' backward in reverse: every forward, then every backward.

    Each iteration is rematerialized whole: its backward recomputes the stage's layers from the stage input it
    kept, so a pass holds one stage input per iteration and one iteration's layer residuals (what the layers' remat
    policy saves), not every microbatch's every layer's."""
    # The pass's microbatches, its rows split among them as runtime.gradients splits a batch into passes.
    count = traced_accumulation_steps(x.shape[0], microbatch, rules)
    period, iterations = schedule(stages, count, repeats)
    waiting = period - stages if repeats > 1 else 0
    mesh = jax.sharding.get_abstract_mesh()
    stage_axes = () if mesh.empty else tuple(a for a in rules.get("layers", ()) if mesh.shape.get(a, 1) > 1)

    def split(a):  # [rows, ...] -> [microbatches, rows / microbatches, ...]; row i to microbatch i % count
        return a.reshape(-1, count, *a.shape[1:]).swapaxes(0, 1)

    inputs = (constrain(split(x), MICROBATCH_AXES, rules), split(positions), split(segment_ids))

    # Stage s's runs [stages, repeats, steps per run, ...]: run r x stages + s of the steps at [s, r].
    staged = jax.tree.map(lambda w: w.reshape(repeats, stages, -1, *w.shape[1:]).swapaxes(0, 1), stacked)
    # Which of its runs each stage takes at each iteration (a slot outside a round's microbatches: the nearest).
    runs = np.clip((np.arange(iterations)[:, None] - np.arange(stages)) // period, 0, repeats - 1)

    def stage(x, run, params, positions, segment_ids):
        params = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, run, keepdims=False), params)
        return jax.lax.scan(lambda x, p: (step_fn(x, p, positions, segment_ids), None), x, params)[0]

    if stage_axes:
        # Each device runs its own stage's slot on its own stage's layers: a shard_map manual over the stage axes
        # alone (the layers' own shardings over the other axes stay automatic), so the chip kernels run as
        # outside the stages.
        def own_stage(x, run, params, positions, segment_ids):
            params = jax.tree.map(lambda w: w[0], params)
            return stage(x[0], run[0], params, positions[0], segment_ids[0])[None]

        run_all = jax.shard_map(
            own_stage,
            mesh=mesh,
            in_specs=P(stage_axes),
            out_specs=P(stage_axes),
            axis_names=set(stage_axes),
            check_vma=False,
        )
    else:  # one device, or stages the mesh does not split: every stage's slot there
        run_all = jax.vmap(stage)
    # Each iteration rematerialized whole (nothing saved inside it): see the docstring.
    run_stages = jax.checkpoint(run_all, policy=jax.checkpoint_policies.nothing_saveable)

    def on_stage_0(a):  # [stages, 1, ...]: true in stage 0's slot; a select, so no slot leaves its devices
        return (np.arange(stages) == 0).reshape(-1, *(1,) * (a.ndim - 1))

    def iteration(carry, xs):
        (slots, queue), (run, entering) = carry, xs
        # Stage 0 takes a new microbatch (or zeros, finite through every layer, as the pipeline drains).
        if entering is not None:
            slots = tuple(s.at[0].set(new) for s, new in zip(slots, entering))
        out = run_stages(constrain(slots[0], STAGE_AXES, rules), run, staged, *slots[1:])
        out = constrain(out, STAGE_AXES, rules)
        # Each stage's result to the next stage; the last stage's to stage 0's devices.
        moved = tuple(jnp.roll(s, 1, axis=0) for s in (out, *slots[1:]))
        if waiting:  # there it joins the queue, and stage 0 takes the queue's first
            first = tuple(q[:, 0] for q in queue)
            queue = tuple(
                constrain(jnp.concatenate([q[:, 1:], m[:, None]], axis=1), QUEUE_AXES[: q.ndim], rules)
                for q, m in zip(queue, moved)
            )
            moved = tuple(jnp.where(on_stage_0(m), f, m) for f, m in zip(first, moved))
        return (moved, queue), constrain(out[-1], STAGE_AXES[1:], rules)

    # The slots start with zeros (finite through every layer) and the first microbatch's positions. The scan runs
    # over the microbatches rather than indexing them: XLA gathered the whole pass onto every device to index one
    # (69 GB on Llama 3.1 405B).
    def filled(a, *shape):
        return jnp.broadcast_to(a, (*shape, *a.shape))

    first_rows = tuple(a[0] for a in inputs[1:])
    slots = (jnp.zeros((stages, *inputs[0].shape[1:]), x.dtype), *(filled(a, stages) for a in first_rows))
    queue = (jnp.zeros((stages, waiting, *inputs[0].shape[1:]), x.dtype),)
    queue += tuple(filled(a, stages, waiting) for a in first_rows)
    carry, ys = jax.lax.scan(iteration, (slots, queue), (runs[:count], inputs))
    finished = [ys]
    last_entry = (repeats - 1) * period + count  # the iteration after stage 0 takes the last round's last
    if repeats > 1:  # the later rounds: the microbatches go round, and nothing enters
        carry, ys = jax.lax.scan(lambda c, run: iteration(c, (run, None)), carry, runs[count:last_entry])
        finished.append(ys)
    # The last stages - 1 iterations drain the pipeline: zeros enter.
    drain = (jnp.zeros_like(inputs[0][0]), *first_rows)
    _, ys = jax.lax.scan(lambda c, run: iteration(c, (run, drain)), carry, runs[last_entry:])
    outputs = constrain(jnp.concatenate([*finished, ys])[iterations - count :], MICROBATCH_AXES, rules)
    return outputs.swapaxes(0, 1).reshape(x.shape)


def schedule(stages: int, microbatches: int, repeats: int) -> tuple[int, int]:
    """(P, the iterations of a pass): a microbatch is back at stage 0 P = max(microbatches, stages) iterations after
    it entered it, so the last round starts (repeats - 1) P iterations after the first, and the last microbatch
    leaves the last stage stages - 1 iterations after it entered the first."""
    period = max(microbatches, stages)
    return period, (repeats - 1) * period + microbatches + stages - 1


def bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of a pass a stage idles, of its iterations those without a microbatch: (stages - 1) /
    (repeats x microbatches + stages - 1) where there are at least as many microbatches as stages (GPipe always).
    """
    iterations = schedule(stages, microbatches, repeats)[1]
    return (iterations - repeats * microbatches) / iterations
