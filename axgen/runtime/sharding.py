"""Logical axes to mesh axes: the one rule by which a program's rules table shards params and activations."""

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axgen.runtime.params import is_param_spec


def logical_to_mesh(rules: dict, logical_axes, shape, mesh_shape) -> P:
    """PartitionSpec for a tensor: each dimension takes, in its rule's order, the mesh axes that are unused, larger
    than 1, and still divide the dimension with those taken before them, so a rule's later axes are its fallbacks
    (MaxText lists them as repeated rules): DeepSeek-V3's 1536-wide q latent takes fsdp=128 of fsdp x expert =
    128 x 8, which it could not take whole. A None axis is whole on every device. Inside a shard_map, the axes it
    made manual are each device's own and split nothing (`replica_axes`: a step that accumulates gradients runs
    under one); an axis the mesh lacks (a mesh made without `context`), or a logical axis the rules do not name (a
    hand-made table without `seq`), splits nothing either."""
    used, spec = set(jax.sharding.get_abstract_mesh().manual_axes), []
    for axis, size in zip(logical_axes, shape):
        mesh_axes = ()
        for m in () if axis is None else rules.get(axis, ()):
            if (
                m not in used
                and mesh_shape.get(m, 1) > 1
                and size % (shards(mesh_axes, mesh_shape) * mesh_shape[m]) == 0
            ):
                mesh_axes += (m,)
        used.update(mesh_axes)
        spec.append(mesh_axes or None)
    return P(*spec)


def constrain(x, logical_axes, rules: dict):
    """Pins an activation's sharding; a no-op outside a mesh, so a program's `forward` also runs on one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_mesh(rules, logical_axes, x.shape, mesh.shape))


def param_shardings(mesh, specs, rules: dict):
    """NamedSharding of each param of a tree of ParamSpec."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, logical_to_mesh(rules, s.axes, s.shape, mesh.shape)),
        specs,
        is_leaf=is_param_spec,
    )


def mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a PartitionSpec names: None, a mesh axis, or a tuple of them."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def shards(entry, mesh_shape) -> int:
    """How many parts one entry of a PartitionSpec splits a dimension into."""
    return math.prod(mesh_shape[axis] for axis in mesh_axes(entry))


def replica_axes(rules: dict, mesh_shape) -> tuple[str, ...]:
    """The mesh axes (larger than 1) that split the batch and nothing else: every device along them holds the same
    params and differs only in its rows, so gradients are summed over them and over nothing else they touch
    (data parallelism, slices over DCN)."""
    elsewhere = {axis for logical, axes in rules.items() if logical != "batch" for axis in axes}
    return tuple(axis for axis in rules["batch"] if axis not in elsewhere and mesh_shape.get(axis, 1) > 1)


def varying_axes(x) -> frozenset:
    """The manual mesh axes (inside a shard_map) over which x may differ from device to device; none elsewhere.
    jax 0.12 types them as the aval's `manual_axis_type.varying`, jax 0.11 (the H100 hosts' so far) as `vma`.
    """
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def varying_over(x, axes):
    """x typed as varying over the manual mesh `axes` too. A Pallas kernel's outputs name no axes, though computed
    from inputs that vary; shard_map's check refuses a gradient typed otherwise than its input, and a value typed
    invariant would make the transpose skip the sum over the axes it varies over."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying") if hasattr(jax.lax, "pcast") else jax.lax.pvary(x, missing)


def vocab_parallel_take(table, tokens, rules: dict):
    """jnp.take(table, tokens, axis=0) for an embedding table [vocab, embed] whose vocabulary the rules split over
    devices, each device looking up the tokens in its own rows and the devices summing (Megatron's vocabulary-
    parallel embedding): where pipeline stages run in a shard_map manual over the stage axis, XLA's partitioner
    fails on the gather along the split vocabulary with two more mesh axes (jax 0.12.0.1, a check in
    spmd_partitioner_util.cc). Elsewhere, or with the vocabulary whole, the plain gather."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = (
        () if mesh.empty else mesh_axes(logical_to_mesh(rules, ("vocab", None), table.shape, mesh.shape)[0])
    )
    if not axes:
        return jnp.take(table, tokens, axis=0)

    def own_rows(table, tokens):
        start = jax.lax.axis_index(axes) * table.shape[0]
        here = (tokens >= start) & (tokens < start + table.shape[0])
        rows = jnp.take(table, jnp.where(here, tokens - start, 0), axis=0)
        return jax.lax.psum(jnp.where(here[..., None], rows, 0), axes)

    return jax.shard_map(
        own_rows, mesh=mesh, in_specs=(P(axes), P()), out_specs=P(), axis_names=set(axes), check_vma=False
    )(table, tokens)
