"""`python PROGRAM.py --data D --run-dir R`: the training run every emitted program hands its steps to."""

import argparse
import os
import sys
import time

import jax

from axgen.runtime import checkpoints
from axgen.runtime.dataset import (
    Batches,
    DatasetError,
    PackedSplit,
    check_same_tokenizer,
    check_vocabulary,
    prefetched,
    read_manifest,
)
from axgen.runtime.faults import NonFiniteGuard, RunDirError, StopSignals, lock_run_dir, make_run_dir
from axgen.runtime.metrics import MetricsLog, Progress, schedule_points
from axgen.runtime.program import IncompatibleProgram, Program
from axgen.runtime.training import BatchSplitError


def main(module, argv=None) -> int:
    """Trains the program `module` defines on an `axgen data` directory; the exit code: 0 done or stopped by a
    signal with a checkpoint, 2 bad input (a flag, a dataset, a run dir, a program this runtime cannot run)
    refused before jax starts, 1 an error during the run."""
    began = time.perf_counter()
    try:
        program = Program.from_module(module)
    except IncompatibleProgram as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args = parse_args(program, argv, description=(module.__doc__ or "").strip().splitlines()[0])
    try:
        train_data, eval_data, eval_batches = open_data(program, args)
        created = make_run_dir(args.run_dir)
        if program.has_frozen:
            args.init_from = checkpoints.run_base(args.run_dir, args.init_from)
    except (DatasetError, RunDirError, ValueError) as refused:  # refused before jax starts, as a bad flag is
        print(f"error: {refused}", file=sys.stderr)
        return 2
    try:
        return train(program, args, train_data, eval_data, eval_batches, began, created)
    except DatasetError as err:  # a batch that the manifest did not announce
        print(f"error: {err}", file=sys.stderr)
        return 1


def train(program: Program, args, train_data, eval_data, eval_batches, began, created) -> int:
    """The run; `created` are the folders main made for RUN_DIR, which a run that fails removes when empty."""
    config = program.config
    configure_jax(program, args)
    check_device_count(program)
    mesh = program.make_mesh()
    directory = os.path.abspath(os.path.join(args.run_dir, "checkpoints"))
    created = ([] if os.path.lexists(directory) else [directory]) + created
    with (
        lock_run_dir(args.run_dir, created),
        jax.set_mesh(mesh),
        checkpoints.manager(directory, config["checkpoint_every"]) as manager,
        MetricsLog(args.run_dir) as log,
        StopSignals(mesh) as stop,
    ):
        if (manager.latest_step() or 0) >= args.steps:
            print(
                f"error: --steps {args.steps} is not beyond step {manager.latest_step()}, where {directory} resumes",
                file=sys.stderr,
            )
            return 2  # out of the with first: orbax's threads stop before the interpreter does
        started = time.perf_counter()
        step_fn, eval_fn = compile_checked(program, mesh, args.batch, evaluating=eval_data is not None)
        compiled = time.perf_counter()
        state, origin, how = restore_or_init(program, manager, mesh, args)
        start, restored = int(state["step"]), time.perf_counter()
        sharding = program.batch_sharding(mesh, args.batch)
        print(
            f"{config['model']} on {jax.device_count()} devices, mesh {program.mesh_shape}, batch {args.batch} in"
            f" {program.accumulation_steps(args.batch)} pass(es) of {program.microbatch} sequence(s) per device:"
            f" {origin} (start-up"
            f" {started - began:.1f}s, compile {compiled - started:.1f}s, {how} {restored - compiled:.1f}s)",
            flush=True,
        )
        log.start(
            start,
            model=config["model"],
            spec=config["spec"],
            target=program.target,
            devices=jax.device_count(),
            mesh=program.mesh_shape,
            began=origin,
            lr_schedule=schedule_points(program.learning_rate, config["steps"], config["warmup_steps"]),
        )
        progress = Progress(
            log,
            start,
            args.steps,
            args.batch * config["seq_len"],
            config["flops_per_token"],
            program.peak_flops_per_device,
            program.logged_metrics,
        )
        guard = NonFiniteGuard(args.max_bad_steps)
        steps, stopping = range(start, args.steps), False
        for step, local_batch in zip(steps, prefetched(train_data.local_batch, steps)):
            state, metrics = step_fn(
                state, *(jax.make_array_from_process_local_data(sharding, x) for x in local_batch)
            )
            done = step + 1
            guard.after(done, metrics["skipped"])
            stopping = stop.requested(state)
            if step == start or done % args.log_every == 0 or done == args.steps or stopping:
                progress.train(done, jax.device_get(metrics))
            if eval_data and (done % args.eval_every == 0 or done == args.steps):
                params = program.model_params(state)
                progress.eval(
                    done,
                    *evaluate(eval_fn, params, eval_data, sharding, eval_batches),
                    pairs=eval_data.split.pairs,
                )
            if done % config["checkpoint_every"] == 0:
                checkpoints.save(manager, state)
            if stopping:
                break
        guard.finish()
        if manager.latest_step() != int(state["step"]):
            checkpoints.save(manager, state, force=True)
        manager.wait_until_finished()
        stopped = (
            f"stopped by {stop.received or 'a signal to another process'} at step {done}; "
            if stopping
            else ""
        )
        print(f"{stopped}checkpoint: step {manager.latest_step()} in {directory}", flush=True)
    return 0


