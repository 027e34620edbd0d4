"""Checkpoints that prove themselves: each array's checksum is saved with it and checked on restore; a damaged
checkpoint is set aside and the run resumes from the newest one that verifies. Tools read them on the host, without
devices or the program that saved them, through `read_on_host` and `newest_verified_on_host` (`axgen export-hf`).
"""

import contextlib
import gc
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.metadata import array_metadata_store  # not exported; orbax is pinned

ITEMS = ("state", "checksums")  # what each step folder holds
CHECKSUM_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def checksum(x):
    """32 bits of an array's contents: each word of its bits times an odd weight set by its place, summed modulo
    2**32, so one flipped bit, or two words swapped, changes it. Computed where the array lives."""
    words = jax.lax.bitcast_convert_type(x, CHECKSUM_WORDS[x.dtype.itemsize]).astype(jnp.uint32).ravel()
    weights = 2 * jax.lax.iota(jnp.uint32, words.size) + 1
    return jnp.sum(words * weights, dtype=jnp.uint32)


def host_checksum(array: np.ndarray, block: int = 1 << 24) -> int:
    """`checksum` computed on the host a block of words at a time, so a tensor larger than free memory can be
    verified (`axgen export-hf` reads checkpoints this way): each word's weight depends only on its place."""
    words = np.ascontiguousarray(array).reshape(-1).view(CHECKSUM_WORDS[array.dtype.itemsize])
    total = 0
    for start in range(0, words.size, block):
        chunk = words[start : start + block].astype(np.uint32)
        weights = 2 * np.arange(start, start + chunk.size, dtype=np.uint64).astype(np.uint32) + np.uint32(1)
        total = (total + int(np.sum(chunk * weights, dtype=np.uint32))) % 2**32
    return total


@jax.jit
def checksums(state):
    return jax.tree.map(checksum, state)


def manager(directory, every: int):
    """The orbax manager of a run's checkpoints: one every `every` steps, the newest three kept."""
    if jax.process_count() == 1:
        write_each_array_from_one_replica()
    options = ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=3)
    return ocp.CheckpointManager(directory, options=options, item_names=ITEMS)


def write_each_array_from_one_replica():
    """orbax splits the writing of a replicated array among its replicas, so that on a pod each host writes a part.
    In one process every replica is here, so the split only costs: each part is cut by a program of its own, one per
    shape and device, compiled at the first save (192 of them, 9.6 s on 2 busy cores, for a 3-layer MoE program on 8
    CPU devices). One process writes each array once instead, from its first replica (orbax's default on GPUs).
    """
    handler = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False,
        array_metadata_store=array_metadata_store.Store(),  # as orbax's own registry
    )
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


def save(manager, state, force=False):
    """Saves the state with the checksum of each of its arrays (the write itself goes on in the background). Its
    frozen params (F.lora's base) are left out: they are the run's base, loaded again on resume (`BASE`)."""
    state = saved_part(state)
    sums = jax.device_get(checksums(state))
    recorded = {jax.tree_util.keystr(path): int(value) for path, value in jax.tree.leaves_with_path(sums)}
    items = ocp.args.Composite(state=ocp.args.StandardSave(state), checksums=ocp.args.JsonSave(recorded))
    manager.save(int(state["step"]), args=items, force=force)


def verified(manager, step, abstract):
    """The state saved at `step`, or why it cannot be trusted: an array whose checksum differs, or the first line
    of the error reading it raised (a truncated or missing file, a missing step folder)."""
    items = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), checksums=ocp.args.JsonRestore())
    try:
        with unreported_read_errors():
            restored = manager.restore(step, args=items)
    except Exception as err:  # a damaged checkpoint fails in as many ways as it can be damaged
        while err.__cause__ is not None:
            err = err.__cause__
        return None, (str(err).strip().splitlines() or [type(err).__name__])[0]
    sums = jax.device_get(checksums(restored.state))
    for path, value in jax.tree.leaves_with_path(sums):
        if restored.checksums.get(jax.tree_util.keystr(path)) != int(value):
            return (
                None,
                f"the checksum of state{jax.tree_util.keystr(path)} differs from the one saved with it",
            )
    return restored.state, None


