"""LoRA (F.lora) against full fine-tuning of the same spec: peak memory per chip, deviceless, and a step's time.

    .venv/bin/python bench/lora.py memory [--out FILE]   # `axgen aot`: about 15 minutes on 2 cores
    .venv/bin/python bench/lora.py step                  # llama_tiny on this host's CPU: a minute

`memory`: Llama 3 70B on one H100 host (gpu-h100-8) and one v5p slice of 8 chips, Llama 3 8B at 8,192 tokens on one
H100 and one v5p chip; the same spec each time, without F.lora, with F.lora (rank 16, alpha 32, the seven
projections) on a float32 base, and on a bfloat16 base (`base_dtype`); each on the spec's batch, fully sharded over
the chips (fsdp), one sequence per pass, full remat. LoRA's saving is the frozen base's: no gradient, no AdamW moments (12 of the 16 bytes a float32 param
costs a full fine-tune), nothing in the checkpoint; a bfloat16 base halves the 4 left.

`step`: the median time of a train step of llama_tiny (cpu-1, its own batch) with and without F.lora, both
compiled and run in this process, and their ratio.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
SPEC = """from axgen.spec import MeshRule, Remat
from axgen.spec import features as F
from axgen.specs.{base} import spec as base

spec = base.replace(
    name="{name}",
    features=[*base.features{lora}],
    train=base.train.replace(seq_len={seq_len}),
    targets=["{target}"],
    mesh_rules=[
        MeshRule("{target}", {{"fsdp": -1}}, why="bench", microbatch=1, remat=Remat(policy="full")),
        *base.mesh_rules,
    ],
)
"""
ROWS = [  # (base spec, seq_len, target)
    ("llama3_70b", 8192, "gpu-h100-8"),
    ("llama3_70b", 8192, "tpu-v5p-8"),
    ("llama3_8b", 8192, "gpu-h100-1"),
    ("llama3_8b", 8192, "tpu-v5p-1"),
]
VARIANTS = {
    "full": "",
    "lora": ", F.lora(rank=16, alpha=32)",
    "lora-bf16": ', F.lora(rank=16, alpha=32, base_dtype="bfloat16")',
}


def write_spec(directory: Path, base: str, variant: str, seq_len: int, target: str) -> Path:
    name = f"{base.replace('_', '-')}-{variant}"
    path = directory / f"{name.replace('-', '_')}_{target.replace('-', '_')}.py"
    path.write_text(SPEC.format(base=base, name=name, lora=VARIANTS[variant], seq_len=seq_len, target=target))
    return path


def compile_row(directory: Path, base: str, seq_len: int, target: str, variant: str) -> dict:
    """`axgen aot`'s report of one variant: it exits 1 where the program does not fit, and still reports."""
    path = write_spec(directory, base, variant, seq_len, target)
    axgen = str(Path(sys.executable).parent / "axgen")
    result = subprocess.run(
        [axgen, "aot", str(path), "--target", target, "--json", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if not result.stdout.strip():
        raise SystemExit(f"{path.stem} on {target}: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def table(rows: list[tuple]) -> str:
    lines = [
        "| model | tokens | target | usable | full fine-tune | LoRA, float32 base | LoRA, bfloat16 base |",
        "|---|---|---|---|---|---|---|",
    ]

    def peak(report):
        fits = "fits" if report["fits"] else "**does not fit**"
        if report["peak_bytes"] is None:
            return f"over (the compiler refused it): {fits}"
        return f"{report['peak_bytes'] / GIB:.2f} GiB: {fits}"

    for base, seq_len, target, reports in rows:
        usable = reports["full"]["usable_bytes"] / GIB
        cells = " | ".join(peak(reports[variant]) for variant in VARIANTS)
        lines.append(f"| {base} | {seq_len} | {target} | {usable:.1f} GiB | {cells} |")
    return "\n".join(lines) + "\n"


def step_times(steps: int = 20) -> str:
    """Median seconds per step of llama_tiny with and without F.lora, in this process, and the ratio."""
    import jax
    import jax.numpy as jnp

    from axgen.build import build
    from axgen.interop import load_program
    from axgen.runtime.program import Program

    times = {}
    with tempfile.TemporaryDirectory() as directory:
        for variant in ("full", "lora"):
            spec = write_spec(Path(directory), "llama_tiny", variant, 128, "cpu-1")
            program_file = Path(directory) / f"{spec.stem}_program.py"
            program_file.write_text(build(spec, "cpu-1").source)
            module = load_program(program_file)
            program = Program.from_module(module)
            mesh = program.make_mesh(jax.devices()[:1])
            batch = module.CONFIG["global_batch"]
            with jax.set_mesh(mesh):
                step, _ = program.compile_train_step(mesh, batch)
                state = jax.jit(program.init_state, out_shardings=program.state_shardings(mesh))(
                    jax.random.key(0)
                )
                tokens = jax.random.randint(jax.random.key(1), (batch, 129), 0, module.CONFIG["vocab_size"])
                ones = jnp.ones_like(tokens)
                seconds = []
                for _ in range(steps):
                    began = time.perf_counter()
                    state, metrics = step(state, tokens, ones, ones)
                    jax.block_until_ready(metrics["loss"])
                    seconds.append(time.perf_counter() - began)
            times[variant] = statistics.median(seconds[2:])
    return (
        f"llama_tiny on cpu-1, {steps} steps each: full {times['full'] * 1e3:.1f} ms a step, LoRA"
        f" {times['lora'] * 1e3:.1f} ms; LoRA / full = {times['lora'] / times['full']:.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("memory", "step"))
    parser.add_argument("--out", type=Path, help="memory: also write the table here")
    args = parser.parse_args()
    if args.what == "step":
        print(step_times())
        return 0
    measured = []
    with tempfile.TemporaryDirectory() as directory:
        for base, seq_len, target in ROWS:
            reports = {v: compile_row(Path(directory), base, seq_len, target, v) for v in VARIANTS}
            measured.append((base, seq_len, target, reports))
            print(table(measured).splitlines()[-1], flush=True)
    text = table(measured)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
