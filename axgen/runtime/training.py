"""The parts of a train step every program shares: gradients over microbatches, and an optimizer update that
leaves statistics untrained and skips a non-finite step."""

import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from axgen.runtime.params import is_param_spec, joined, trained
from axgen.runtime.sharding import constrain, logical_to_mesh, replica_axes


class BatchSplitError(ValueError):
    """A global batch that does not split into passes of the program's MICROBATCH sequences per device."""


def accumulation_steps(rows: int, microbatch: int, rules: dict, mesh_shape: dict) -> int:
    """How many forward and backward passes a batch of `rows` sequences takes at `microbatch` sequences per device
    per pass (at most: a batch smaller than one pass is one smaller pass), its rows split over the mesh axes the
    rules give `batch` (one device outside a mesh)."""
    spec = logical_to_mesh(rules, ("batch", "seq"), (rows, 1), mesh_shape)[0] if mesh_shape else None
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    per_device = rows // math.prod(mesh_shape[axis] for axis in axes)
    if per_device <= microbatch:
        return 1
    if per_device % microbatch:
        raise BatchSplitError(
            f"its {per_device} sequences per device do not split into passes of MICROBATCH={microbatch}; use a "
            f"multiple of {rows // per_device * microbatch} sequences"
        )
    return per_device // microbatch


def traced_accumulation_steps(rows: int, microbatch: int, rules: dict) -> int:
    """accumulation_steps of a traced batch of `rows` sequences, under the mesh the step is compiled for."""
    mesh = jax.sharding.get_abstract_mesh()
    return accumulation_steps(rows, microbatch, rules, {} if mesh.empty else dict(mesh.shape))


def gradients(loss_fn, state: dict, batch, microbatch: int, specs, rules: dict):
    """((loss, metrics), grads) of `loss_fn(params, *batch)` over the whole batch, the params being the state's
    trained ones with its frozen ones (F.lora's base, `state["frozen"]`; grads hold the trained ones only), in
    passes of `microbatch` sequences per device: with more rows than one pass takes, they are summed over the
    passes, which lax.scan runs one after another, so only one pass's activations are alive at a time. Row i goes to pass i % passes: every
    pass takes rows from every device, and no tokens move. The number of passes follows from the batch (`--batch`),
    so a larger batch keeps the pass the spec's rule sized and takes more of them.

    Over several passes on a data x fsdp mesh, the devices along the `replica_axes` (data parallelism; slices,
    whose links are the data-centre network) sum their own passes' gradients apart and reduce them once, after the
    last pass: a reduction per pass would cross those links `passes` times a step."""
    # Differentiated by the trained params alone: no weight gradient of a frozen base is ever made. The frozen
    # params travel with the batch, as an argument, into the shard_map below.
    params, batch, specs = state["params"], (state.get("frozen", {}), *batch), trained(specs, specs)
    loss_fn = functools.partial(_with_frozen, loss_fn)
    accum_steps = traced_accumulation_steps(batch[1].shape[0], microbatch, rules)
    if accum_steps == 1:
        return jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
    mesh = jax.sharding.get_abstract_mesh()
    replicas = () if mesh.empty else replica_axes(rules, dict(mesh.shape))
    accumulate = functools.partial(_accumulated, loss_fn, accum_steps=accum_steps, specs=specs, rules=rules)
    others = {axis for axis, size in mesh.shape.items() if size > 1 and axis not in replicas}
    if not replicas or others - {"fsdp"}:
        # Only data x fsdp meshes reduce once: with a model or expert axis beside them, XLA cannot partition the
        # step inside a shard_map manual over the replicas (jax 0.12: "Check failed: partition_group_list" in
        # spmd_partitioner_util.cc with data, fsdp and model or expert all over 1; on GPU cuDNN attention's custom
        # partitioning meets a GSPMDSharding with data x model). There the passes' gradients meet once a pass.
        return accumulate(params, batch)

    def on_replica(params, frozen, batch):
        values, grads = accumulate(params, (frozen, *batch))

        # Each replica's sums are means over its own rows: the batch's are their mean (statistics: their maximum;
        # experts' loads add up as gradients do).
        def across(g, spec):
            summed = spec.trained or spec.balance_rate is not None
            return jax.lax.pmean(g, replicas) if summed else jax.lax.pmax(g, replicas)

        return jax.lax.pmean(values, replicas), jax.tree.map(across, grads, specs, is_leaf=is_param_spec)

    # Unchecked: with shard_map's replication types, each pass's gradient of the replicated params would be
    # summed over the replicas where it is made (the transpose of their broadcast), once per pass.
    return jax.shard_map(
        on_replica,
        mesh=mesh,
        in_specs=(P(), P(), P(replicas)),
        out_specs=P(),
        axis_names=set(replicas),
        check_vma=False,
    )(params, batch[0], batch[1:])


def _with_frozen(loss_fn, params, frozen, *batch):
    return loss_fn(joined(params, frozen), *batch)


