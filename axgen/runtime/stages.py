"""Pipeline stages: a decoder's scanned layers split over the mesh axes the rules give `layers` (the `stage` axis),
each device running its own stage's layers on one microbatch while the others run theirs on theirs (GPipe)."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from axgen.runtime.sharding import constrain
from axgen.runtime.training import traced_accumulation_steps

# The stage buffer [stages, rows, seq, embed]: stage s's slot on the devices that hold stage s's layers.
STAGE_AXES = ("layers", "batch", "seq", "embed")
# A pass's microbatches [microbatches, rows, seq, embed], in and out: each device keeps its own rows of every one.
MICROBATCH_AXES = (None, "batch", "seq", "embed")


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
    backward.

    Each iteration is rematerialized whole: its backward recomputes the stage's layers from the stage input it
    kept, so a pass holds one stage input per iteration and one iteration's layer residuals (what the layers' remat
    policy saves), not every microbatch's every layer's."""
    # The pass's microbatches, its rows split among them as runtime.gradients splits a batch into passes.
    count = traced_accumulation_steps(x.shape[0], microbatch, rules)
    mesh = jax.sharding.get_abstract_mesh()
    stage_axes = () if mesh.empty else tuple(a for a in rules.get("layers", ()) if mesh.shape.get(a, 1) > 1)

    def split(a):  # [rows, ...] -> [microbatches, rows / microbatches, ...]; row i to microbatch i % count
        return a.reshape(-1, count, *a.shape[1:]).swapaxes(0, 1)

    inputs, rows_in = constrain(split(x), MICROBATCH_AXES, rules), (split(positions), split(segment_ids))

    staged = jax.tree.map(lambda w: w.reshape(stages, -1, *w.shape[1:]), stacked)  # stage s's layers: [s]

    def stage(x, params, positions, segment_ids):
        return jax.lax.scan(lambda x, p: (step_fn(x, p, positions, segment_ids), None), x, params)[0]

    if stage_axes:
        # Each device runs its own stage's slot on its own stage's layers: a shard_map manual over the stage axes
        # alone (the layers' own shardings over the other axes stay automatic), so the chip kernels run as
        # outside the stages.
        def own_stage(x, params, positions, segment_ids):
            params = jax.tree.map(lambda w: w[0], params)
            return stage(x[0], params, positions[0], segment_ids[0])[None]

        run = jax.shard_map(
            own_stage,
            mesh=mesh,
            in_specs=P(stage_axes),
            out_specs=P(stage_axes),
            axis_names=set(stage_axes),
            check_vma=False,
        )
    else:  # one device, or stages the mesh does not split: every stage's slot there
        run = jax.vmap(stage)
    # Each iteration rematerialized whole (nothing saved inside it): see the docstring.
    run_stages = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)

    def iteration(carry, entering):
        state, rows = carry
        state = constrain(state.at[0].set(entering[0]), STAGE_AXES, rules)
        rows = tuple(r.at[0].set(new) for r, new in zip(rows, entering[1:]))
        out = constrain(run_stages(state, staged, *rows), STAGE_AXES, rules)
        # Each stage's output to the next stage: a shift along the stage axis; the last stage's is a result.
        shifted = (jnp.roll(out, 1, axis=0), tuple(jnp.roll(r, 1, axis=0) for r in rows))
        return shifted, constrain(out[-1], STAGE_AXES[1:], rules)

    # Stage 0 takes microbatch t at iteration t; past the last, a copy of it, whose result is dropped. The scan
    # runs over the microbatches rather than indexing them: XLA gathered the whole pass onto every device to
    # index one (69 GB on Llama 3.1 405B).
    def with_bubble(a):
        return jnp.concatenate([a, jnp.broadcast_to(a[-1:], (stages - 1, *a.shape[1:]))])

    # The slots start with zeros (finite through every layer) and the first microbatch's positions.
    state = jnp.zeros((stages, *inputs.shape[1:]), x.dtype)
    rows = tuple(jnp.broadcast_to(r[:1], (stages, *r.shape[1:])) for r in rows_in)
    entering = jax.tree.map(with_bubble, (inputs, *rows_in))
    _, finished = jax.lax.scan(iteration, (state, rows), entering)
    outputs = constrain(finished[stages - 1 :], MICROBATCH_AXES, rules)
    return outputs.swapaxes(0, 1).reshape(x.shape)


def bubble(stages: int, microbatches: int) -> float:
    """The share of a GPipe step a stage idles: (stages - 1) / (microbatches + stages - 1)."""
    return (stages - 1) / (microbatches + stages - 1)
