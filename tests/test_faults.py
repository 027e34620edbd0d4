"""The emitted CPU program under what clusters do to a run: preemption signals, damaged checkpoints, a model too big
for the machine, and several processes (one of them killed)."""

import json
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from tests.conftest import CPU_8, FAKE_DEVICES, PROGRAM_ENV, ROOT, program_args, python_result, run_in_process

from bench.faults import DAMAGE, flip_a_bit, truncate

from axgen.cli import main as axgen
from axgen.runtime.faults import lock_run_dir, make_run_dir

CPU_1 = ROOT / "generated/llama_tiny/cpu_1.py"


def checkpoints(run_dir) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def losses(run_dir) -> dict[int, float]:
    """{step: loss} of run_dir/metrics.jsonl, the last record of a step winning."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def start(run_dir, data, steps, *extra, env=PROGRAM_ENV):
    return subprocess.Popen(
        [sys.executable, "-u", str(CPU_8), *program_args(data, run_dir, steps), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )


def read_until(process, text) -> list[str]:
    """The lines `process` prints up to and including the first holding `text`."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} never printed; stderr: {process.stderr.read()[-2000:]}")


def test_sigterm_finishes_the_step_saves_and_exits_0(corpus, tmp_path):
    run = start(tmp_path, corpus, 1000)
    read_until(run, "step 3 |")
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err[:3000]
    assert "SIGTERM: stopping with a checkpoint after this step" in out
    stopped = int(out.split("stopped by SIGTERM at step ")[1].split(";")[0])
    assert checkpoints(tmp_path) == [stopped]
    assert f"checkpoint: step {stopped} in {tmp_path / 'checkpoints'}" in out
    assert max(losses(tmp_path)) == stopped, "every step that ran is logged and saved"


def test_a_second_signal_stops_at_once(corpus, tmp_path):
    run = start(tmp_path, corpus, 1000)
    read_until(run, "step 2 |")
    run.send_signal(signal.SIGINT)
    read_until(run, "SIGINT: stopping")
    run.send_signal(signal.SIGINT)
    run.communicate(timeout=120)
    assert run.returncode == -signal.SIGINT


@pytest.fixture(scope="module")
def two_checkpoints(shared_run):
    """A run with checkpoints at steps 2 and 4, and the losses of steps 1 to 20 run without a stop."""
    return shared_run.two_checkpoints, shared_run.losses


def up_to(losses_by_step, last):
    return {step: loss for step, loss in losses_by_step.items() if step <= last}


# A failed read, a checksum that differs, a step without files; bench/faults.py runs every kind of DAMAGE.
@pytest.mark.parametrize(
    "damage", ["a bit flipped in array data", "an array file truncated", "step folder emptied"]
)
def test_a_damaged_checkpoint_is_named_set_aside_and_the_run_resumes_from_the_one_before(
    two_checkpoints, tmp_path, damage, corpus
):
    source, reference = two_checkpoints
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    DAMAGE[damage](run_dir / "checkpoints" / "4")

    result = run_in_process(CPU_8, *program_args(corpus, run_dir, 6))
    assert result.returncode == 0, result.stderr[-2000:]
    warning = f"warning: checkpoint step 4 in {run_dir / 'checkpoints'} is damaged: "
    assert warning in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "resumed from step 2" in result.stdout
    assert checkpoints(run_dir) == [2, 6]
    assert [p.name.split("-")[0] for p in (run_dir / "damaged").iterdir()] == ["4"], "kept, not deleted"
    assert losses(run_dir) == up_to(reference, 6), "steps 3 to 6 ran again exactly as without the damage"


