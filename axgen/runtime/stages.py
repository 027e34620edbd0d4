"""Pipeline stages: a decoder's scanned layers split over the mesh axes the rules give `layers` (the `stage` axis),
each device running its own stage's layers on one microbatch while the others run theirs on theirs (GPipe)."""

import jax
import jax.numpy as jnp

from axgen.runtime.sharding import constrain
from axgen.runtime.training import traced_accumulation_steps

# The stage buffer [stages, rows, seq, embed]: stage s's slot on the devices that hold stage s's layers.
STAGE_AXES = ("layers", "batch", "seq", "embed")


def pipeline(step_fn, x, stacked, positions, segment_ids, *, stages: int, microbatch: int, rules: dict):
    """`jax.lax.scan` of `step_fn(x, params, positions, segment_ids)` over the steps of `stacked` (params
    [steps, ...]), run as `stages` stages of steps / stages each, over x's rows [batch, seq, embed] in
    microbatches of `microbatch` rows per device.

    Microbatch m holds rows m, m + M, ... of the M (as runtime.gradients' passes take them: no tokens move). At
    iteration t of M + stages - 1, stage s runs microbatch t - s: stage 0 takes microbatch t from the batch, each
    stage's output moves on to the next stage (a collective permute over the stage axis), and the last stage's is
    microbatch t - stages + 1's result. In the first and last stages - 1 iterations some stages run on a slot
    that holds no microbatch and their result is dropped: the bubble, (stages - 1) / (M + stages - 1) of the
    time. Autodiff runs the iterations' backward in reverse, which is GPipe's schedule: every forward, then every
    backward, each microbatch's stage inputs kept for it (and what the layers' remat policy saves)."""
    count = traced_accumulation_steps(x.shape[0], microbatch, rules)  # runtime.gradients' passes
    mesh = jax.sharding.get_abstract_mesh()
    stage_axes = () if mesh.empty else tuple(a for a in rules.get("layers", ()) if mesh.shape.get(a, 1) > 1)

    def split(a):  # [rows, ...] -> [microbatches, rows / microbatches, ...]; row i to microbatch i % count
        return a.reshape(-1, count, *a.shape[1:]).swapaxes(0, 1)

    inputs, rows_in = split(x), (split(positions), split(segment_ids))
    staged = jax.tree.map(lambda w: w.reshape(stages, -1, *w.shape[1:]), stacked)

    def stage(x, params, positions, segment_ids):
        return jax.lax.scan(lambda x, p: (step_fn(x, p, positions, segment_ids), None), x, params)[0]

    run_stages = jax.vmap(stage, spmd_axis_name=stage_axes or None)

    def iteration(carry, t):
        state, rows, outputs = carry
        entering = jnp.minimum(t, count - 1)  # past the last microbatch, stage 0 runs a copy of it, dropped
        state = constrain(state.at[0].set(inputs[entering]), STAGE_AXES, rules)
        rows = tuple(r.at[0].set(new[entering]) for r, new in zip(rows, rows_in))
        out = constrain(run_stages(state, staged, *rows), STAGE_AXES, rules)
        finished = t - (stages - 1)
        slot = jnp.maximum(finished, 0)
        outputs = outputs.at[slot].set(jnp.where(finished >= 0, out[-1], outputs[slot]))
        # Each stage's output to the next stage: a shift along the stage axis.
        return (jnp.roll(out, 1, axis=0), tuple(jnp.roll(r, 1, axis=0) for r in rows), outputs), None

    # The slots start with zeros (finite through every layer) and the first microbatch's positions.
    state = jnp.zeros((stages, *inputs.shape[1:]), x.dtype)
    rows = tuple(jnp.broadcast_to(r[:1], (stages, *r.shape[1:])) for r in rows_in)
    carry = (state, rows, jnp.zeros_like(inputs))
    (_, _, outputs), _ = jax.lax.scan(iteration, carry, jnp.arange(count + stages - 1))
    return outputs.swapaxes(0, 1).reshape(x.shape)


def bubble(stages: int, microbatches: int) -> float:
    """The share of a GPipe step a stage idles: (stages - 1) / (microbatches + stages - 1)."""
    return (stages - 1) / (microbatches + stages - 1)
