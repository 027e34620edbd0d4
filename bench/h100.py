"""The truth table on one H100: tokens/s, MFU and peak memory, predicted by `axgen aot` and measured, for the dense,
fp8, Llama-3-8B-width and Mixtral-width programs, the Mixtral-width one with XLA's ragged_dot and with the Mosaic
GPU kernel side by side, the dense one under each XLA flag worth trying, the dense and Mixtral-width ones with their
stacked layers' weights cast to bf16 all at once before the layers (MeshRule.stack_cast), and `axgen plan`'s top
five for the dense model (its first choice against the fastest measured). MaxText on the same dense model where it is installed.

    .venv/bin/python bench/h100.py prepare            # on a host with axgen and its [gpu-aot] extra (make test-slow
                                                      # installs it): programs, dataset, AOT peaks, plan
    python bench/h100.py run --out docs/h100.md       # on the H100: needs jax, optax, orbax (tensorboardX travels)
    .venv/bin/python bench/h100.py smoke              # both, with tiny models on CPU: checks the bench itself

`prepare` writes build/h100/ (a few MB): the emitted programs, a byte-level dataset of the demo corpus, the wheels
of what the programs import beyond jax, optax and orbax (the H100 machine reaches no package index), and
manifest.json with what each row runs, in order of what the issue most needs, and what `axgen aot` predicted.
`run` trains each program for --steps steps, reads its metrics.jsonl (tokens/s and MFU: the median after the
first logged interval, which holds the compile; peak: the largest `peak_bytes_in_use` logged) and prints one
markdown table. A row whose program AOT said fits and that did not run is the failure this bench exists to catch.

Device time comes in calls of at most 10 minutes: `run` appends each row's result to build/h100/results.jsonl as
it finishes, skips rows already there, starts no row after --max-seconds, and stops a row at --row-seconds. On the
device: `python bench/h100.py run --out $OUT/h100.md; cp build/h100/results.jsonl $OUT/` (carry build/h100);
copy results.jsonl back into build/h100 here before the next call, which picks up where the last one stopped.
A warm machine goes back after 30 idle seconds, and a second one may not be lent (2026-11-28: refused): put the
rows that matter most first with --only, in one call whose --max-seconds leaves a row's time under its limit.

The MoE's two dispatches (MeshRule.moe_dispatch, docs/moe_dispatch.md) are two rows, Mixtral's width with its 8
experts split 8 ways, when the machine has 8 GPUs or more (`prepare --target gpu-h100-8`): on one GPU every expert is
on the device, and the lowering gives such a program no dispatch at all, so those rows are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
# Each model at the width it is named for, a few layers deep, 8 sequences of 4096 tokens a step (PLATFORM.md).
MODELS = {
    "dense": ("llama2_7b", "num_layers=8", ""),
    "fp8": ("llama2_7b", "num_layers=8", 'features=[*base.features, F.quantize(dtype="fp8")], '),
    "llama3-8b width": ("llama3_8b", "num_layers=4", ""),
    "mixtral width": ("mixtral_8x7b", "num_layers=2", ""),
}
SPEC = """from axgen.spec import MeshRule
from axgen.spec import features as F
from axgen.specs.{base} import spec as base