def configure_jax(program: Program, args) -> None:
    """Sets the target's platform and flags before jax starts its backend, and joins the other processes of the job
    when there are several: from --coordinator/--num-processes/--process-id (or JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID), else as jax detects the cluster (TPU pod, SLURM). With a compilation cache
    folder, compiled steps persist there: a restarted run does not compile again."""
    platform = os.environ.get("JAX_PLATFORMS") or program.platform
    jax.config.update("jax_platforms", platform)
    # On CPU, executables read back from the cache deadlocked in collectives between devices (jax 0.12.0.1, 3
    # runs in 5): a CPU mesh of several devices compiles afresh.
    if args.compilation_cache and (platform != "cpu" or program.num_devices == 1):
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    # The user's own flags come last, so they win over the target's.
    for variable, flags in program.compiler_flags.items():
        os.environ[variable] = " ".join([*flags, os.environ.get(variable, "")]).strip()
    if program.memory_fraction:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(program.memory_fraction))
    if program.num_hosts == 1 and (args.num_processes or 1) == 1:
        return
    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A process whose peer died gets jax's error naming it once the peer misses its heartbeats, instead of waiting
    # in a collective forever.
    jax.distributed.initialize(
        args.coordinator,
        args.num_processes,
        args.process_id,
        heartbeat_timeout_seconds=args.heartbeat_timeout,
    )


def check_device_count(program: Program) -> None:
    if jax.device_count() != program.num_devices:
        raise SystemExit(
            f"error: the mesh {program.mesh_shape} needs {program.num_devices} devices; this job has"
            f" {jax.device_count()} ({jax.process_count()} process(es) of {jax.local_device_count()})"
        )


def device_memory_limit() -> int:
    """Bytes one device here may hold: its allocator's limit, or on CPU this host's memory over its devices."""
    stats = jax.local_devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // jax.local_device_count()


def compile_checked(program: Program, mesh, global_batch, evaluating: bool):
    """The train step and, when evaluating, the eval step, compiled ahead of time for this batch; a step XLA says
    needs more memory than a device here has is refused before anything is allocated, instead of failing (or
    swapping) later, at the first evaluation say."""
    limit = device_memory_limit()
    steps = [("a training", program.compile_train_step)]
    steps += [("an evaluation", program.compile_eval_step)] if evaluating else []
    compiled = []
    for what, compile_step in steps:
        step, needed = compile_step(mesh, global_batch)
        if needed > limit:
            raise SystemExit(
                f"error: {what} step of {program.config['model']} at --batch {global_batch} needs"
                f" {needed / 2**30:.1f} GiB per device (XLA's estimate) and a {jax.devices()[0].platform} device"
                f" here has {limit / 2**30:.1f} GiB; use more devices or a smaller model or batch"
            )
        compiled.append(step)
    return compiled[0], compiled[1] if evaluating else None


