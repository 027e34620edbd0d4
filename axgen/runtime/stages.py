"""Pipeline stages: a decoder's scanned layers split over the mesh axes the rules give `layers` (the `stage` axis),
each device running its own stage's layers on one microbatch while the others run theirs on theirs: GPipe, or a
circular schedule whose microbatches go round the stages several times."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from axgen.runtime.params import is_param_spec
from axgen.runtime.sharding import constrain, logical_to_mesh, mesh_axes
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


def pipelined_loss(
    first_fn,
    step_fn,
    last_fn,
    params,
    stacked,
    inputs,
    *,
    stages: int,
    microbatch: int,
    rules: dict,
    specs=None,
):
    """The sum over a pass's targets of their losses times `inputs["weights"]`, each microbatch's backward run
    through the stages as soon as its forward has left the last one (1F1B): no stage keeps more than 2 stages - 1
    microbatches' residuals, and nothing is recomputed that the layers' remat policy saves.

    `params` are the params outside the stack (the embedding, the final norm, the head), whole on every stage;
    `stacked` [steps, ...] the layers', split into `stages` runs of consecutive steps as in `pipeline`. `inputs`
    holds [rows, seq] arrays, among them "positions", "segment_ids" and "weights", cut into microbatches of
    `microbatch` rows a device as `pipeline` cuts them. For each microbatch `mb` (a dict of its rows of each input):
    `first_fn(params, mb)` -> the first step's input x [rows, seq, embed]; `step_fn(x, p, positions, segment_ids)`
    -> x, one step of the stack; `last_fn(params, x, mb)` -> the targets' losses [rows, seq] in float32.

    Where the steps do not divide into the stages, the stages hold ceil(steps / stages) steps each but the last
    ones, which hold none and skip them (Llama 3.1 405B's 126 layers on 64 stages: the last runs the head alone).
    The rules then split the stack's weights over the stage axis on another dimension (`specs`, the stack's
    ParamSpecs, say which), and each stage gets its own steps in an all-to-all over the stage axis once a pass,
    and sends their gradient back the same way.

    The schedule is lockstep: at tick t stage s runs the forward of microbatch t - s and the backward of microbatch
    t - 2 (stages - 1) + s, so the last stage runs a microbatch's loss and its backward in the tick of its forward,
    and each stage hands its output on to the next stage and its input's gradient back to the one before (two
    collective permutes over the stage axis a tick). The first stages - 1 ticks run forwards only, the last
    stages - 1 backwards only: a stage idles (stages - 1) / (microbatches + stages - 1) of the pass, GPipe's bubble.
    Stage s keeps a microbatch's residuals (what `jax.vjp` of its steps holds, less the params) for 2 (stages - 1 -
    s) + 1 ticks, in a ring of 2 stages - 1 slots. So the gradients are made in the forward pass: a custom_vjp hands
    them to `jax.grad` of the program's loss, scaled by its cotangent."""
    count = traced_accumulation_steps(inputs["weights"].shape[0], microbatch, rules)
    mesh = jax.sharding.get_abstract_mesh()
    stage_axes = () if mesh.empty else tuple(a for a in rules.get("layers", ()) if mesh.shape.get(a, 1) > 1)
    context_axes = (
        () if not stage_axes else tuple(a for a in rules.get("seq", ()) if mesh.shape.get(a, 1) > 1)
    )
    axis = stage_axes or "stages"
    microbatches = jax.tree.map(lambda a: a.reshape(-1, count, *a.shape[1:]).swapaxes(0, 1), inputs)
    steps = jax.tree.leaves(stacked)[0].shape[0]
    per_stage = -(-steps // stages)
    full_stages = steps // per_stage  # those after them hold no steps

    def padded(w):  # [steps, ...] -> [stages x per_stage, ...], the empty stages' steps zeros they skip
        return jnp.concatenate([w, jnp.zeros((stages * per_stage - steps, *w.shape[1:]), w.dtype)])

    # Stored split over the stage axis on dimension `at` where the steps do not divide (see the docstring).
    if stage_axes and steps % stages:
        at = jax.tree.map(
            lambda s: _stage_dimension(s, rules, mesh.shape, stage_axes), specs, is_leaf=is_param_spec
        )
        staged = stacked
        staged_specs = jax.tree.map(lambda d: P(*[None] * d, stage_axes), at)

        def own_steps(w):  # [steps, ..., dim / stages, ...] -> this stage's [per_stage, ..., dim, ...]
            return jax.tree.map(
                lambda w, d: jax.lax.all_to_all(padded(w), stage_axes, 0, d, tiled=True), w, at
            )

        def stored(g):  # the inverse, for the gradient
            return jax.tree.map(
                lambda g, d: jax.lax.all_to_all(g[0], stage_axes, d, 0, tiled=True)[:steps], g, at
            )

    else:
        staged = jax.tree.map(lambda w: padded(w).reshape(stages, per_stage, *w.shape[1:]), stacked)
        staged_specs = P(stage_axes)

        def own_steps(w):
            return jax.tree.map(lambda a: a[0], w)

        def stored(g):
            return g

    schedule = functools.partial(
        _one_f_one_b, first_fn, step_fn, last_fn, stages, full_stages, count, axis, context_axes
    )

    def run(gradients, params, staged, microbatches):
        if not stage_axes:  # one device, or stages the mesh does not split: every stage there
            out_axes = (None, (None, 0, None)) if gradients else None
            own = jax.vmap(
                lambda w: schedule(gradients, params, w, microbatches), axis_name=axis, out_axes=out_axes
            )
            out = own(staged)
            return (
                (out[0], (out[1][0], jax.tree.map(lambda g: g[:, 0], out[1][1]), out[1][2]))
                if gradients
                else out
            )
        # Each device runs its own stage: a shard_map manual over the stage axes (the steps' own shardings over the
        # other axes stay automatic, so the chip kernels run as outside the stages) and over the context axes, so
        # that each device sums its own tokens' weight gradients over the pass and the context shards add them up
        # once, after it (automatic, XLA would reduce them across the shards' hosts every tick).
        tokens = P(None, None, context_axes)  # [microbatches, rows, seq]: each device its context shard

        def own_stage(params, staged, microbatches):
            out = schedule(gradients, params, own_steps(staged), microbatches)
            return (out[0], (out[1][0], stored(out[1][1]), out[1][2])) if gradients else out

        return jax.shard_map(
            own_stage,
            mesh=mesh,
            in_specs=(P(), staged_specs, tokens),
            out_specs=(P(), (P(), staged_specs, tokens)) if gradients else P(),
            axis_names={*stage_axes, *context_axes},
            check_vma=False,
        )(params, staged, microbatches)

    @jax.custom_vjp
    def weighted(params, staged, microbatches):
        return run(False, params, staged, microbatches)

    def forward(params, staged, microbatches):
        return run(True, params, staged, microbatches)

    def backward(grads, cotangent):
        params_grad, staged_grad, losses = grads
        scaled = jax.tree.map(lambda g: (g * cotangent).astype(g.dtype), (params_grad, staged_grad))
        # Of the inputs, only the weights are ones a loss is differentiable by: their gradient is each target's loss.
        inputs_grad = {k: losses * cotangent if k == "weights" else None for k in microbatches}
        return (*scaled, inputs_grad)

    weighted.defvjp(forward, backward)
    return weighted(params, staged, microbatches)


def _one_f_one_b(
    first_fn,
    step_fn,
    last_fn,
    stages,
    full_stages,
    count,
    axis,
    context_axes,
    gradients,
    params,
    own,
    microbatches,
):
    """One stage's part of `pipelined_loss` (its `own` steps [steps / stages, ...]), run on each device of the stage
    axis `axis` (or vmapped over it), on its context shard of the tokens where `context_axes` split them: the
    summed weighted loss, and with `gradients`, (the params' gradient, summed over the stages; the own steps'
    gradient [1, ...]; each target's loss), each summed over the context shards. Stages from `full_stages` on hold
    no steps and skip them."""
    stage = jax.lax.axis_index(axis)
    first, last = stage == 0, stage == stages - 1
    slots = 2 * stages - 1

    def of(m):  # microbatch m's inputs; a tick outside the pass (the bubble) runs a clipped one and drops it
        return jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, jnp.clip(m, 0, count - 1), keepdims=False), microbatches
        )

    def steps(x, params, own, mb):  # stage 0 starts from the microbatch's first_fn, the others from what came
        x = jnp.where(first, first_fn(params, mb), x)

        def run(x):
            return jax.lax.scan(
                lambda x, p: (step_fn(x, p, mb["positions"], mb["segment_ids"]), None), x, own
            )[0]

        return run(x) if full_stages == stages else jax.lax.cond(stage < full_stages, run, lambda x: x, x)

    def loss_of(params, y, mb):
        losses = last_fn(params, y, mb)
        return jnp.sum(losses * mb["weights"]), losses

    def pullback(x, params, own, mb):
        return jax.vjp(lambda x, params, own: steps(x, params, own, mb), x, params, own)

    def only_last(valid, fn, *args):  # fn(*args) on the last stage in a tick of the pass, zeros elsewhere
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))
        return jax.lax.cond(last & valid, fn, lambda *_: zeros, *args)

    # What stage 0 receives, and every stage before its first microbatch.
    shape = jax.eval_shape(first_fn, params, of(0))
    x = jnp.zeros(shape.shape, shape.dtype)
    # Whole cycles (vmap's ppermute takes no other): stage 0 ignores what the last stage sends it, the last stage
    # the gradient stage 0 sends it.
    forward_to_next = [(s, (s + 1) % stages) for s in range(stages)]
    backward_to_previous = [((s + 1) % stages, s) for s in range(stages)]

    if not gradients:

        def tick(carry, t):
            x, loss = carry
            mb = of(t - stage)
            y = steps(x, params, own, mb)
            loss += only_last((t - stage >= 0) & (t - stage < count), lambda y: loss_of(params, y, mb)[0], y)
            return (jax.lax.ppermute(y, axis, forward_to_next), loss), None

        loss = jax.lax.scan(tick, (x, jnp.zeros((), jnp.float32)), jnp.arange(count + stages - 1))[0][1]
        return jax.lax.psum(loss, (*_names(axis), *context_axes))

    # What a microbatch's pullback holds: its params are this tick's, so the ring keeps only the rest.
    layout = {}

    def kept(x, params, own, mb):
        leaves, layout["tree"] = jax.tree.flatten(pullback(x, params, own, mb)[1])
        known = jax.tree.leaves((params, own))
        layout["params"] = [next((j for j, p in enumerate(known) if leaf is p), None) for leaf in leaves]
        return [leaf for leaf, j in zip(leaves, layout["params"]) if j is None]

    ring = [jnp.zeros((slots, *s.shape), s.dtype) for s in jax.eval_shape(kept, x, params, own, of(0))]

    def tick(carry, t, forward, backward):
        x, dy, ring, (loss, params_grad, own_grad, losses) = carry
        m_forward, m_backward = t - stage, t - 2 * (stages - 1) + stage
        if forward:
            mb = of(m_forward)
            y, made = pullback(x, params, own, mb)
            made = [leaf for leaf, j in zip(jax.tree.leaves(made), layout["params"]) if j is None]
            ring = [
                jax.lax.dynamic_update_index_in_dim(r, m, m_forward % slots, 0) for r, m in zip(ring, made)
            ]

            def loss_and_cotangent(y):
                (value, mb_losses), grads = jax.value_and_grad(
                    lambda y, p: loss_of(p, y, mb), (0, 1), has_aux=True
                )(y, params)
                return value, mb_losses, grads

            valid = (m_forward >= 0) & (m_forward < count)
            value, mb_losses, (dy_last, head_grad) = only_last(valid, loss_and_cotangent, y)
            loss += value
            params_grad = jax.tree.map(jnp.add, params_grad, head_grad)
            at = jnp.clip(m_forward, 0, count - 1)
            losses = jax.lax.dynamic_update_index_in_dim(
                losses, jax.lax.dynamic_index_in_dim(losses, at, keepdims=False) + mb_losses, at, 0
            )
            dy = jnp.where(last, dy_last, dy)  # the last stage's backward starts from its own loss
        if backward:
            known = jax.tree.leaves((params, own))
            stored = iter(jax.lax.dynamic_index_in_dim(r, m_backward % slots, keepdims=False) for r in ring)
            held = layout["tree"].unflatten(
                [next(stored) if j is None else known[j] for j in layout["params"]]
            )
            dx, step_params_grad, step_own_grad = held(dy)
            valid = (m_backward >= 0) & (m_backward < count)
            params_grad = jax.tree.map(lambda a, g: a + jnp.where(valid, g, 0), params_grad, step_params_grad)
            own_grad = jax.tree.map(lambda a, g: a + jnp.where(valid, g, 0), own_grad, step_own_grad)
            dy = jax.lax.ppermute(dx, axis, backward_to_previous)
        if forward:
            x = jax.lax.ppermute(y, axis, forward_to_next)
        return (x, dy, ring, (loss, params_grad, own_grad, losses)), None

    zeros = functools.partial(jax.tree.map, jnp.zeros_like)
    losses = jnp.zeros(microbatches["weights"].shape, jnp.float32)
    carry = (x, x, ring, (jnp.zeros((), jnp.float32), zeros(params), zeros(own), losses))
    for forward, backward, ticks in [
        (True, False, range(stages - 1)),
        (True, True, range(stages - 1, count + stages - 1)),
        (False, True, range(count + stages - 1, count + 2 * (stages - 1))),
    ]:
        body = functools.partial(tick, forward=forward, backward=backward)
        carry = jax.lax.scan(body, carry, jnp.arange(ticks.start, ticks.stop))[0]
    loss, params_grad, own_grad, losses = carry[3]
    everywhere = (*_names(axis), *context_axes)
    loss, params_grad = jax.lax.psum((loss, params_grad), everywhere)
    own_grad = jax.lax.psum(own_grad, context_axes) if context_axes else own_grad
    return loss, (params_grad, jax.tree.map(lambda g: g[None], own_grad), jax.lax.psum(losses, axis))


def _stage_dimension(spec, rules: dict, mesh_shape, stage_axes) -> int:
    """The dimension of a stacked param [steps, ...] that the rules split over the stage axes."""
    entries = logical_to_mesh(rules, spec.axes, spec.shape, mesh_shape)
    for d, entry in enumerate(entries):
        if set(stage_axes) <= set(mesh_axes(entry)):
            return d
    raise ValueError(f"a stacked param {spec.shape} {spec.axes} is not split over {stage_axes} by the rules")


def _names(axis) -> tuple:
    """A collective's axis name, or tuple of them, as a tuple."""
    return axis if isinstance(axis, tuple) else (axis,)