def _accumulated(loss_fn, params, batch, accum_steps: int, specs, rules: dict):
    """`gradients` summed over `accum_steps` passes of the batch's rows (after the frozen params, batch[0]), one
    after another."""
    frozen, microbatches = batch[0], _microbatches(batch[1:], accum_steps)
    # Each microbatch counts 1/accum_steps, so the sums are means over the batch, gradients included (means of
    # the microbatches' means: exact when they count the same number of targets).
    grad_fn = jax.value_and_grad(
        lambda p, microbatch: jax.tree.map(lambda x: x / accum_steps, loss_fn(p, frozen, *microbatch)),
        has_aux=True,
    )

    def as_params(grads):
        return jax.tree.map(
            lambda g, spec: constrain(g, spec.axes, rules), grads, specs, is_leaf=is_param_spec
        )

    def add(total, new, spec):
        # Statistics (fp8 amax histories) come back whole from each microbatch: the batch's is their maximum.
        # Experts' loads (a correction bias's backward value) add up over the microbatches, as gradients do.
        return total + new if spec.trained or spec.balance_rate is not None else jnp.maximum(total, new)

    def add_microbatch(totals, microbatch):
        values, grads = grad_fn(params, microbatch)
        values = jax.tree.map(jnp.add, totals[0], values)
        grads = jax.tree.map(add, totals[1], grads, specs, is_leaf=is_param_spec)
        return (values, as_params(grads)), None

    shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], microbatches))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    totals, _ = jax.lax.scan(add_microbatch, (zeros[0], as_params(zeros[1])), microbatches)
    return totals


def summed_over_microbatches(sums_fn, params, batch, microbatch: int, rules: dict):
    """`sums_fn(params, *batch)`, a tree of sums, over the whole batch in passes of `microbatch` sequences per
    device that lax.scan runs one after another, split as `gradients` splits them: an evaluation holds one pass's
    activations and logits at a time, as the train step does, and fits wherever it fits."""
    accum_steps = traced_accumulation_steps(batch[0].shape[0], microbatch, rules)
    if accum_steps == 1:
        return sums_fn(params, *batch)
    microbatches = _microbatches(batch, accum_steps)

    def add_microbatch(totals, microbatch):
        return jax.tree.map(jnp.add, totals, sums_fn(params, *microbatch)), None

    shapes = jax.eval_shape(sums_fn, params, *jax.tree.map(lambda x: x[0], microbatches))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.scan(add_microbatch, zeros, microbatches)[0]


def _microbatches(batch, accum_steps: int):
    """[accum_steps, rows / accum_steps, ...] of each array: row i goes to microbatch i % accum_steps."""
    return jax.tree.map(lambda x: x.reshape(-1, accum_steps, x.shape[1]).swapaxes(0, 1), batch)


def apply_gradients(optimizer, learning_rate, state: dict, grads, loss, metrics: dict, specs):
    """The next state and the step's metrics (with loss, grad_norm, the step's lr and whether it was skipped). Statistics (params with trained=False,
    e.g. fp8 amax histories) are not trained: backward returns each one's next value where a gradient would be. A
    correction bias (a statistic with a balance_rate) gets each expert's load over the step instead, and moves by
    the rate toward balance: up for an expert below the mean load, down above it (DeepSeek-V3). A non-finite loss
    or gradient never reaches the params or the optimizer's moments: the step is skipped. Frozen params (F.lora's
    base) pass through as they are."""
    specs = trained(specs, specs)
    statistics = grads
    grads = jax.tree.map(lambda g, spec: g if spec.trained else jnp.zeros_like(g), grads, specs)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    params = jax.tree.map(
        lambda p, new, old, spec: p if spec.trained else _statistic(old, new, spec),
        params,
        statistics,
        state["params"],
        specs,
    )
    metrics = {
        **metrics,
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "lr": learning_rate(state["step"]),
    }
    finite = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
    kept = jax.tree.map(
        lambda new, old: jnp.where(finite, new, old),
        (params, opt_state),
        (state["params"], state["opt_state"]),
    )
    metrics["skipped"] = jnp.logical_not(finite)
    return {**state, "step": state["step"] + 1, "params": kept[0], "opt_state": kept[1]}, metrics


def balanced(bias, load, rate: float):
    """DeepSeek-V3's auxiliary-loss-free update of a correction bias [..., experts] from its experts' loads over
    the step: bias + rate * sign(mean load - load), the mean over the last axis (one layer's experts). A load
    scaled by any positive factor (a mean instead of a count, a sum over devices counted twice) moves it the same.
    """
    mean = load.mean(axis=-1, keepdims=True)
    return bias + rate * jnp.sign(mean - load).astype(bias.dtype)


def _statistic(old, new, spec):
    """A statistic's next value: what backward returned, or a correction bias moved by its experts' loads."""
    return new if spec.balance_rate is None else balanced(old, new, spec.balance_rate)