def restore_or_init(program: Program, manager, mesh, args):
    """The newest checkpoint of this run that verifies; else the params of --init-from with a fresh optimizer;
    else a seeded init. Returns the state, where it came from in words, and what the start line calls the time
    it took (restore, or init where nothing was read)."""
    saved = checkpoints.saved_part(program.abstract_state(mesh))
    state, step = checkpoints.newest_verified(manager, mesh, args.run_dir, saved)
    if state is not None and program.has_frozen:  # what it trains against (base, reference), as it began
        state = {**state, "frozen": program.frozen_part(initial_params(program, mesh, args))}
    if state is not None:
        return state, f"resumed from step {step}", "restore"
    shardings = program.state_shardings(mesh)
    if args.init_from:
        params = initial_params(program, mesh, args)
        state = jax.jit(program.state_from_params, out_shardings=shardings)(params)
        return state, f"params from {args.init_from}, a fresh optimizer state", "restore"
    state = jax.jit(program.init_state, out_shardings=shardings)(jax.random.key(program.config["seed"]))
    return state, "initialised from seed", "init"


def initial_params(program: Program, mesh, args):
    """The params a run begins with: those of --init-from, else drawn from the seed."""
    if args.init_from:
        return program.restore_params(args.init_from, mesh)
    draw = jax.jit(program.init_params, out_shardings=program.param_shardings(mesh))
    return draw(jax.random.key(program.config["seed"]))


def evaluate(eval_fn, params, data, batch_sharding, num_batches):
    """Mean loss over the first `num_batches` batches of the eval split, in its stored order, and the number of
    targets (preference pairs) it counts: the cross-entropy of each target, or the preference loss of each pair.
    """
    loss_sum, targets = 0.0, 0
    for step in range(num_batches):
        batch = (jax.make_array_from_process_local_data(batch_sharding, x) for x in data.local_batch(step))
        sums = jax.device_get(eval_fn(params, *batch))
        loss_sum, targets = loss_sum + float(sums["loss_sum"]), targets + int(sums["targets"])
    return loss_sum / max(targets, 1), targets


def _check_tokenizer(init_from, data) -> None:
    """A warning where the params' own tokenizer (convert-hf recorded its sha256) did not make the dataset: its
    ids would name other words than the ones the model learned. Not an error: a re-saved tokenizer.json can
    differ in bytes and not in ids."""
    model, dataset = checkpoints.tokenizer_of(init_from), read_manifest(data)["tokenizer"].get("sha256")
    if model and dataset and model != dataset:
        print(
            f"warning: --init-from {init_from} was converted from a folder whose tokenizer.json (sha256"
            f" {model[:12]}) is not the one that made {data} (sha256 {dataset[:12]}): make the dataset with the"
            " model's own tokenizer, or the ids mean other words",
            file=sys.stderr,
        )


