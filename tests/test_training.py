"""The emitted CPU program trains on 8 fake devices, evaluates, logs, resumes exactly, and shards without changing
results."""

import concurrent.futures
import fcntl
import json
import os

import jax
import numpy as np
from tests.conftest import ROOT, program_args, python_result, train, train_log

from axgen.cli import main as axgen
from axgen.interop import load_program
from axgen.runtime.program import Program

CPU_8 = ROOT / "generated/llama_tiny/cpu_8.py"
CPU_1 = ROOT / "generated/llama_tiny/cpu_1.py"
EVAL = ("--eval-every", "10", "--eval-batches", "2")


def checkpoints(run_dir) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def records(run_dir, key):
    """{step: value} of `key` in run_dir/metrics.jsonl, the last record of a step winning."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r[key] for r in map(json.loads, lines) if key in r}


def test_loss_falls_and_resume_matches_uninterrupted_run_bit_for_bit(corpus, tmp_path):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # separate processes: side by side on two cores
        uninterrupted, _ = pool.map(
            lambda run: train(CPU_8, corpus, tmp_path / run[0], run[1], *EVAL), [("a", 20), ("b", 8)]
        )
    assert checkpoints(tmp_path / "b") == [8], "saved at the end only: no save of step 1, none between"
    second_half = train(CPU_8, corpus, tmp_path / "b", 20, *EVAL)
    assert checkpoints(tmp_path / "b") == [8, 20]

    assert sorted(uninterrupted) == list(range(1, 21))
    assert uninterrupted[20] < uninterrupted[1] - 1.5, uninterrupted
    assert sorted(second_half) == list(range(9, 21)), "the second run must resume at step 9"
    losses = records(tmp_path / "a", "loss")
    assert sorted(losses) == list(range(1, 21))
    assert records(tmp_path / "b", "loss") == losses, "the resumed run's losses are the uninterrupted run's"
    evals = records(tmp_path / "a", "eval_loss")
    assert sorted(evals) == [10, 20] and evals[20] < evals[10]
    resumed_evals = records(tmp_path / "b", "eval_loss")
    assert sorted(resumed_evals) == [8, 10, 20], "each run evaluates at its end"
    assert (resumed_evals[10], resumed_evals[20]) == (evals[10], evals[20])


def test_a_run_logs_metrics_and_tensorboard_events_and_its_report_draws_them(corpus, tmp_path):
    log = train_log(CPU_8, corpus, tmp_path, 12, "--log-every", "4", *EVAL)
    assert "eval step 12 | loss" in log and "perplexity" in log and "s left" in log
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-2])
    assert last["step"] == 12 and last["tokens"] == 12 * 16 * 128
    assert {"loss", "cross_entropy", "grad_norm", "lr", "tokens_per_second", "mfu", "elapsed_s"} <= set(last)
    assert [p.name.split(".")[0] for p in (tmp_path / "tensorboard").iterdir()] == ["events"]
    assert axgen(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.png").read_bytes().startswith(b"\x89PNG")


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
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(f"pid {os.getpid()} on this test")
        held.flush()
        result = python_result(str(CPU_8), *program_args(corpus, tmp_path, 2))
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == f"error: {tmp_path} is in use by another run (pid {os.getpid()} on this test)"
    )
    assert not (tmp_path / "checkpoints").exists()
    train(CPU_8, corpus, tmp_path, 2)  # the lock of a run that ended does not hold
    result = python_result(str(CPU_8), *program_args(corpus, tmp_path, 2))
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


def test_a_cpu_mesh_of_several_devices_keeps_no_compiled_steps(corpus, tmp_path):
    """Read back from the cache, XLA:CPU executables deadlocked in their collectives (3 runs in 5)."""
    train(CPU_8, corpus, tmp_path / "run", 2, "--compilation-cache", str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()
