"""The fault matrix: what an emitted program does when the cluster kills it, preempts it, damages its checkpoints,
feeds it NaNs, or is given bad flags. One table: case, expected, observed, data lost, recovery seconds.

    .venv/bin/python bench/faults.py [--kills 4] [--seed 0]

The program is llama_tiny for cpu-8 with a checkpoint every 3 steps, trained for 12 steps on the demo corpus in
byte tokens. Every case that resumes runs to the end, and its metrics.jsonl (the last record of a step winning) is
compared with an uninterrupted run's: "data lost" names any step whose loss differs, or any step the run never
reached. Recovery is the seconds from the fault to the resumed run's first step: what a failure costs a cluster.
"""

from __future__ import annotations

import os

# Before jax is imported (to write the NaN case's params): this bench runs on the host.
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import json
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from axgen.build import build
from axgen.data.corpus import module_sources
from axgen.data.datasets import write_dataset
from axgen.files import write_atomically

ROOT = Path(__file__).resolve().parent.parent
STEPS, CHECKPOINT_EVERY = 12, 3
SPEC = f"""from axgen.specs.llama_tiny import spec as tiny

spec = tiny.replace(train=tiny.train.replace(checkpoint_every={CHECKPOINT_EVERY}))
"""
# A program runs as a user runs it: no inherited XLA_FLAGS to override its own fake device count.
ENV = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
START_LINE = re.compile(r"\(start-up ([0-9.]+)s, compile ([0-9.]+)s, restore ([0-9.]+)s\)")


class Run:
    """One program process in a run directory, its output collected line by line."""

    def __init__(self, program, work, run_dir, *extra, env=ENV, steps=STEPS):
        data = work / "data"
        argv = [sys.executable, "-u", str(program), "--data", str(data), "--run-dir", str(run_dir)]
        argv += ["--steps", str(steps), "--log-every", "1", *extra]
        self.began = time.monotonic()
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines = []

    def wait_for(self, text):
        for line in self.process.stdout:
            self.lines.append(line)
            if text in line:
                return time.monotonic()
        return None

    def finish(self, timeout=300):
        out, err = self.process.communicate(timeout=timeout)
        self.lines += out.splitlines(keepends=True)
        self.stdout, self.stderr = "".join(self.lines), err
        return self.process.returncode