def open_data(program: Program, args):
    """The training batches and, when evaluating, the eval batches: every dataset is checked before jax starts."""
    config, documents = program.config, not args.no_document_mask
    vocab_size = config["vocab_size"]
    check_vocabulary(args.data, vocab_size, config["spec"])
    if args.init_from:
        _check_tokenizer(args.init_from, args.data)
    train = PackedSplit(args.data, "train", config["seq_len"])
    check_objective(program, args, args.data, train)
    if train.cut_conversations:
        span = config["seq_len"] + 1
        print(
            f"warning: {args.data}: {train.cut_conversations} conversations are longer than a window of seq_len + 1"
            f" = {span} tokens, so each trains only its first {span} (`axgen data --max-len {span}` cuts them"
            " between turns instead)",
            file=sys.stderr,
        )
    batches = Batches(train, args.batch, config["seed"], vocab_size, documents=documents)
    if not args.eval_every:
        return batches, None, 0
    eval_dir = args.eval_data or args.data
    check_vocabulary(eval_dir, vocab_size, config["spec"])
    if args.eval_data:
        check_same_tokenizer(args.data, args.eval_data)
    split = PackedSplit(eval_dir, "eval", config["seq_len"])
    check_objective(program, args, eval_dir, split)
    if not len(split.shards):
        raise DatasetError(
            f"{eval_dir} has no eval split: pass --eval-data, or make one with `axgen data --eval-fraction`"
        )
    # Whole batches of the split in order, so every evaluation sees the same windows.
    num_batches = min(args.eval_batches, max(1, len(split) // args.batch))
    return (
        batches,
        Batches(split, args.batch, config["seed"], vocab_size, shuffle=False, documents=documents),
        num_batches,
    )


def check_objective(program: Program, args, directory, split: PackedSplit) -> None:
    """A preference loss (F.dpo, F.simpo) trains on pairs, and every other program on text or conversations: a
    dataset of the other kind is refused, as is --no-document-mask, which would let a pair's two sequences see
    each other."""
    objective = program.config.get("objective")
    if objective and not split.pairs:
        raise DatasetError(
            f"{directory} holds no preference pairs, and {program.config['model']} trains {objective} on them:"
            " write them with `axgen data --pairs`"
        )
    if split.pairs and not objective:
        raise DatasetError(
            f"{directory} holds preference pairs, which a program trains only with F.dpo or F.simpo in its spec"
            f" ({program.config['spec']} has neither)"
        )
    if split.pairs and args.no_document_mask:
        raise DatasetError(
            f"--no-document-mask: {directory} holds preference pairs, whose chosen and rejected sequences must"
            " not see each other"
        )


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonnegative(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


class OneLineErrors(argparse.ArgumentParser):
    """argparse whose errors are one line, exit 2; the usage is for --help."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(program: Program, argv, description=None):
    config = program.config
    parser = OneLineErrors(description=description)
    parser.add_argument("--data", required=True, help="dataset directory written by `axgen data`")
    parser.add_argument(
        "--run-dir", required=True, help="checkpoints (the newest is resumed), metrics.jsonl, TensorBoard"
    )
    parser.add_argument("--steps", type=positive, default=config["steps"], help="stop after this global step")
    parser.add_argument(
        "--batch", type=positive, default=config["global_batch"], help="global batch in sequences"
    )
    parser.add_argument("--log-every", type=positive, default=10)
    parser.add_argument(
        "--eval-every",
        type=nonnegative,
        default=0,
        help="steps between evaluations, and one at the end (0: none)",
    )
    parser.add_argument(
        "--eval-batches", type=positive, default=10, help="at most this many batches per evaluation"
    )
    parser.add_argument(
        "--eval-data", help="dataset directory to evaluate on (default: the eval split of --data)"
    )
    parser.add_argument(
        "--compilation-cache",
        default=os.path.join(os.path.expanduser("~"), ".cache", "axgen", "jax"),
        help="folder of compiled steps a restarted run reuses ('' turns it off; unused by a CPU mesh of several devices)",
    )
    parser.add_argument(
        "--max-bad-steps", type=positive, default=10, help="non-finite steps in a row that stop the run"
    )
    parser.add_argument(
        "--init-from", help="`axgen convert-hf` checkpoint to start from when --run-dir has none"
    )
    parser.add_argument(
        "--coordinator",
        default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
        help="host:port of process 0, when the job has several processes",
    )
    parser.add_argument(
        "--num-processes",
        type=positive,
        default=os.environ.get("JAX_NUM_PROCESSES"),
        help="processes in the job",
    )
    parser.add_argument(
        "--process-id",
        type=nonnegative,
        default=os.environ.get("JAX_PROCESS_ID"),
        help="this process's index in the job",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=positive,
        default=100,
        help="seconds before a silent process is declared dead and the job stops",
    )
    parser.add_argument(
        "--no-document-mask",
        action="store_true",
        help="let attention and positions run across the documents packed into a sequence",
    )
    args = parser.parse_args(argv)
    try:
        program.accumulation_steps(args.batch)
    except BatchSplitError as err:
        parser.error(f"--batch {args.batch}: {err}")
    if args.eval_data and not args.eval_every:
        parser.error(
            f"--eval-data {args.eval_data}: evaluates only every --eval-every N steps: add --eval-every"
        )
    check_processes(parser, args)
    return args


def check_processes(parser, args) -> None:
    """The job's processes as the flags (or the JAX_* variables) give them, refused here when jax would refuse
    them: its error comes as a traceback, once the run dir is made."""
    count, index = args.num_processes, args.process_id
    if count is None:
        return  # one process, or as many as jax detects in the cluster (TPU pod, SLURM)
    if index is not None and index >= count:
        parser.error(f"--process-id {index}: must be below --num-processes {count}")
    if count > 1 and args.coordinator is None:
        parser.error(
            f"--num-processes {count}: add --coordinator HOST:PORT (or JAX_COORDINATOR_ADDRESS), where"
            " process 0 listens"
        )
    if count > 1 and index is None:
        parser.error(
            f"--num-processes {count}: add --process-id (or JAX_PROCESS_ID), this process's index from 0 to"
            f" {count - 1}"
        )
