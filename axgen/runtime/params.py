"""Parameter declarations: a program's PARAMS is a tree of ParamSpec, and its params are drawn from it."""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple
    axes: tuple  # logical axes, one per dimension
    init: str = "normal"  # normal(0, std) | ones | zeros
    std: float = 0.02
    decay: bool = True  # whether AdamW weight decay applies
    trained: bool = True  # False: a statistic the step overwrites with what backward returns for it
    # An expert-choice correction bias (DeepSeek-V3's auxiliary-loss-free balancing; trained=False): backward
    # returns each expert's load, summed over the step, and the step adds balance_rate * sign(mean load - load).
    balance_rate: float | None = None


def is_param_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def init_params(specs, rng):
    """float32 parameters for a tree of ParamSpec; each one drawn from its own key."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_param_spec)
    keys = jax.random.split(rng, len(leaves))
    return treedef.unflatten([_init_param(key, spec) for key, spec in zip(keys, leaves)])


def _init_param(key, spec: ParamSpec):
    if spec.init == "ones":
        return jnp.ones(spec.shape, jnp.float32)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, jnp.float32)
    return spec.std * jax.random.normal(key, spec.shape, jnp.float32)
