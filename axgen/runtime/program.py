"""A program module as the runtime sees it: the names an emitted program defines, and what the runtime derives
from them (mesh, train state, shardings, compiled steps)."""

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import optax
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import axgen
from axgen.runtime import checkpoints, memory
from axgen.runtime.params import frozen, init_adapters, joined, select, trained
from axgen.runtime.sharding import logical_to_mesh, param_shardings
from axgen.runtime.training import accumulation_steps


class IncompatibleProgram(RuntimeError):
    """A program built by an axgen whose programs this runtime cannot run."""


@dataclasses.dataclass(frozen=True)
class Program:
    """The names every emitted program defines, read from its module when the run starts (so a test may set
    MESH_SHAPE and the like on the module first). A missing name is a program this runtime cannot run."""

    module: types.ModuleType
    axgen_version: str  # AXGEN_VERSION: the axgen that emitted the program
    config: dict  # CONFIG: the spec's model and training settings
    params: dict  # PARAMS: a tree of ParamSpec
    logical_axis_rules: dict  # LOGICAL_AXIS_RULES: logical axis -> mesh axes
    target: str  # TARGET: the target it was built for
    mesh_shape: dict  # MESH_SHAPE: mesh axis -> devices, over the whole job
    dcn_mesh_shape: dict | None  # DCN_MESH_SHAPE: how slices split the mesh (None: one slice)
    platform: str  # PLATFORM: jax's platform, unless JAX_PLATFORMS says otherwise
    num_hosts: int  # NUM_HOSTS: processes a job of this target has
    compiler_flags: dict  # COMPILER_FLAGS: environment variable -> flags set before jax starts
    memory_fraction: float | None  # MEMORY_FRACTION: of each device's memory for jax's allocator
    peak_flops_per_device: float | None  # PEAK_FLOPS_PER_DEVICE: for MFU; None: no chip's published peak
    microbatch: int  # MICROBATCH: sequences per device per forward and backward pass
    logged_metrics: tuple  # LOGGED_METRICS: metrics the progress line shows besides the loss
    optimizer: object  # OPTIMIZER: the optax transformation of the train step
    learning_rate: object  # LEARNING_RATE: the optax schedule, step -> rate
    init_params: types.FunctionType
    train_step: types.FunctionType
    eval_step: types.FunctionType

    @classmethod
    def module_names(cls) -> dict[str, str]:
        """Each field's name in a program module: constants in capitals, functions as they are."""
        fields = [f for f in dataclasses.fields(cls) if f.name != "module"]
        return {f.name: f.name if f.type is types.FunctionType else f.name.upper() for f in fields}

    @classmethod
    def from_module(cls, module) -> "Program":
        names = cls.module_names()
        built_with, runtime = getattr(module, "AXGEN_VERSION", None), axgen.__version__
        if built_with is None or _minor(built_with) != _minor(runtime):
            raise IncompatibleProgram(
                f"{getattr(module, '__file__', module.__name__)} was built by axgen {built_with or 'before 0.2'} and"
                f" this runtime (axgen {runtime}) runs programs of axgen {_minor(runtime)}.x: rebuild it as its"
                f" second line says (`# Regenerate: axgen build ...`), or run it with the axgen that built it"
            )
        missing = [name for name in names.values() if not hasattr(module, name)]
        if missing:
            raise IncompatibleProgram(
                f"{module.__file__} defines no {', '.join(missing)}: it is not an axgen program"
            )
        return cls(module=module, **{field: getattr(module, name) for field, name in names.items()})

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape.values())

    def make_mesh(self, devices=None):
        """The mesh over `devices` (default: all); slices of a multi-slice job split `data` (DCN_MESH_SHAPE).
        Devices with no slice, as on one host, form a single mesh of the same shape."""
        axis_types = (jax.sharding.AxisType.Auto,) * len(self.mesh_shape)
        devices = jax.devices() if devices is None else devices
        if self.dcn_mesh_shape and hasattr(devices[0], "slice_index"):
            per_slice = [size // self.dcn_mesh_shape[axis] for axis, size in self.mesh_shape.items()]
            grid = mesh_utils.create_hybrid_device_mesh(
                per_slice, list(self.dcn_mesh_shape.values()), devices
            )
            return jax.sharding.Mesh(grid, tuple(self.mesh_shape), axis_types=axis_types)
        if self.dcn_mesh_shape:
            grid = mesh_utils.create_device_mesh(list(self.mesh_shape.values()), devices)
            return jax.sharding.Mesh(grid, tuple(self.mesh_shape), axis_types=axis_types)
        return jax.make_mesh(
            tuple(self.mesh_shape.values()), tuple(self.mesh_shape), axis_types=axis_types, devices=devices
        )

    def init_state(self, rng):
        return self.state_from_params(self.init_params(rng))

    @property
    def reference_copy(self) -> bool:
        """Whether F.dpo's reference is a frozen copy of the initial params (CONFIG's "reference": "copy")."""
        return self.config.get("reference") == "copy"

    @property
    def has_frozen(self) -> bool:
        """Whether the state keeps params apart that do not train, in `state["frozen"]`: F.lora's base, or DPO's
        reference copy."""
        return bool(frozen(self.params, self.params)) or self.reference_copy

    def frozen_part(self, params):
        """What of the whole params the state keeps frozen: F.lora's base, and DPO's reference copy of them all
        (under "reference", where the loss finds it)."""
        part = frozen(params, self.params)
        return {**part, "reference": params} if self.reference_copy else part

    def state_from_params(self, params):
        """Step 0 with these params and a fresh optimizer state for the trained ones."""
        state = {"step": jnp.zeros((), jnp.int32), "params": trained(params, self.params)}
        state["opt_state"] = self.optimizer.init(state["params"])
        return {**state, "frozen": self.frozen_part(params)} if self.has_frozen else state

    def model_params(self, state):
        """The whole params tree of a state: its trained params with its frozen ones."""
        return joined(state["params"], state.get("frozen", {}))

    def param_shardings(self, mesh):
        return param_shardings(mesh, self.params, self.logical_axis_rules)

    def state_shardings(self, mesh):
        """Params by the rules table; optimizer moments like their params; counters replicated."""
        params = self.param_shardings(mesh)
        replicated = NamedSharding(mesh, P())
        abstract_state = jax.eval_shape(lambda: self.init_state(jax.random.key(0)))
        opt_state = optax.tree_map_params(
            self.optimizer,
            lambda _, sharding: sharding,
            abstract_state["opt_state"],
            trained(params, self.params),
            transform_non_params=lambda _: replicated,
        )
        state = {"step": replicated, "params": trained(params, self.params), "opt_state": opt_state}
        return {**state, "frozen": self.frozen_part(params)} if self.has_frozen else state

    def abstract_state(self, mesh):
        """The train state's shapes, dtypes and shardings, without allocating it."""
        return jax.tree.map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            jax.eval_shape(lambda: self.init_state(jax.random.key(0))),
            self.state_shardings(mesh),
        )

    def batch_sharding(self, mesh, global_batch):
        """Token windows and their segment ids [batch, seq + 1]: rows split as the rules table splits `batch`."""
        spec = logical_to_mesh(self.logical_axis_rules, ("batch", "seq"), (global_batch, 1), mesh.shape)
        return NamedSharding(mesh, spec)

    def accumulation_steps(self, global_batch) -> int:
        """Forward and backward passes of MICROBATCH sequences per device a step of this batch takes on the
        program's mesh; BatchSplitError when it does not split into them."""
        return accumulation_steps(global_batch, self.microbatch, self.logical_axis_rules, self.mesh_shape)

    def batch_shape(self, mesh, global_batch):
        """The abstract token windows (and their segment ids and loss masks) of a global batch."""
        return jax.ShapeDtypeStruct(
            (global_batch, self.config["seq_len"] + 1),
            jnp.int32,
            sharding=self.batch_sharding(mesh, global_batch),
        )

    def jit_train_step(self, mesh, global_batch):
        shardings = self.state_shardings(mesh)
        batch = self.batch_sharding(mesh, global_batch)
        return jax.jit(
            self.train_step,
            in_shardings=(shardings, batch, batch, batch),
            out_shardings=(shardings, NamedSharding(mesh, P())),
            donate_argnums=0,
        )

    def compile_train_step(self, mesh, global_batch):
        """The train step compiled ahead of time for this batch, and its per-device peak bytes."""
        tokens = self.batch_shape(mesh, global_batch)
        compiled = (
            self.jit_train_step(mesh, global_batch)
            .lower(self.abstract_state(mesh), tokens, tokens, tokens)
            .compile()
        )
        return compiled, memory.step_peak_bytes(compiled.memory_analysis())

    def jit_eval_step(self, mesh, global_batch):
        batch = self.batch_sharding(mesh, global_batch)
        # The whole params, DPO's reference copy with them where there is one.
        params = self.model_params(self.state_shardings(mesh))
        return jax.jit(
            self.eval_step, in_shardings=(params, batch, batch, batch), out_shardings=NamedSharding(mesh, P())
        )

    def compile_eval_step(self, mesh, global_batch):
        """The eval step compiled ahead of time for this batch, and its per-device peak bytes."""
        tokens = self.batch_shape(mesh, global_batch)
        params = self.model_params(self.abstract_state(mesh))
        compiled = self.jit_eval_step(mesh, global_batch).lower(params, tokens, tokens, tokens).compile()
        return compiled, memory.step_peak_bytes(compiled.memory_analysis())

    def abstract_params(self, mesh):
        """The params' shapes, dtypes and shardings, without allocating them."""
        return jax.tree.map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            jax.eval_shape(self.init_params, jax.random.key(0)),
            self.param_shardings(mesh),
        )

    def restore_params(self, path, mesh):
        """Params from an `axgen convert-hf` checkpoint, restored straight into this mesh's shardings. A program's
        adapters (F.lora) come from it where convert-hf wrote a PEFT adapter's (--adapter); else from the seed.
        """
        abstract = self.abstract_params(mesh)
        adapters = select(self.params, self.params, lambda spec: spec.adapter)
        if not adapters or checkpoints.adapter_of(path):
            return checkpoints.restore_params(path, abstract, self.config["model"])
        base = select(abstract, self.params, lambda spec: not spec.adapter)
        params = checkpoints.restore_params(path, base, self.config["model"])
        shardings = select(self.param_shardings(mesh), self.params, lambda spec: spec.adapter)
        draw = jax.jit(lambda rng: init_adapters(self.params, rng), out_shardings=shardings)
        return joined(params, draw(jax.random.key(self.config["seed"])))


def _minor(version: str) -> str:
    """Programs and runtimes of the same minor version (0.2.*) work together."""
    return ".".join(version.split(".")[:2])
