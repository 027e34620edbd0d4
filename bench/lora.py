"""LoRA (F.lora) against full fine-tuning of the same spec: peak memory per chip, deviceless, and a step's time.

    .venv/bin/python bench/lora.py memory [--out docs/lora.md]   # `axgen aot`: about 15 minutes on 2 cores
    .venv/bin/python bench/lora.py step                          # llama_tiny on this host's CPU: a minute

`memory`: Llama 3 70B on one H100 host (gpu-h100-8) and one v5p slice of 8 chips, Llama 3.1 8B at 8,192 tokens on
one H100 and one v5p chip; the same spec each time, with and without F.lora (rank 16, alpha 32, the seven
projections), the spec's own batch and remat. LoRA's saving is the frozen base's: no gradient, no AdamW moments
(12 of the 16 bytes a float32 param costs a full fine-tune), nothing in the checkpoint. Its weights stay float32,
as a full fine-tune's do.

`step`: the median time of a train step of llama_tiny (cpu-1, its own batch) with and without F.lora, both
compiled and run in this process, and their ratio.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
SPEC = """from axgen.spec import features as F
from axgen.specs.{base} import spec as base

spec = base.replace(
    name="{name}",
    features=[*base.features{lora}],
    train=base.train.replace(seq_len={seq_len}),
    targets=["{target}"],
)
"""
ROWS = [  # (base spec, seq_len, target)
    ("llama3_70b", 8192, "gpu-h100-8"),
    ("llama3_70b", 8192, "tpu-v5p-8"),
    ("llama3_8b", 8192, "gpu-h100-1"),
    ("llama3_8b", 8192, "tpu-v5p-1"),
]
LORA = ", F.lora(rank=16, alpha=32)"


def compile_row(directory: Path, base: str, seq_len: int, target: str, lora: bool) -> dict:
    name = f"{base.replace('_', '-')}{'-lora' if lora else ''}"
    path = directory / f"{name.replace('-', '_')}_{target.replace('-', '_')}.py"
    path.write_text(
        SPEC.format(base=base, name=name, lora=LORA if lora else "", seq_len=seq_len, target=target)
    )
    result = subprocess.run(
        [str(Path(sys.executable).parent / "axgen"), "aot", str(path), "--target", target, "--json", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if result.returncode:
        raise SystemExit(f"{name} on {target}: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def table(rows: list[tuple]) -> str:
    lines = [
        "| model | tokens | target | full fine-tune peak / chip | LoRA peak / chip | usable | full fits | LoRA fits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for base, seq_len, target, full, lora in rows:

        def peak(report):
            return (
                f"{report['peak_bytes'] / GIB:.2f} GiB" if report["peak_bytes"] else "over (compiler refused)"
            )

        lines.append(
            f"| {base} | {seq_len} | {target} | {peak(full)} | {peak(lora)} | {full['usable_bytes'] / GIB:.1f} GiB"
            f" | {'yes' if full['fits'] else '**no**'} | {'yes' if lora['fits'] else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def step_times(steps: int = 20) -> str:
    """Median seconds per step of llama_tiny with and without F.lora, in this process, and the ratio."""
    import statistics
    import time

    import jax
    import jax.numpy as jnp

    from axgen.build import build
    from axgen.interop import load_program
    from axgen.runtime.program import Program

    times = {}
    with tempfile.TemporaryDirectory() as directory:
        for name, lora in (("full", ""), ("lora", LORA)):
            spec = Path(directory) / f"tiny_{name}.py"
            spec.write_text(
                SPEC.format(base="llama_tiny", name=f"tiny-{name}", lora=lora, seq_len=128, target="cpu-1")
            )
            program_file = Path(directory) / f"tiny_{name}_program.py"
            program_file.write_text(build(spec, "cpu-1").source)
            module = load_program(program_file)
            program = Program.from_module(module)
            mesh = program.make_mesh(jax.devices()[:1])
            with jax.set_mesh(mesh):
                step, _ = program.compile_train_step(mesh, module.CONFIG["global_batch"])
                state = jax.jit(program.init_state, out_shardings=program.state_shardings(mesh))(
                    jax.random.key(0)
                )
                tokens = jax.random.randint(jax.random.key(1), (module.CONFIG["global_batch"], 129), 0, 512)
                ones = jnp.ones_like(tokens)
                seconds = []
                for _ in range(steps):
                    began = time.perf_counter()
                    state, metrics = step(state, tokens, ones, ones)
                    jax.block_until_ready(metrics["loss"])
                    seconds.append(time.perf_counter() - began)
            times[name] = statistics.median(seconds[2:])
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
            full, lora = (compile_row(Path(directory), base, seq_len, target, lora) for lora in (False, True))
            measured.append((base, seq_len, target, full, lora))
            print(table(measured).splitlines()[-1], flush=True)
    text = table(measured)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
