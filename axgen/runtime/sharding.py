"""Logical axes to mesh axes: the one rule by which a program's rules table shards params and activations."""

import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axgen.runtime.params import is_param_spec


def logical_to_mesh(rules: dict, logical_axes, shape, mesh_shape) -> P:
    """PartitionSpec for a tensor: each dimension takes its rule's mesh axes that are unused, larger than 1, and
    divide the dimension."""
    used, spec = set(), []
    for axis, size in zip(logical_axes, shape):
        mesh_axes = tuple(m for m in rules[axis] if m not in used and mesh_shape[m] > 1)
        if size % math.prod(mesh_shape[m] for m in mesh_axes):
            mesh_axes = ()
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