def losses(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    records = map(json.loads, path.read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def lost(run_dir, reference):
    got = losses(run_dir)
    wrong = [step for step in reference if got.get(step) != reference[step]]
    return "none" if not wrong else f"steps {wrong[0]}..{wrong[-1]} differ or are missing"


def resume(program, work, run_dir, fault_time, reference):
    """Runs to the end after a fault; returns (observed, data lost, recovery seconds)."""
    run = Run(program, work, run_dir)
    first_step = run.wait_for("step ")
    code = run.finish()
    origin = re.search(r": (resumed from step \d+|initialised from seed)", run.stdout)
    observed = f"exit {code}; {origin.group(1) if origin else 'no start line'}"
    recovery = f"{first_step - fault_time:.1f}" if first_step else "-"
    return observed, lost(run_dir, reference), recovery


def one_line(text):
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


# Cases -------------------------------------------------------------------------------------------------------


def kill_at_random(program, work, reference, duration, rng, index):
    run_dir = work / f"kill-{index}"
    run = Run(program, work, run_dir)
    moment = rng.uniform(0.2, duration)
    time.sleep(moment)
    run.process.kill()
    killed = time.monotonic()
    run.finish()
    steps = max(losses(run_dir), default=0)
    observed, data_lost, recovery = resume(program, work, run_dir, killed, reference)
    case = f"kill -9 at {moment:.1f}s (after step {steps})"
    return case, "resumes from the newest complete checkpoint", observed, data_lost, recovery


def kill_mid_save(program, work, reference):
    run_dir = work / "kill-mid-save"
    run = Run(program, work, run_dir)
    checkpoints = run_dir / "checkpoints"
    while run.process.poll() is None:
        if checkpoints.exists() and any("tmp" in p.name for p in checkpoints.iterdir()):
            run.process.kill()
            break
        time.sleep(0.002)
    killed = time.monotonic()
    run.finish()
    partial = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.exists() else []
    observed, data_lost, recovery = resume(program, work, run_dir, killed, reference)
    case = f"kill -9 mid-save (left {', '.join(partial) or 'nothing'})"
    return case, "the half-written save is ignored", observed, data_lost, recovery


def sigterm(program, work, reference, twice=False):
    run_dir = work / ("sigterm-twice" if twice else "sigterm")
    run = Run(program, work, run_dir)
    run.wait_for("step 4 |")
    run.process.send_signal(signal.SIGTERM)
    if twice:
        run.wait_for("SIGTERM: stopping")
        run.process.send_signal(signal.SIGTERM)
    code = run.finish()
    signalled = time.monotonic()
    stopped = re.search(r"stopped by SIGTERM at step (\d+)", run.stdout)
    first = f"exit {code}" + (f", saved step {stopped.group(1)}" if stopped else ", no save")
    observed, data_lost, recovery = resume(program, work, run_dir, signalled, reference)
    if twice:
        return "SIGTERM twice", "exits at once (-15), resumes", f"{first}; {observed}", data_lost, recovery
    return "SIGTERM", "finishes the step, saves, exits 0", f"{first}; {observed}", data_lost, recovery


def largest_array_file(step_dir):
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_a_bit(step_dir):
    path = largest_array_file(step_dir)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(step_dir):
    path = largest_array_file(step_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "a bit flipped in array data": flip_a_bit,
    "an array file truncated": truncate,
    "_METADATA deleted": lambda step_dir: (step_dir / "state/_METADATA").unlink(),
    "manifest.ocdbt deleted": lambda step_dir: (step_dir / "state/manifest.ocdbt").unlink(),
    "checksums deleted": lambda step_dir: shutil.rmtree(step_dir / "checksums"),
    "step folder emptied": lambda step_dir: [shutil.rmtree(step_dir), step_dir.mkdir()],
}


def damaged(program, work, reference, base, name):
    run_dir = work / f"damage-{name.replace(' ', '-')}"
    shutil.copytree(base, run_dir)
    DAMAGE[name](run_dir / "checkpoints/6")
    damaged_at = time.monotonic()
    observed, data_lost, recovery = resume(program, work, run_dir, damaged_at, reference)
    warned = "warned" if (run_dir / "damaged").exists() else "NOT set aside"
    return f"checkpoint 6: {name}", "warns, resumes from step 3", f"{observed}; {warned}", data_lost, recovery


def all_damaged(program, work, base):
    run_dir = work / "damage-all"
    shutil.copytree(base, run_dir)
    flip_a_bit(run_dir / "checkpoints/6")
    truncate(run_dir / "checkpoints/3")
    run = Run(program, work, run_dir)
    code = run.finish()
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    observed = f"exit {code}: {one_line(run.stderr)[:90]}...; kept {', '.join(kept)}"
    return "every checkpoint damaged", "exit 1, keeps them", observed, "none (kept)", "-"


def nan_injected(program, work):
    """A starting point with a NaN in one param: every step is non-finite."""
    from axgen.interop import load_program
    import jax
    import orbax.checkpoint as ocp

    module = load_program(program)
    params = jax.tree.map(np.array, module.init_params(jax.random.key(0)))
    params["final_norm"][0] = np.nan
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(work / "nan-params", params)
    run_dir = work / "nan"
    run = Run(program, work, run_dir, "--init-from", str(work / "nan-params"), "--max-bad-steps", "3")
    code = run.finish()
    skipped = run.stdout.count("not finite; skipped")
    # A run that fails removes the checkpoints folder it made when it saved nothing there.
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("*"))
    observed = f"exit {code}, {skipped} skipped, checkpoints: {', '.join(saved) or 'none'}"
    return "NaN in the params", "skips 3 in a row, stops (exit 1)", observed, "none", "-"


BAD_FLAGS = [
    ("--batch", "0"),
    ("--batch", "-4"),
    ("--log-every", "0"),
    ("--steps", "0"),
    ("--steps", "-1"),
    ("--eval-every", "-1"),
    ("--max-bad-steps", "0"),
    ("--process-id", "-1"),
]


def bad_flag(program, work, flag, value):
    run_dir = work / f"flag{flag}{value}"
    run = Run(program, work, run_dir, flag, value)
    code = run.finish()
    lines = len(run.stderr.strip().splitlines())
    written = "wrote nothing" if not run_dir.exists() else "WROTE the run dir"
    return f"{flag} {value}", "exit 2, one line", f"exit {code}, {lines} line(s), {written}", "none", "-"


def steps_below_resumed(program, work, base):
    run_dir = work / "steps-below"
    shutil.copytree(base, run_dir)
    run = Run(program, work, run_dir, steps=4)
    code = run.finish()
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    observed = f"exit {code}, {len(run.stderr.strip().splitlines())} line(s), checkpoints {', '.join(kept)}"
    return "--steps 4 below the resumed 6", "exit 2, one line", observed, "none", "-"


def second_writer(program, work):
    run_dir = work / "two-writers"
    first = Run(program, work, run_dir, steps=1000)
    first.wait_for("step 2 |")
    second = Run(program, work, run_dir)
    code = second.finish()
    first.process.send_signal(signal.SIGTERM)
    first.finish()
    observed = f"exit {code}: {one_line(second.stderr)[:80]}"
    return "a second run on the run dir", "refused, naming the first", observed, "none", "-"


def deterministic(program, work, reference):
    run_dir = work / "again"
    Run(program, work, run_dir).finish()
    return (
        "the same seed and data again",
        "a bit-identical loss curve",
        "compared",
        lost(run_dir, reference),
        "-",
    )


def peer_killed(program, work):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = ENV | {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--heartbeat-timeout", "10"]
    runs = [
        Run(program, work, work / "peers", *flags, "--process-id", str(i), env=env, steps=100000)
        for i in range(2)
    ]
    runs[0].wait_for("step 2 |")
    runs[1].process.kill()
    killed = time.monotonic()
    code = runs[0].finish()
    runs[1].finish()
    observed = f"exit {code} after {time.monotonic() - killed:.0f}s (heartbeat timeout 10 s)"
    return "one of 2 processes killed", "the other exits, bounded", observed, "-", "-"


def restart_with_cache(work, reference_cpu1, cache, label):
    """llama_tiny on cpu-1 (a CPU mesh of several devices keeps no compiled steps): kill -9 after step 5, restart."""
    program = work / "program_cpu1.py"
    run_dir = work / f"cache-{label}"
    run = Run(program, work, run_dir, "--compilation-cache", str(cache))
    run.wait_for("step 5 |")
    run.process.kill()
    killed = time.monotonic()
    run.finish()
    if label == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    restarted = Run(program, work, run_dir, "--compilation-cache", str(cache))
    first_step = restarted.wait_for("step ")
    restarted.finish()
    split = START_LINE.search(restarted.stdout)
    observed = (
        f"start-up {split.group(1)}s, compile {split.group(2)}s, restore {split.group(3)}s"
        if split
        else "no start line"
    )
    case = f"kill -9, restart, {label} compilation cache (cpu-1)"
    return case, "resumes", observed, lost(run_dir, reference_cpu1), f"{first_step - killed:.1f}"


# Main --------------------------------------------------------------------------------------------------------


def prepare(work):
    documents = [np.frombuffer(text.encode(), np.uint8) for text in module_sources().values()]
    write_dataset(work / "data", documents, vocab_size=256, bos_id=None, eos_id=0, eval_fraction=0.05)
    (work / "tiny_every3.py").write_text(SPEC)
    for target, name in (("cpu-8", "program.py"), ("cpu-1", "program_cpu1.py")):
        write_atomically(work / name, build(work / "tiny_every3.py", target).source)


def table(rows):
    lines = ["| case | expected | observed | data lost | recovery s |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(str(cell).replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=4, help="kill -9 at this many random moments")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="axgen-faults-") as tmp:
        work = Path(tmp)
        prepare(work)
        program = work / "program.py"
        began = time.monotonic()
        Run(program, work, work / "reference").finish()
        duration, reference = time.monotonic() - began, losses(work / "reference")
        Run(work / "program_cpu1.py", work, work / "reference-cpu1", "--compilation-cache", "").finish()
        reference_cpu1 = losses(work / "reference-cpu1")
        Run(program, work, work / "base", steps=6).finish()  # checkpoints 3 and 6

        rows = [kill_at_random(program, work, reference, duration, rng, i) for i in range(args.kills)]
        rows.append(kill_mid_save(program, work, reference))
        rows.append(sigterm(program, work, reference))
        rows.append(sigterm(program, work, reference, twice=True))
        rows += [damaged(program, work, reference, work / "base", name) for name in DAMAGE]
        rows.append(all_damaged(program, work, work / "base"))
        rows.append(nan_injected(program, work))
        rows += [bad_flag(program, work, flag, value) for flag, value in BAD_FLAGS]
        rows.append(steps_below_resumed(program, work, work / "base"))
        rows.append(second_writer(program, work))
        rows.append(deterministic(program, work, reference))
        rows.append(peer_killed(program, work))
        cache = work / "jax-cache"
        rows.append(restart_with_cache(work, reference_cpu1, cache, "cold"))
        rows.append(restart_with_cache(work, reference_cpu1, cache, "warm"))
    print(
        f"llama_tiny cpu-8, {STEPS} steps, a checkpoint every {CHECKPOINT_EVERY}; uninterrupted: {duration:.1f}s"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