# slow tier: a program built, killed mid-save and resumed, two processes and two compiles
@pytest.mark.slow
def test_kill_9_mid_save_resumes_from_the_last_complete_checkpoint_losing_nothing(
    two_checkpoints, corpus, tmp_path
):
    source, reference = two_checkpoints
    spec = tmp_path / "tiny_every2.py"
    spec.write_text(
        "from axgen.specs.llama_tiny import spec as tiny\n\n"
        "spec = tiny.replace(train=tiny.train.replace(checkpoint_every=2))\n"
    )
    program = tmp_path / "every2.py"
    assert axgen(["build", str(spec), "--target", "cpu-8", "--out", str(program)]) == 0
    args = program_args(corpus, tmp_path / "run", 6)
    run = subprocess.Popen([sys.executable, str(program), *args], stdout=subprocess.DEVNULL, env=PROGRAM_ENV)
    saves = tmp_path / "run" / "checkpoints"
    while run.poll() is None and not any(
        "tmp" in p.name and p.name.startswith("4") for p in (saves.iterdir() if saves.exists() else [])
    ):
        time.sleep(0.001)
    run.kill()
    run.wait()
    assert checkpoints(tmp_path / "run") == [2], "killed while step 4 was being written"

    result = python_result(program, *args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from step 2" in result.stdout
    assert losses(tmp_path / "run") == up_to(reference, 6)


def test_when_no_checkpoint_verifies_the_run_stops_and_keeps_them(two_checkpoints, tmp_path, corpus):
    source, _ = two_checkpoints
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    flip_a_bit(run_dir / "checkpoints" / "4")
    truncate(run_dir / "checkpoints" / "2")

    result = run_in_process(CPU_8, *program_args(corpus, run_dir, 6))
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 3, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: no checkpoint in {run_dir / 'checkpoints'} verifies (steps 4, 2); move them away to start this run"
        " afresh"
    )
    assert checkpoints(run_dir) == [2, 4] and not (run_dir / "damaged").exists()


def test_a_model_far_too_big_for_the_machine_is_refused_before_it_allocates(corpus, tmp_path):
    spec = tmp_path / "huge.py"
    text = (ROOT / "axgen/specs/llama_tiny.py").read_text().replace("d_model=128", "d_model=65536")
    spec.write_text(text.replace("hidden_dim=384", "hidden_dim=131072"))
    assert axgen(["build", str(spec), "--target", "cpu-8", "--out", str(tmp_path / "huge_program.py")]) == 0
    result = run_in_process(tmp_path / "huge_program.py", *program_args(corpus, tmp_path / "run", 2))
    assert result.returncode == 1, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: a training step of llama-tiny at --batch 16 needs "), line
    assert "GiB per device (XLA's estimate) and a cpu device here has" in line
    assert not (tmp_path / "run").exists(), "the run dir it made, and its lock and checkpoints, are removed"


def test_a_failed_init_from_leaves_the_run_dir_as_it_found_it(corpus, tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("not a checkpoint")
    run_dir = tmp_path / "runs" / "first"
    result = python_result(str(CPU_1), *program_args(corpus, run_dir, 2), "--init-from", tmp_path / "junk")
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: {tmp_path / 'junk'} does not hold llama-tiny's params: ")
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk"]


def test_a_failed_run_removes_its_lock_and_the_folders_it_made_only_while_empty(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)  # found there: kept, as the lock file found there is
    (run_dir / ".lock").write_text("pid 1 on an earlier run")
    with pytest.raises(SystemExit):
        with lock_run_dir(run_dir, make_run_dir(run_dir)):
            raise SystemExit("error: a failure before the first step")
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "checkpoints"]

    run_dir = tmp_path / "new"
    with pytest.raises(SystemExit):
        with lock_run_dir(run_dir, [str(run_dir / "checkpoints"), *make_run_dir(run_dir)]):
            (run_dir / "checkpoints").mkdir()
            (run_dir / "metrics.jsonl").write_text("{}\n")  # what the run wrote is kept, with its folder
            raise SystemExit("error: a failure after a step")
    assert [p.name for p in run_dir.iterdir()] == ["metrics.jsonl"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_processes(run_dir, data, steps, *extra):
    """The program as a job of two processes on loopback, each with 4 of the 8 fake CPU devices."""
    env = PROGRAM_ENV | {"XLA_FLAGS": f"{PROGRAM_ENV['XLA_FLAGS']} {FAKE_DEVICES}4"}
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        start(
            run_dir,
            data,
            steps,
            "--coordinator",
            coordinator,
            "--num-processes",
            "2",
            "--process-id",
            str(i),
            *extra,
            env=env,
        )
        for i in range(2)
    ]


def finish(processes):
    outputs = [process.communicate(timeout=300) for process in processes]
    for process, (_, err) in zip(processes, outputs):
        assert process.returncode == 0, err[-3000:]
    return outputs


