"""`axgen convert-hf` on a Llama-2-7B-width checkpoint of random weights: wall time and peak host memory
against the checkpoint's size on disk (the goal is a peak RSS of at most 1.5x that size).

    .venv/bin/python bench/hf_convert.py [--layers 4] [--dtype bf16] [--shard-gb 2] [--workdir DIR]

The checkpoint has Llama 2 7B's widths (d_model 4096, 32 heads of 128, SwiGLU MLP 11008, vocab 32000) and
HF Llama's tensor names and shapes, written as save_pretrained would: shards of about --shard-gb GB plus
model.safetensors.index.json. It is generated shard by shard, one tensor at a time, so the generator stays
small. --layers defaults to 4 so that a checkpoint, its conversion and the orbax output fit a small machine;
every buffer the converter holds scales with the params, so the ratio does not depend on the layer count once
the fixed overhead of the process (the baseline below) is subtracted; the raw ratio falls slightly with more
layers as that overhead is spread thinner (pass several, e.g. --layers 2 4, to see). --dtype and --layers
take several values; each case is generated, converted and deleted before the next.

`axgen convert-hf` runs as a subprocess. Its peak RSS is the kernel's high-water mark (ru_maxrss from wait4);
it counts file-backed pages too, and the converter reads the shards through memory maps that stay mapped
until it exits, so the table also shows the peak of anonymous memory alone (polled from /proc/PID/status).
The baseline is a subprocess that imports what the CLI imports plus orbax and starts jax's backend: the fixed
overhead of any such process, subtracted in the last two ratios (its peak RSS from peak RSS, its anonymous
RSS from the anonymous peak). The shards were just written, so they are read from the page cache: the times
are warm-cache times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np

AXGEN = Path(sys.executable).parent / "axgen"
D_MODEL, HEADS, HEAD_DIM, FFN, VOCAB = 4096, 32, 128, 11_008, 32_000
DTYPES = {"bf16": (ml_dtypes.bfloat16, "BF16"), "fp32": (np.float32, "F32")}
CHUNK = 1 << 25  # elements generated at a time (128 MB of fp32)
GB = 1e9

# specs/llama2_7b.py with fewer layers; the tensors below are written at its widths.
SPEC = """from axgen.specs.llama2_7b import spec as llama2_7b

spec = llama2_7b.replace(
    name="llama2-7b-width-{layers}l", decoder=llama2_7b.decoder.replace(num_layers={layers}), targets=["cpu-8"]
)
"""


def write_spec(path: Path, layers: int) -> Path:
    path.write_text(SPEC.format(layers=layers))
    return path


def hf_tensors(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of an HF Llama checkpoint, in save_pretrained's order."""
    tensors = [("model.embed_tokens.weight", (VOCAB, D_MODEL))]
    for i in range(layers):
        prefix = f"model.layers.{i}"
        tensors += [(f"{prefix}.self_attn.{p}_proj.weight", (HEADS * HEAD_DIM, D_MODEL)) for p in "qkvo"]
        tensors += [
            (f"{prefix}.mlp.gate_proj.weight", (FFN, D_MODEL)),
            (f"{prefix}.mlp.up_proj.weight", (FFN, D_MODEL)),
            (f"{prefix}.mlp.down_proj.weight", (D_MODEL, FFN)),
            (f"{prefix}.input_layernorm.weight", (D_MODEL,)),
            (f"{prefix}.post_attention_layernorm.weight", (D_MODEL,)),
        ]
    return tensors + [("model.norm.weight", (D_MODEL,)), ("lm_head.weight", (VOCAB, D_MODEL))]


