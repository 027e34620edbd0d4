"""Peak memory per chip against sequence length, with the sequence split over context shards: Llama 3.1 8B
(llama3_8b with Llama 3.1's RoPE scaling), compiled for the chips without them (`axgen aot`'s deviceless compile).

    python bench/long_context.py [--target gpu-h100-64] [--rows shard,context,none]   # minutes to an hour

Three sweeps over the sequence length, each row a program built for its mesh (fsdp over the devices the context
shards leave, one sequence per batch shard, one pass a step) and the train step compiled for the target's chips:

- `shard`: the context degree grows with the sequence, so each device holds 16k tokens: the peak stays level.
- `context`: the context degree fixed at 8: the peak grows with each device's shard of the sequence, seq_len / 8.
- `none`: no context parallelism (fsdp over every chip): the peak grows with the whole sequence.

It prints one markdown table: the mesh, tokens a device holds, peak and usable memory per device, the eval peak,
and the collective bytes per device per step. docs/aot.md holds its output.
"""

import argparse
import sys
import tempfile
from pathlib import Path

from axgen.analysis.aot import AotError, compile_target

SPEC = """from axgen.spec import features as F
from axgen.spec.feature_configs import RopeScaling
from axgen.specs.llama3_8b import spec as llama3

scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
spec = llama3.replace(
    name="llama3.1-8b",
    features=[F.rope(theta=500_000.0, scaling=scaling)],
    train=llama3.train.replace(seq_len={seq_len}, global_batch={global_batch}),
)
"""
DEVICES = {"gpu-h100-64": 64, "tpu-v5p-128": 128}
# The context degrees of the `shard` sweep: on TPU a mesh axis must be a product of the slice's torus dimensions
# (v5p-128 is 4 x 4 x 8), so 2 is not one.
SHARD_CONTEXTS = {"gpu-h100-64": (1, 2, 4, 8), "tpu-v5p-128": (1, 4, 8)}
GIB = 1024**3


def rows(sweep: str, target: str) -> list[tuple[int, int]]:
    """(seq_len, context degree) of each row of a sweep."""
    k = 1024
    if sweep == "shard":
        return [(16 * k * context, context) for context in SHARD_CONTEXTS[target]]
    if sweep == "context":
        return [(seq_len * k, 8) for seq_len in (8, 16, 32, 64, 128)]
    return [(seq_len * k, 1) for seq_len in (8, 32, 128)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(DEVICES), default="gpu-h100-64")
    parser.add_argument("--rows", default="shard,context,none", help="which sweeps, comma-separated")
    args = parser.parse_args(argv)
    devices = DEVICES[args.target]
    print(f"Llama 3.1 8B on {args.target}, deviceless; one sequence per batch shard, one pass a step\n")
    print(
        "| sweep | seq_len | mesh | global batch | tokens a device holds | peak / usable | eval peak | fits"
        " | collectives GB a device a step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        for sweep in args.rows.split(","):
            for seq_len, context in rows(sweep, args.target):
                batch = devices // context  # fsdp over the other devices, one sequence each
                spec = Path(tmp) / f"llama31_{seq_len}_{context}.py"
                spec.write_text(SPEC.format(seq_len=seq_len, global_batch=batch))
                mesh = {"fsdp": batch, "context": context}
                try:
                    report = compile_target(spec, args.target, rule={"mesh": mesh, "why": f"{sweep} sweep"})
                except AotError as err:
                    print(f"| {sweep} | {seq_len} | {mesh} | {batch} | | did not compile: {err} | | | |")
                    continue
                mesh_text = " ".join(f"{a}={n}" for a, n in report.mesh.items() if n > 1)
                peak = "out of memory" if report.peak_bytes is None else f"{report.peak_bytes / GIB:.2f} GiB"
                eval_peak = (
                    "" if report.eval_peak_bytes is None else f"{report.eval_peak_bytes / GIB:.2f} GiB"
                )
                moved = sum(report.collective_bytes.values()) / 1e9
                print(
                    f"| {sweep} | {seq_len:,} | {mesh_text} | {batch} | {seq_len // context:,} | {peak} / "
                    f"{report.usable_bytes / GIB:.1f} GiB | {eval_peak} | {'yes' if report.fits else '**no**'} "
                    f"| {moved:.1f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