# slow tier: four processes in two jobs of two, each compiling (40 s on 2 cores)
@pytest.mark.slow
def test_two_processes_of_four_devices_stop_together_save_and_resume_as_one_of_eight(
    two_checkpoints, corpus, tmp_path
):
    _, reference = two_checkpoints
    processes = start_processes(tmp_path, corpus, 1000)
    read_until(processes[1], "step 2 |")
    processes[1].send_signal(signal.SIGTERM)  # to one process only: both stop at one step
    outputs = finish(processes)
    [stopped] = {int(out.split(" at step ")[1].split(";")[0]) for out, _ in outputs}
    assert "stopped by a signal to another process at step" in outputs[0][0]
    assert "stopped by SIGTERM at step" in outputs[1][0]
    assert checkpoints(tmp_path) == [stopped] and stopped < 8

    finish(start_processes(tmp_path, corpus, 8))
    assert checkpoints(tmp_path) == [stopped, 8]
    # gloo's all-reduce adds in another order than one process's: a float32 rounding apart at most.
    assert losses(tmp_path) == pytest.approx(up_to(reference, 8), rel=1e-6)


# slow tier: two processes and a heartbeat timeout (20 s on 2 cores)
@pytest.mark.slow
def test_when_a_process_dies_its_peer_exits_with_an_error_in_bounded_time(corpus, tmp_path):
    survivor, victim = start_processes(tmp_path, corpus, 100000, "--heartbeat-timeout", "5")
    read_until(survivor, "step 2 |")
    victim.kill()
    killed = time.monotonic()
    _, err = survivor.communicate(timeout=120)
    assert survivor.returncode != 0
    assert time.monotonic() - killed < 60
    assert "another task died" in err or "unhealthy" in err, err[-2000:]
    victim.communicate()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "float8_e4m3fn"])
def test_the_hosts_checksum_is_the_devices(dtype):
    import jax
    import jax.numpy as jnp

    from axgen.runtime.checkpoints import checksum, host_checksum

    values = jax.random.normal(jax.random.key(0), (3, 1000, 7)) * 100
    array = values.astype(jnp.dtype(dtype))
    assert host_checksum(np.asarray(array), block=999) == int(checksum(array))
    flipped = np.asarray(array).copy().view(np.uint8)
    flipped.reshape(-1)[12345] ^= 1
    assert host_checksum(flipped.view(array.dtype)) != int(checksum(array))


def test_one_process_saves_a_replicated_array_without_a_program_per_replica_and_reads_it_back(
    tmp_path, caplog
):
    """orbax's replica-parallel write cuts each replicated array into parts by programs of their own (one per shape
    and device, compiled at the first save); in one process the run writes each array from one replica instead,
    and the checkpoint reads back to the bit."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from axgen.runtime import checkpoints

    mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    weights = jax.device_put(
        jax.random.normal(jax.random.key(0), (8, 24)), NamedSharding(mesh, P(None, "fsdp"))
    )
    state = {"step": jax.device_put(np.int32(1), NamedSharding(mesh, P())), "params": {"w": weights}}
    with checkpoints.manager(tmp_path, 1) as manager, jax.log_compiles(True):
        checkpoints.save(manager, state)
        manager.wait_until_finished()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        restored, damage = checkpoints.verified(manager, 1, abstract)
    slicing = [r.getMessage() for r in caplog.records if "Compiling jit(slice)" in r.getMessage()]
    assert not slicing, slicing[:2]
    assert damage is None
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.asarray(weights))


def test_export_hf_takes_the_newest_checkpoint_whose_params_verify(two_checkpoints, tmp_path, capsys):
    source, _ = two_checkpoints
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    recorded = run_dir / "checkpoints/4/checksums/metadata"
    checksums = json.loads(recorded.read_text())
    checksums["['params']['embed']"] ^= 1
    recorded.write_text(json.dumps(checksums))

    spec = ROOT / "axgen/specs/llama_tiny.py"
    assert axgen(["export-hf", str(spec), "--ckpt", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().err.startswith(
        f"warning: checkpoint step 4 in {run_dir / 'checkpoints'} is damaged: the checksum of"
        " state['params']['embed'] differs from the one saved with it"
    )
    assert (tmp_path / "hf/config.json").exists()