spec = base.replace(
    name="{name}",
    decoder=base.decoder.replace({layers}),
    {features}train=base.train.replace(seq_len={seq_len}, global_batch={batch}, steps=1000, warmup_steps=10, checkpoint_every=1000),
    targets=["{target}"],
    mesh_rules=[{rule}],
)
"""
# The dispatch rows split the experts over as many devices as there are experts (Mixtral's 8; moe_tiny's 4).
DISPATCH_RULE = (
    "MeshRule('{target}', {{'expert': {experts}, 'fsdp': -1}}, why='bench', moe_dispatch='{dispatch}')"
)
# Flags tried on the dense program (added after the target's own, so they win); each row says what it measured.
FLAGS = {
    "no latency-hiding scheduler": "--xla_gpu_enable_latency_hiding_scheduler=false",
    "no command buffers": "--xla_gpu_enable_command_buffer=",
    "no Triton gemms (cuBLAS only)": "--xla_gpu_enable_triton_gemm=false",
    "while-loop double buffering": "--xla_gpu_enable_while_loop_double_buffering=true",
}
KERNEL_SWITCH = (
    'GROUPED_MATMUL_IMPL = "ragged_dot" if os.environ.get("AXGEN_XLA_KERNELS") == "1" else "mosaic_gpu"'
)
# GPU programs cast each stacked layer's weights to bf16 inside the scanned layer (MeshRule.stack_cast's default
# there), not all at once before the layers: 0.7 GiB less on the dense program, and on the chip dense ran 2.3% and
# the Mixtral width 9.9% slower than before that change (docs/h100.md, 2026-11-28). A row of each built with the
# target's own rule and stack_cast="before_layers", compiled AOT like the others, measures the two side by side.
STACK_CAST_ROWS = ("dense", "mixtral width")
PLAN_TOP = 5
RESULTS = "results.jsonl"
CUT = "stopped after --row-seconds"
# What the programs import that the H100 machine lacks (PLATFORM.md): pure Python or abi3, any CPython 3.
WHEELS = ("tensorboardX==2.6.5", "protobuf==7.36.2")


def prepare(out: Path, target: str, seq_len: int, batch: int, tiny: bool, plan_compiles: int) -> None:
    """Everything `run` needs, built with axgen on this host."""
    from axgen.analysis.aot import candidate_rule
    from axgen.build import build
    from axgen.data.corpus import module_sources
    from axgen.data.datasets import write_dataset
    from axgen.backends import plan_for
    from axgen.loader import load_spec
    from axgen.analysis.plan import search

    shutil.rmtree(out, ignore_errors=True)
    (out / "specs").mkdir(parents=True)
    documents = [text.encode() for text in module_sources().values()]
    import numpy as np

    write_dataset(
        out / "data",
        [np.frombuffer(d, np.uint8) for d in documents],
        vocab_size=256,
        bos_id=None,
        eos_id=0,
        eval_fraction=0.01,
    )
    _download_wheels(out / "wheels")
    rows = []
    moe = load_spec(ROOT / "axgen/specs" / f"{'moe_tiny' if tiny else MODELS['mixtral width'][0]}.py")
    experts = moe.feature("moe").num_experts
    dispatches = ("all_gather", "all_to_all") if plan_for(moe, target).num_devices >= experts else ()
    models = {
        **MODELS,
        **{f"mixtral width, expert={experts}, {d}": MODELS["mixtral width"] for d in dispatches},
    }
    for name, (base, layers, features) in models.items():
        if tiny:
            base, layers = ("moe_tiny" if "mixtral" in name else "llama_tiny"), "num_layers=2"
            features = "" if name == "fp8" else features  # CPU has no fp8 dots
        dispatch = next((d for d in dispatches if name.endswith(d)), None)
        rule = DISPATCH_RULE.format(target=target, experts=experts, dispatch=dispatch) if dispatch else ""
        stem = name.split()[0].replace("-", "_") + (f"_{dispatch}" if dispatch else "")
        spec = out / "specs" / f"{stem}.py"
        spec.write_text(
            SPEC.format(
                base=base,
                name=stem.replace("_", "-"),
                layers=layers,
                features=features,
                seq_len=seq_len,
                batch=batch,
                target=target,
                rule=rule,
            )
        )
        rows += _program_rows(out, spec, name, target)
    dense = out / "specs" / "dense.py"
    found = [o for o in search(dense, target, max_compiles=plan_compiles, log=print) if o.fits][:PLAN_TOP]
    for rank, outcome in enumerate(found, 1):
        rule = candidate_rule(target, outcome.candidate.fields())
        program = out / f"plan_{rank}.py"
        program.write_text(build(dense, target, rule).source)
        c = outcome.candidate
        label = f"plan #{rank}: {c.mesh_text()}, {c.microbatch}/pass, {c.remat}"
        rows.append(_row(label, program, outcome.report, estimated=outcome.step_seconds))
    rows.sort(key=lambda row: (row["sweep"], bool(row["flags"])))  # the flags last
    import jax

    manifest = {"target": target, "tokens_per_step": seq_len * batch, "rows": rows, "jax": jax.__version__}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"wrote {out}: {len(rows)} rows")


def _download_wheels(wheels: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(wheels),
    ]
    command += ["--platform", "manylinux2014_x86_64", "--python-version", "3.12", *WHEELS]
    if subprocess.run(command).returncode:
        print(f"could not download {', '.join(WHEELS)}: `run` needs them installed on the H100 machine")


def _install_missing_wheels(directory: Path) -> None:
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links"]
        # tensorboardX alone: pip takes protobuf from the wheels only where the machine has none of its own.
        subprocess.run([*command, str(directory / "wheels"), WHEELS[0]], check=True)


def _program_rows(out, spec, name, target) -> list[dict]:
    from axgen.analysis.aot import candidate_rule, compile_target
    from axgen.analysis.plan import own_candidate
    from axgen.backends import plan_for
    from axgen.build import build
    from axgen.loader import load_spec

    source = build(spec, target).source
    program = out / f"{spec.stem}.py"
    program.write_text(source)
    report = compile_target(spec, target)
    rows = [_row(name, program, report)]
    if KERNEL_SWITCH in source:
        ragged = out / f"{spec.stem}_ragged_dot.py"
        ragged.write_text(source.replace(KERNEL_SWITCH, 'GROUPED_MATMUL_IMPL = "ragged_dot"'))
        rows = [
            _row(f"{name}, ragged_dot", ragged, report),
            _row(f"{name}, Mosaic GPU kernel", program, report),
        ]
    if name in STACK_CAST_ROWS and target.startswith("gpu"):
        loaded = load_spec(spec)
        fields = own_candidate(loaded, plan_for(loaded, target)).fields()
        fields |= {
            "stack_cast": "before_layers",
            "why": "bench: the target's own rule, its stacks cast first",
        }
        cast_first = out / f"{spec.stem}_stack_cast_before_layers.py"
        cast_first.write_text(build(spec, target, candidate_rule(target, fields)).source)
        cast_report = compile_target(spec, target, rule=fields)
        rows.append(
            _row(f"{name}, the stack cast before the layers", cast_first, cast_report) | {"sweep": True}
        )
    if name == "dense" and target.startswith("gpu"):
        rows += [_row(f"dense, {what}", program, report, flags=flag) for what, flag in FLAGS.items()]
    return rows


def _row(label, program, report, flags="", estimated=None) -> dict:
    return {
        "label": label,
        "program": program.name,
        "flags": flags,
        "sweep": bool(flags),  # after every figure the issue asks for
        "aot_peak": report.peak_bytes,
        "aot_fits": report.fits,
        "usable": report.usable_bytes,
        "estimated_seconds": estimated,
    }


def run(directory: Path, options: argparse.Namespace) -> str:
    """Trains each row's program not yet in results.jsonl, within the time given, and returns the markdown table
    of every row measured so far."""
    import jax

    _install_missing_wheels(directory)
    began = time.monotonic()
    manifest = json.loads((directory / "manifest.json").read_text())
    only = options.only.split(",") if options.only else None
    rows = [r for r in manifest["rows"] if not only or any(r["label"].startswith(o) for o in only)]
    done = _results(directory)
    for row in rows:
        if row["label"] in done:
            continue
        if time.monotonic() - began > options.max_seconds:
            print(f"--max-seconds spent: {row['label']} and the rows after it wait for the next call")
            break
        done[row["label"]] = _measure(directory, row, options)
        with open(directory / RESULTS, "a") as results:
            results.write(json.dumps({"label": row["label"], **done[row["label"]]}) + "\n")
        print(_table_row(row, done[row["label"]], manifest["tokens_per_step"]), flush=True)
    rows, results = [r for r in rows if r["label"] in done], [
        done[r["label"]] for r in rows if r["label"] in done
    ]
    steps, log_every = options.steps, options.log_every
    lines = [
        f"# {manifest['target']}: measured {date.today()}",
        "",
        f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({platform.node()}); {steps} steps each, "
        f"logged every {log_every}; `python bench/h100.py run`.",
        "",
        "| program | ran | tokens/s | MFU | peak AOT | peak measured | measured / AOT | step s (plan's estimate) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, result in zip(rows, results):
        lines.append(_table_row(row, result, manifest["tokens_per_step"]))
    lines += _plan_summary(rows, results) + (_maxtext() if options.maxtext else [])
    if manifest["jax"] != jax.__version__:
        lines += [
            "",
            f"The AOT peaks were compiled by jax {manifest['jax']}'s XLA, the programs ran on jax {jax.__version__}'s:"
            " where the two compilers schedule a step differently, measured / AOT says so, not the fit check.",
        ]
    failures = [r["label"] for r, m in zip(rows, results) if r["aot_fits"] and _failed(r, m)]
    lines += ["", f"AOT said fits but the program did not run: {', '.join(failures) or 'none'}."]
    return "\n".join(lines) + "\n"


def _results(directory: Path) -> dict:
    """The rows earlier calls measured, by label."""
    path = directory / RESULTS
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {record.pop("label"): record for record in records}


def _measure(directory: Path, row: dict, options: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="h100-run-") as run_dir:
        env = dict(os.environ, XLA_FLAGS=row["flags"]) if row["flags"] else dict(os.environ)
        # The programs run on axgen's runtime from this checkout: the H100 machine has no axgen installed.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        argv = [sys.executable, str(directory / row["program"]), "--data", str(directory / "data")]
        argv += ["--run-dir", run_dir, "--steps", str(options.steps), "--log-every", str(options.log_every)]
        began = time.monotonic()
        try:
            result = subprocess.run(
                argv, capture_output=True, text=True, env=env, timeout=options.row_seconds
            )
            code, error = result.returncode, (result.stderr.strip().splitlines() or ["no message"])[-1]
        except subprocess.TimeoutExpired:
            code, error = -1, f"{CUT} {options.row_seconds}"
        seconds = time.monotonic() - began
        metrics = Path(run_dir) / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    speeds = [r for r in records if "tokens_per_second" in r][1:]
    mfus = [r["mfu"] for r in speeds if "mfu" in r]  # none on CPU: its peak FLOP/s is unknown
    return {
        "ran": code == 0,
        "error": None if code == 0 else error[:160],
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in speeds) if speeds else None,
        "mfu": statistics.median(mfus) if mfus else None,
        "peak": max((r["memory_bytes"] for r in records if r.get("memory_bytes")), default=None),
        "seconds": seconds,
    }


def _failed(row: dict, m: dict) -> bool:
    """Whether the program did not run on an H100: it stopped with an error, never measured its speed before
    --row-seconds cut it, or peaked above what AOT counts usable (the lent chip may be an H200, with 141 GB).
    """
    over = m["peak"] is not None and m["peak"] > row["usable"]
    return over or (not m["ran"] and (m["tokens_per_second"] is None or not m["error"].startswith(CUT)))


def _table_row(row: dict, m: dict, tokens_per_step: int) -> str:
    def gib(n):
        return f"{n / GIB:.2f} GiB" if n else "-"

    ratio = f"{m['peak'] / row['aot_peak']:.2f}" if m["peak"] and row["aot_peak"] else "-"
    if m["peak"] and m["peak"] > row["usable"]:
        ran = f"**no**: peaked over the {gib(row['usable'])} an H100 has usable"
    elif m["ran"] or not _failed(row, m):
        ran = "yes" if m["ran"] else f"yes, {m['error']}"
    else:
        ran = f"**no**: {m['error']}"
    speed = f"{m['tokens_per_second']:.0f}" if m["tokens_per_second"] else "-"
    mfu = f"{m['mfu']:.1%}" if m["mfu"] else "-"
    step = f"{tokens_per_step / m['tokens_per_second']:.3g}" if m["tokens_per_second"] else "-"
    if row["estimated_seconds"]:
        step += f" ({row['estimated_seconds']:.3g})"
    aot = gib(row["aot_peak"]) + (" (over)" if row["aot_fits"] is False else "")
    return f"| {row['label']} | {ran} | {speed} | {mfu} | {aot} | {gib(m['peak'])} | {ratio} | {step} |"


def _plan_summary(rows: list[dict], results: list[dict]) -> list[str]:
    measured = [
        (row["label"], m["tokens_per_second"])
        for row, m in zip(rows, results)
        if row["label"].startswith("plan #") and m["tokens_per_second"]
    ]
    if len(measured) < 2:
        return ["", "Fewer than two of `axgen plan`'s rows ran: nothing to rank its first choice against."]
    first = next((speed for label, speed in measured if label.startswith("plan #1:")), None)
    best_label, best = max(measured, key=lambda item: item[1])
    verdict = f"{first / best:.1%} of the fastest ({best_label})" if first else "plan #1 did not run"
    return ["", f"`axgen plan`'s first choice ran at {verdict}; the goal is within 10%."]


def _maxtext() -> list[str]:
    """MaxText on the dense model's shapes, where the machine has it (PLATFORM.md says how it was installed)."""
    try:
        import MaxText  # noqa: F401
    except ImportError:
        return ["", "MaxText: not installed on this machine; no reference ratio."]
    config = Path(MaxText.__file__).parent / "configs" / "base.yml"
    argv = [sys.executable, "-m", "MaxText.train", str(config), "run_name=h100", "model_name=llama2-7b"]
    argv += ["base_num_decoder_layers=8", "per_device_batch_size=8", "max_target_length=4096"]
    argv += ["dataset_type=synthetic", "steps=30", "remat_policy=minimal", "attention=cudnn_flash_te"]
    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run([*argv, f"base_output_directory={out}"], capture_output=True, text=True)
    times = [
        float(line.split("seconds:")[1].split(",")[0])
        for line in result.stdout.splitlines()
        if "seconds:" in line
    ]
    if result.returncode or len(times) < 3:
        return ["", f"MaxText: did not run ({(result.stderr.strip().splitlines() or ['?'])[-1][:160]})."]
    tokens_per_second = 8 * 4096 / statistics.median(times[2:])
    return ["", f"MaxText (remat minimal, cuDNN attention), same shapes: {tokens_per_second:.0f} tokens/s."]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, default=ROOT / "build/h100")
    p.add_argument("--plan-compiles", type=int, default=16)
    p.add_argument("--target", default="gpu-h100-1", help="gpu-h100-8 on 8 GPUs adds the MoE dispatch rows")
    r = sub.add_parser("run")
    r.add_argument("--dir", type=Path, default=ROOT / "build/h100")
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--log-every", type=int, default=5)
    r.add_argument("--only", help="comma-separated row labels' beginnings, e.g. dense,mixtral")
    r.add_argument("--maxtext", action="store_true", help="also run MaxText on the dense model's shapes")
    r.add_argument("--out", type=Path, help="also write the table here, e.g. docs/h100.md")
    r.add_argument("--max-seconds", type=float, default=300, help="start no row after this long")
    r.add_argument("--row-seconds", type=float, default=240, help="stop a row's program after this long")
    sub.add_parser("smoke")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.out, args.target, 4096, 8, tiny=False, plan_compiles=args.plan_compiles)
    elif args.command == "run":
        table = run(args.dir, args)
        print(table, end="")
        if args.out:
            args.out.write_text(table)
    else:
        with tempfile.TemporaryDirectory(prefix="h100-smoke-") as work:
            os.environ["JAX_PLATFORMS"] = "cpu"
            prepare(Path(work), "cpu-1", 128, 4, tiny=True, plan_compiles=3)
            options = argparse.Namespace(
                steps=4, log_every=1, only=None, maxtext=False, max_seconds=600, row_seconds=300
            )
            print(run(Path(work), options), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