@contextlib.contextmanager
def unreported_read_errors():
    """orbax reads a checkpoint in many asyncio tasks and raises the first failure. With damaged files the other
    reads fail too, and say so as their tasks are collected, and when tensorstore calls back into orbax's closed
    event loop, for a while after: those echoes of the one failure reported are not printed. Any other error is.
    """
    asyncio_log, hook = logging.getLogger("asyncio"), sys.unraisablehook
    level = asyncio_log.level
    asyncio_log.setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda unraisable: None if _echoes_a_failed_read(unraisable) else hook(unraisable)
    try:
        yield
    except Exception:
        gc.collect()
        raise
    asyncio_log.setLevel(level)
    sys.unraisablehook = hook


def _echoes_a_failed_read(unraisable):
    coroutine = getattr(unraisable.object, "cr_code", None)
    from_orbax = coroutine is not None and os.sep + "orbax" + os.sep in coroutine.co_filename
    return from_orbax or "Event loop is closed" in str(unraisable.exc_value)


def any_process(mesh, flag):
    """A replicated boolean array: whether `flag` holds on any process of the job. It is a collective, so every
    process calls it at the same point; its value can be read later, without waiting for it now."""
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    flags = jax.make_array_from_callback((mesh.size,), sharding, lambda index: np.full(1, bool(flag)))
    return jnp.any(flags)


def newest_verified(manager, mesh, run_dir, abstract):
    """(state, step) of the newest checkpoint that verifies on every process, damaged newer ones named in a
    warning and moved to RUN_DIR/damaged; (None, None) when the run has none. Checkpoints none of which verifies
    stop the run: starting afresh over them is the user's decision."""
    steps = sorted(manager.all_steps(), reverse=True)
    damaged = []
    for step in steps:
        state, problem = verified(manager, step, abstract)
        if not bool(jax.device_get(any_process(mesh, problem is not None))):
            _set_aside(manager, run_dir, damaged)
            return state, step
        print(
            f"warning: checkpoint step {step} in {manager.directory} is damaged: {problem or 'on another process'}",
            file=sys.stderr,
            flush=True,
        )
        damaged.append(step)
    if steps:
        raise SystemExit(
            f"error: no checkpoint in {manager.directory} verifies (steps {', '.join(map(str, steps))});"
            " move them away to start this run afresh"
        )
    return None, None


