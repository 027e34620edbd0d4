"""Parameter declarations: a program's PARAMS is a tree of ParamSpec, and its params are drawn from it."""

import dataclasses
import math

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
    # Read by the step and never trained (F.lora's base): the train state keeps it apart from the params the
    # optimizer trains (`state["frozen"]`), and checkpoints leave it out: it is loaded again on resume.
    frozen: bool = False
    adapter: bool = False  # a low-rank adapter (F.lora): not in the base model's checkpoint
    dtype: str = "float32"  # how the param is stored (F.lora's frozen base may be bfloat16)


def is_param_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def select(tree, specs, keep) -> dict:
    """The part of a params tree (or of PARAMS itself) whose specs `keep` selects, as nested dicts without the
    rest: a frozen base, the trained params, the adapters."""
    selected = {}
    for key, spec in specs.items():
        if is_param_spec(spec):
            if keep(spec):
                selected[key] = tree[key]
        elif part := select(tree[key], spec, keep):
            selected[key] = part
    return selected


def trained(tree, specs) -> dict:
    """What the optimizer trains, with the statistics the step overwrites: everything but the frozen params."""
    return select(tree, specs, lambda spec: not spec.frozen)


def frozen(tree, specs) -> dict:
    return select(tree, specs, lambda spec: spec.frozen)


def joined(*parts: dict) -> dict:
    """The params tree whose parts `select` made."""
    whole: dict = {}
    for part in parts:
        for key, value in part.items():
            whole[key] = joined(whole[key], value) if isinstance(value, dict) and key in whole else value
    return whole


def adapters_off(params: dict, specs) -> dict:
    """The params with every adapter (F.lora's A and B) zero: the frozen base's own model, DPO's reference."""
    adapters = select(params, specs, lambda spec: spec.adapter)
    return joined(params, jax.tree.map(jnp.zeros_like, adapters))


def in_compute_dtype(params: dict, dtype, stacked) -> dict:
    """The params in `dtype`, but for the `stacked` blocks', which each layer casts as it runs (the program's
    lowering chose which: its stack_cast step)."""
    return {k: v if k in stacked else jax.tree.map(lambda w: w.astype(dtype), v) for k, v in params.items()}


def init_params(specs, rng):
    """Parameters for a tree of ParamSpec, in each one's dtype (float32 unless it says); each drawn from its own key. Adapters are drawn apart,
    from their own key (`init_adapters`), so a run that loads its base draws the same adapters as one that
    draws it."""
    base = select(specs, specs, lambda spec: not spec.adapter)
    leaves, treedef = jax.tree.flatten(base, is_leaf=is_param_spec)
    keys = jax.random.split(rng, len(leaves))
    drawn = treedef.unflatten([_init_param(key, spec) for key, spec in zip(keys, leaves)])
    return joined(drawn, init_adapters(specs, rng))


def init_adapters(specs, rng) -> dict:
    """The adapters of a tree of ParamSpec (none: {}), drawn as PEFT draws them."""
    adapters = select(specs, specs, lambda spec: spec.adapter)
    leaves, treedef = jax.tree.flatten(adapters, is_leaf=is_param_spec)
    keys = jax.random.split(jax.random.fold_in(rng, 1), len(leaves))
    return treedef.unflatten([_init_param(key, spec) for key, spec in zip(keys, leaves)])


def _init_param(key, spec: ParamSpec):
    return _drawn(key, spec).astype(spec.dtype)


def _drawn(key, spec: ParamSpec):
    if spec.init == "ones":
        return jnp.ones(spec.shape, jnp.float32)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, jnp.float32)
    if spec.init == "kaiming_uniform":
        # torch's kaiming_uniform_(a=sqrt(5)), as PEFT draws lora_A: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in
        # the input features (what the adapter contracts; not the stacked layers, not its rank).
        fan_in = math.prod(n for n, axis in zip(spec.shape, spec.axes) if axis not in ("layers", "lora_rank"))
        bound = 1 / math.sqrt(fan_in)
        return jax.random.uniform(key, spec.shape, jnp.float32, -bound, bound)
    return spec.std * jax.random.normal(key, spec.shape, jnp.float32)
