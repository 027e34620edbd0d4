"""The emitted CPU program trains on 8 fake devices, evaluates, logs, resumes exactly, and shards without changing
results."""

import fcntl
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from tests.conftest import (
    CPU_8,
    ROOT,
    losses_in,
    program_args,
    run_in_process,
    train,
    train_in_process,
)

from axgen.cli import main as axgen
from axgen.interop import load_program
from axgen.runtime.program import Program

CPU_1 = ROOT / "generated/llama_tiny/cpu_1.py"


def checkpoints(run_dir) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def records(run_dir, key):
    """{step: value} of `key` in run_dir/metrics.jsonl, the last record of a step winning."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r[key] for r in map(json.loads, lines) if key in r}


def test_loss_falls_and_resume_matches_uninterrupted_run_bit_for_bit(shared_run):
    first, second, last = (losses_in(log) for log in shared_run.logs)
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4] and sorted(last) == list(range(5, 21))
    assert "resumed from step 4" in shared_run.logs[2]
    # The start line names what its last figure timed: reading a checkpoint, or initialising where none was read.
    assert re.search(
        r"initialised from seed \(start-up [\d.]+s, compile [\d.]+s, init [\d.]+s\)", shared_run.logs[0]
    )
    assert re.search(
        r"resumed from step 4 \(start-up [\d.]+s, compile [\d.]+s, restore [\d.]+s\)", shared_run.logs[2]
    )
    assert checkpoints(shared_run.two_checkpoints) == [2, 4], "saved at each run's end only, none between"
    assert checkpoints(shared_run.resumed) == [2, 4, 20]

    uninterrupted = shared_run.losses
    assert sorted(uninterrupted) == list(range(1, 21))
    assert uninterrupted[20] < uninterrupted[1] - 1.5, uninterrupted
    losses = records(shared_run.uninterrupted, "loss")
    assert sorted(losses) == list(range(1, 21))
    assert (
        records(shared_run.resumed, "loss") == losses
    ), "the resumed run's losses are the uninterrupted run's"
    evals = records(shared_run.uninterrupted, "eval_loss")
    assert sorted(evals) == [10, 20] and evals[20] < evals[10]
    resumed_evals = records(shared_run.resumed, "eval_loss")
    assert sorted(resumed_evals) == [2, 4, 10, 20], "each run evaluates at its end"
    assert (resumed_evals[10], resumed_evals[20]) == (evals[10], evals[20])


def test_a_run_logs_metrics_and_tensorboard_events_and_its_report_draws_them(shared_run, tmp_path):
    log = shared_run.uninterrupted_log
    assert "eval step 20 | loss" in log and "perplexity" in log and "s left" in log
    last = json.loads((shared_run.uninterrupted / "metrics.jsonl").read_text().splitlines()[-2])
    assert last["step"] == 20 and last["tokens"] == 20 * 16 * 128
    assert {"loss", "cross_entropy", "grad_norm", "lr", "tokens_per_second", "elapsed_s"} <= set(last)
    # 8 fake devices on a host's cores have no published peak: tokens/s, and no MFU, on the line and in the log.
    assert "mfu" not in last and "mfu" not in log
    # Each start says what ran and how it began, with the learning rate of every step of its schedule.
    first = json.loads((shared_run.uninterrupted / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["run"]["target"] == "cpu-8" and first["run"]["model"] == "llama-tiny"
    assert first["run"]["began"] == "initialised from seed"
    schedule = dict(first["run"]["lr_schedule"])
    assert sorted(schedule) == list(range(401)), "every step of Train.steps=400"
    assert schedule[0] == 0.0 and schedule[20] == pytest.approx(3e-3) and schedule[400] == pytest.approx(3e-4)
    assert [p.name.split(".")[0] for p in (shared_run.uninterrupted / "tensorboard").iterdir()] == ["events"]
    run_dir = (
        tmp_path / "run"
    )  # the report is written into the run dir: a copy keeps the shared one as it ran
    shutil.copytree(shared_run.uninterrupted, run_dir)
    assert axgen(["report", str(run_dir)]) == 0
    assert (run_dir / "report.png").read_bytes().startswith(b"\x89PNG")


def test_sharded_forward_equals_single_device_forward():
    program = load_program(CPU_8)
    params = program.init_params(jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (8, 32), 0, 256)
    single = program.forward(params, tokens)

    mesh = Program.from_module(program).make_mesh()
    assert mesh.devices.size == 8
    with jax.set_mesh(mesh):
        sharded_params = jax.device_put(params, Program.from_module(program).param_shardings(mesh))
        assert not sharded_params["layers"]["wq"].sharding.is_fully_replicated
        sharded = jax.jit(program.forward)(sharded_params, tokens)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-5, atol=1e-5)


def test_a_second_run_on_the_same_directory_is_refused_naming_the_first_and_so_are_steps_it_reached(
    corpus, tmp_path
):
    # flock locks an open file, not a process: a run in this process is refused as one in another would be.
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(f"pid {os.getpid()} on this test")
        held.flush()
        result = run_in_process(CPU_8, *program_args(corpus, tmp_path, 2))
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == f"error: {tmp_path} is in use by another run (pid {os.getpid()} on this test)"
    )
    assert not (tmp_path / "checkpoints").exists()
    train_in_process(CPU_8, corpus, tmp_path, 2)  # the lock of a run that ended does not hold
    result = run_in_process(CPU_8, *program_args(corpus, tmp_path, 2))
    assert result.returncode == 2
    assert result.stderr.strip().endswith(
        f"error: --steps 2 is not beyond step 2, where {tmp_path / 'checkpoints'} resumes"
    )
    assert checkpoints(tmp_path) == [2]


def test_a_restarted_run_reuses_its_compiled_step_from_the_cache(corpus, tmp_path):
    # jax keeps an executable whose compile took over a second: the train step's always; small ones (a checksum)
    # only when the machine is loaded, so only the train step's are compared.
    cache = tmp_path / "cache"
    train(CPU_1, corpus, tmp_path / "run", 2, "--compilation-cache", str(cache))
    entries = sorted(p.name for p in cache.glob("jit_train_step*"))
    assert entries, "the train step's executable is kept"
    train(CPU_1, corpus, tmp_path / "run", 4, "--compilation-cache", str(cache))
    assert (
        sorted(p.name for p in cache.glob("jit_train_step*")) == entries
    ), "the resumed run compiled no new step"


def test_a_cpu_mesh_of_several_devices_keeps_no_compiled_steps(shared_run):
    """Read back from the cache, XLA:CPU executables deadlocked in their collectives (3 runs in 5): the shared
    run was given a cache folder."""
    assert not shared_run.cache.exists()