def write_checkpoint(directory: Path, layers: int, dtype: str, shard_gb: float, seed: int = 0) -> int:
    """Random weights as safetensors shards of about `shard_gb` GB, and their index; returns their size."""
    np_dtype, st_dtype = DTYPES[dtype]
    itemsize = np.dtype(np_dtype).itemsize
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in hf_tensors(layers):
        nbytes = int(np.prod(shape)) * itemsize
        if shards[-1] and size + nbytes > shard_gb * GB:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in shard:
            nbytes = int(np.prod(shape)) * itemsize
            header[name] = {
                "dtype": st_dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[name] = file
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # as safetensors pads it: the data starts 8-byte aligned
        with (directory / file).open("wb") as out:
            out.write(len(encoded).to_bytes(8, "little") + encoded)
            for name, shape in shard:
                _write_random(out, rng, int(np.prod(shape)), np_dtype, norm=len(shape) == 1)
        total += offset
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    return sum(f.stat().st_size for f in directory.iterdir())


def _write_random(out, rng: np.random.Generator, count: int, dtype, norm: bool) -> None:
    for start in range(0, count, CHUNK):
        values = rng.standard_normal(min(CHUNK, count - start), dtype=np.float32)
        values *= np.float32(0.02)
        if norm:
            values += np.float32(1.0)
        values.astype(dtype).tofile(out)


class Peak:
    """A child process's peak RSS (wait4's ru_maxrss) and, polled from /proc, its peak anonymous RSS."""

    FIELDS = ("RssAnon", "RssFile", "VmRSS")

    def __init__(self, argv: list[str], interval: float = 0.01):
        self.peak = dict.fromkeys(self.FIELDS, 0)
        self.start = time.perf_counter()
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._done = threading.Event()
        self._poller = threading.Thread(target=self._poll, args=(interval,), daemon=True)
        self._poller.start()

    def _poll(self, interval: float) -> None:
        status = Path(f"/proc/{self.process.pid}/status")
        while not self._done.is_set():
            try:
                lines = status.read_text().splitlines()
            except OSError:
                return
            for line in lines:
                key, _, value = line.partition(":")
                if key in self.peak:
                    self.peak[key] = max(self.peak[key], int(value.split()[0]) * 1024)
            time.sleep(interval)

    def wait(self) -> tuple[str, float, int]:
        """(output, seconds, peak RSS bytes) once the child exits; raises if it failed."""
        output = self.process.stdout.read()
        _, status, usage = os.wait4(self.process.pid, 0)
        seconds = time.perf_counter() - self.start
        self.process.returncode = os.waitstatus_to_exitcode(status)
        self._done.set()
        self._poller.join()
        if self.process.returncode != 0:
            raise SystemExit(f"{' '.join(self.process.args)} exited {self.process.returncode}:\n{output}")
        return output, seconds, usage.ru_maxrss * 1024  # Linux reports kilobytes


def baseline_rss() -> tuple[int, int]:
    """(peak RSS, peak anonymous RSS) of a process that loads what `axgen convert-hf` loads and does nothing
    else."""
    code = "import axgen.cli, axgen.hf.weights, orbax.checkpoint, jax; jax.devices()"
    run = Peak([sys.executable, "-c", code])
    _, _, peak = run.wait()
    return peak, run.peak["RssAnon"]


def run_case(
    workdir: Path, layers: int, dtype: str, shard_gb: float, baseline: tuple[int, int]
) -> list[dict]:
    """Both directions: HF shards -> `axgen convert-hf` -> orbax, then orbax -> `axgen export-hf` -> HF shards."""
    case = workdir / f"{dtype}_{layers}l"
    hf = case / "hf"
    hf.mkdir(parents=True)
    try:
        spec = write_spec(case / "spec.py", layers)
        start = time.perf_counter()
        size = write_checkpoint(hf, layers, dtype, shard_gb)
        generated = time.perf_counter() - start
        print(f"  generated {size / GB:.2f} GB in {generated:.0f} s")
        ckpt = case / "ckpt"
        export_dtype = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
        commands = {
            "convert-hf": ["convert-hf", str(spec), "--hf", str(hf), "--out", str(ckpt)],
            "export-hf": ["export-hf", str(spec), "--ckpt", str(ckpt), "--out", str(case / "out")]
            + ["--dtype", export_dtype],
        }
        rows = []
        for direction, argv in commands.items():
            run = Peak([str(AXGEN), *argv])
            output, seconds, peak = run.wait()
            print(f"  {output.strip().splitlines()[-1]}", flush=True)
            rows.append(
                {
                    "direction": direction,
                    "layers": layers,
                    "dtype": dtype,
                    "shards": len(list(hf.glob("*.safetensors"))),
                    "size": size,
                    "seconds": seconds,
                    "peak": peak,
                    "anon": run.peak["RssAnon"],
                    "file": run.peak["RssFile"],
                    "baseline": baseline[0],
                    "baseline_anon": baseline[1],
                }
            )
        return rows
    finally:
        shutil.rmtree(case, ignore_errors=True)


def table(rows: list[dict]) -> str:
    head = (
        "direction",
        "layers",
        "dtype",
        "shards",
        "ckpt GB",
        "seconds",
        "peak RSS GB",
        "peak/ckpt",
        "base GB",
        "(peak-base)/ckpt",
        "peak anon GB",
        "peak file GB",
        "(anon-base anon)/ckpt",
    )
    body = [
        (
            r["direction"],
            str(r["layers"]),
            r["dtype"],
            str(r["shards"]),
            f"{r['size'] / GB:.2f}",
            f"{r['seconds']:.1f}",
            f"{r['peak'] / GB:.2f}",
            f"{r['peak'] / r['size']:.2f}x",
            f"{r['baseline'] / GB:.2f}",
            f"{(r['peak'] - r['baseline']) / r['size']:.2f}x",
            f"{r['anon'] / GB:.2f}",
            f"{r['file'] / GB:.2f}",
            f"{(r['anon'] - r['baseline_anon']) / r['size']:.2f}x",
        )
        for r in rows
    ]
    widths = [max(len(c) for c in column) for column in zip(head, *body)]
    lines = [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in (head, *body)]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[4], help="decoder layers (4)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16"], help="bf16 or fp32")
    parser.add_argument(
        "--shard-gb", type=float, default=2.0, help="shard size in GB, as save_pretrained (2)"
    )
    parser.add_argument("--workdir", type=Path, help="where to write (default: a temporary folder in /tmp)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="axgen-hf-convert-", dir=args.workdir))
    try:
        for layers in args.layers:
            for dtype in args.dtype:
                params = sum(int(np.prod(shape)) for _, shape in hf_tensors(layers))
                need = 3.1 * params * np.dtype(DTYPES[dtype][0]).itemsize  # shards, orbax's copy, the export
                free = shutil.disk_usage(workdir).free
                if need > free:
                    raise SystemExit(
                        f"{dtype}, {layers} layers: needs {need / GB:.1f} GB of disk, {free / GB:.1f} free"
                    )
        baseline = baseline_rss()
        rows = []
        for layers in args.layers:
            for dtype in args.dtype:
                print(f"{dtype}, {layers} layers:", flush=True)
                rows += run_case(workdir, layers, dtype, args.shard_gb, baseline)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(table(rows))
    print(
        "\nGB = 1e9 bytes. ckpt: the safetensors shards and index on disk. peak RSS: the command's high-water"
        " mark (wait4), file-backed pages included; peak anon/file: polled every 10 ms. base: a process that"
        " only imports the CLI, orbax and jax. Goal: peak/ckpt <= 1.5x in each direction."
    )


if __name__ == "__main__":
    main()