def _set_aside(manager, run_dir, steps):
    """Moves damaged checkpoints to RUN_DIR/damaged (kept, not deleted), so their steps can be saved again."""
    if steps and jax.process_index() == 0:
        for step in steps:
            destination = os.path.join(run_dir, "damaged", f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
            os.makedirs(os.path.dirname(destination), exist_ok=True)
            os.rename(os.path.join(manager.directory, str(step)), destination)
    if steps:
        multihost_utils.sync_global_devices("damaged checkpoints set aside")
        manager.reload()


def saved_part(state: dict) -> dict:
    """What a checkpoint holds of a train state (or of its abstract shapes): all but the frozen params."""
    return {key: value for key, value in state.items() if key != "frozen"}


# In RUN_DIR, for a program with frozen params: where the base the adapters train on came from (the --init-from
# folder, or null: drawn from the seed), so a resumed run loads the same one.
BASE = "base.json"


def run_base(run_dir, init_from) -> str | None:
    """The base of the run in `run_dir`: the one it recorded when it began, which a different --init-from may
    not replace (ValueError saying so); else `init_from` (absolute), recorded now."""
    path, given = os.path.join(run_dir, BASE), init_from and os.path.abspath(init_from)
    if os.path.exists(path):
        recorded = recorded_base(run_dir)
        if init_from is not None and given != recorded:
            raise ValueError(
                f"--init-from {init_from}: the run in {run_dir} trains its adapters on the base"
                f" {recorded or 'drawn from its seed'} ({path}); resume it with that one, or use a new --run-dir"
            )
        return recorded
    with open(path + ".tmp", "w") as file:
        json.dump({"init_from": given}, file)
    os.replace(path + ".tmp", path)
    return given


def recorded_base(run_dir) -> str | None:
    """The base `run_base` recorded in `run_dir`: an --init-from folder, or None for one drawn from the seed.
    OSError, ValueError or KeyError where the run recorded none."""
    with open(os.path.join(run_dir, BASE)) as file:
        return json.load(file)["init_from"]


# Beside the params `axgen convert-hf` writes: the Hugging Face folder they came from and its tokenizer.json's
# sha256, which a run started from them (--init-from) compares with its dataset's.
SOURCE = "axgen_source.json"


def _source(path, key: str):
    """What convert-hf recorded beside the checkpoint under `key`; None where it recorded nothing."""
    try:
        with open(os.path.join(path, SOURCE)) as file:
            return json.load(file).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def tokenizer_of(path) -> str | None:
    """The sha256 of the tokenizer.json beside the checkpoint's source folder, where convert-hf recorded one."""
    return _source(path, "tokenizer_sha256")


def adapter_of(path) -> str | None:
    """The PEFT adapter folder whose adapters convert-hf wrote beside the base's params, where it was given one."""
    return _source(path, "adapter")


def restore_params(path, abstract, model: str):
    """Params from an `axgen convert-hf` checkpoint, restored straight into the shardings and dtypes of
    `abstract`."""
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(os.path.abspath(path), abstract)
    except (OSError, ValueError, KeyError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SystemExit(f"error: {path} does not hold {model}'s params: {first_line}")


class Unreadable(Exception):
    """A checkpoint read on the host that cannot be read, or none of whose steps verifies: one line saying why."""


def read_on_host(path) -> dict:
    """An orbax checkpoint item (a step's `state`, or the params `axgen convert-hf` writes) as numpy arrays on the
    host, in the dtypes saved; `Unreadable`, naming the path and the first line of the error, where it cannot be
    read."""
    try:
        with unreported_read_errors():
            with ocp.StandardCheckpointer() as checkpointer:
                restored = checkpointer.restore(os.path.abspath(path))
    except (OSError, ValueError, KeyError) as err:
        why = (str(err).strip().splitlines() or [type(err).__name__])[0].split(" [tensorstore_spec=")[0]
        raise Unreadable(f"{path}: not a readable orbax checkpoint ({why})") from None
    return jax.tree.map(np.asarray, restored)


def newest_verified_on_host(directory, item: str = "params") -> dict:
    """`state[item]` of the newest step in `directory` (a run's RUN_DIR/checkpoints) whose arrays of that item
    match the checksums saved with them, read on the host (`host_checksum`); a damaged newer step is named in a
    warning, as `newest_verified` names it, and skipped (left in place: this reads, it does not repair).
    `Unreadable` where no step verifies."""
    steps = sorted((int(name), name) for name in os.listdir(directory) if name.isdigit())
    for step, name in reversed(steps):
        path = os.path.join(directory, name)
        try:
            state = read_on_host(os.path.join(path, "state"))
            with open(os.path.join(path, "checksums", "metadata")) as f:
                recorded = json.load(f)
            problem = _host_verify({item: state[item]}, recorded)
        except (Unreadable, OSError, ValueError, KeyError) as err:
            problem = str(err)
        if problem is None:
            return state[item]
        print(
            f"warning: checkpoint step {step} in {directory} is damaged: {problem}",
            file=sys.stderr,
            flush=True,
        )
    raise Unreadable(f"no checkpoint in {directory} verifies")


def _host_verify(state: dict, recorded: dict) -> str | None:
    """Why `state` (numpy arrays) does not match the checksums `save` recorded with it; None where it does."""
    for path, array in jax.tree.leaves_with_path(state):
        name = jax.tree_util.keystr(path)
        if recorded.get(name) != host_checksum(array):
            return f"the checksum of state{name} differs from the one saved with it"
    return None
