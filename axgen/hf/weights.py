"""`axgen convert-hf`: a Hugging Face checkpoint folder (sharded safetensors and their index, or one
model.safetensors) becomes an orbax checkpoint of the emitted program's params, which the program starts from with
`--init-from`.

Tensors are read one at a time and keep their dtype (bf16 stays bf16; the program casts to its own on restore),
so the host holds the params once, plus one tensor while a param's layers are stacked (bench/hf_convert.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import signal
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from axgen import progress
from axgen.files import check_replaceable, staging_dir
from axgen.hf.families import FAMILIES, family_name
from axgen.hf.storage import fp8_block_size
from axgen.interop import CheckpointError, hf_layout, hf_names, hf_shapes, host_jax, params_of
from axgen.spec import Model

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,  # gpt-oss's MXFP4 experts: blocks of e2m1 pairs and e8m0 scales (hf.storage.Mxfp4Experts)
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # DeepSeek-V3's FP8 blocks, scaled by F32s (hf.storage.Fp8Blocks)
}
# Tensors some checkpoints carry that are not weights: RoPE's inverse frequencies, recomputed from theta.
NOT_WEIGHTS = ("rotary_emb.inv_freq",)


def _offsets(path: Path, name: str, entry) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    if not 0 <= offsets[0] <= offsets[1]:
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {offsets!r} run backwards")
    return offsets[0], offsets[1]


def _is_shape(shape) -> bool:
    return isinstance(shape, list) and all(type(size) is int and size >= 0 for size in shape)


class HFCheckpoint(Mapping):
    """A checkpoint folder's tensors by name, each read from its shard when asked for.

    A tensor is read into a fresh array with one `readinto`, not through a memory map: safetensors' maps keep
    every page read so far resident until the shard closes, and a conversion reads every shard, so the host would
    hold the whole checkpoint twice (measured: bench/hf_convert.py)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        if (self.directory / INDEX).is_file():
            files = sorted(set(self._index().values()))
        elif (self.directory / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise CheckpointError(f"{self.directory}: holds neither {INDEX} nor {SINGLE}")
        self.entries: dict[str, tuple[str, dict]] = {}
        for file in files:
            for name, entry in self._header(file).items():
                # Which copy of a tensor found twice is the model's? The index names one, a loader may take
                # either: axgen does not pick.
                if name in self.entries:
                    raise CheckpointError(
                        f"{self.directory}: tensor {name!r} is in both {self.entries[name][0]} and {file}; a "
                        "checkpoint holds each tensor once: remove the stale copy"
                    )
                self.entries[name] = (file, entry)

    def _index(self) -> dict[str, str]:
        path = self.directory / INDEX
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{path}: not a safetensors index with a weight_map ({err})") from None
        missing = sorted({file for file in weight_map.values() if not (self.directory / file).is_file()})
        if missing:
            raise CheckpointError(f"{path}: names {missing[0]}, which is not in {self.directory}")
        return weight_map

    def _header(self, file: str) -> dict[str, dict]:
        """The shard's tensors: dtype, shape and byte range from its start, checked against the file's size."""
        path = self.directory / file
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error) as err:
            raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
        header.pop("__metadata__", None)
        size = path.stat().st_size
        previous_end, previous = 0, None
        for name, entry in sorted(header.items(), key=lambda item: _offsets(path, *item)):
            begin, end = _offsets(path, name, entry)
            why = None
            if entry.get("dtype") not in DTYPES:
                why = f"dtype {entry.get('dtype')!r} is not one axgen reads ({', '.join(DTYPES)})"
            elif not _is_shape(entry.get("shape")):
                why = f"shape {entry.get('shape')!r} is not a list of sizes"
            elif np.dtype(DTYPES[entry["dtype"]]).itemsize * math.prod(entry["shape"]) != end - begin:
                why = f"its {end - begin} bytes are not a {entry['dtype']} {entry['shape']}"
            elif 8 + length + end > size:
                why = f"ends at byte {8 + length + end}, past the file's {size}: truncated"
            elif begin < previous_end:  # the format forbids it: two tensors would share bytes
                why = f"its bytes overlap those of {previous!r}"
            if why:
                raise CheckpointError(f"{path}: tensor {name!r}: {why}")
            entry["range"] = (8 + length + begin, 8 + length + end)
            previous_end, previous = end, name
        return header

    def __getitem__(self, name: str) -> np.ndarray:
        file, entry = self.entries[name]
        begin, end = entry["range"]
        tensor = np.empty(entry["shape"], DTYPES[entry["dtype"]])
        with open(self.directory / file, "rb") as f:
            f.seek(begin)
            read = f.readinto(tensor.reshape(-1).view(np.uint8))  # bf16 has no buffer format: read its bytes
        if read != end - begin:
            raise CheckpointError(f"{self.directory / file}: tensor {name!r}: truncated while read")
        if tensor.dtype.kind not in "iu" and not np.isfinite(tensor).all():
            bad = int(tensor.size - np.isfinite(tensor).sum())
            raise CheckpointError(
                f"{self.directory / file}: tensor {name!r} holds {bad} NaN or infinite values; training from it "
                "would skip every step"
            )
        return tensor

    def __contains__(self, name) -> bool:  # by name: a Mapping's `in` would read the tensor
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def check_names(checkpoint: Mapping, spec: Model, source: str) -> None:
    """Every tensor the spec needs is there, and every tensor there is one the spec reads."""
    needed = {name for _, param, layers in hf_layout(spec) for name in hf_names(param, layers)}
    missing = sorted(needed - set(checkpoint))
    if missing:
        raise CheckpointError(f"{source}: has no tensor {missing[0]!r}, which {spec.name} needs")
    unexpected = sorted(
        name
        for name in set(checkpoint) - needed - FAMILIES[family_name(spec)].untrained(checkpoint, spec)
        if not name.endswith(NOT_WEIGHTS) and not _tied_head(name, spec)
    )
    if unexpected:
        raise CheckpointError(
            f"{source}: holds {unexpected[0]!r}, which {spec.name} has no param for "
            f"({len(unexpected)} such tensors): a checkpoint of another model?"
        )


def _tied_head(name: str, spec: Model) -> bool:
    """A tied model's checkpoint may still hold the output projection, a copy of the embedding."""
    return spec.tie_embeddings and name == "lm_head.weight"


def convert_hf(
    spec: Model, hf_dir: Path, out: Path, overwrite: bool = False, adapter: Path | None = None
) -> dict:
    """Writes the program's params from an HF checkpoint folder (the Hub's per-expert layout or transformers 5's
    fused one) as an orbax checkpoint at `out`, published only when complete; returns the params. A spec with
    F.lora gets its base model's params, and the adapters of the PEFT folder `adapter` where given (else a run
    draws them from its seed)."""
    host_jax()
    import orbax.checkpoint as ocp

    from axgen.hf.peft import lora_of, read_adapter
    from axgen.runtime.params import joined

    out = Path(out).resolve()
    check_replaceable(out, overwrite, "_CHECKPOINT_METADATA")
    adapters = {}
    if adapter is not None:
        lora_of(spec)
        adapters = read_adapter(adapter, spec)  # refused before the base's tensors are read
    with HeldInterrupts() as interrupts:
        checkpoint = FAMILIES[family_name(spec)].from_hf(
            HFCheckpoint(hf_dir),
            spec,
            hf_shapes(spec),
            str(hf_dir),
            lambda scale: fp8_block_size(hf_dir, scale),
        )
        check_names(checkpoint, spec, str(hf_dir))
        with progress.bar(total=len(hf_shapes(spec)), desc="converting", unit="tensor") as shown:
            params = joined(params_of(_Checked(checkpoint, interrupts, shown), spec, dtype=None), adapters)
        staging = staging_dir(out)
        try:
            with ocp.Checkpointer(_uncopied_uncompressed(ocp)) as checkpointer:
                checkpointer.save(staging / "params", args=ocp.args.PyTreeSave(params))
            _record_source(staging / "params", Path(hf_dir), adapter)
            interrupts.check()
            if out.exists():
                shutil.rmtree(out)
            (staging / "params").rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return params


def _record_source(checkpoint: Path, hf_dir: Path, adapter: Path | None) -> None:
    """Where the params came from, beside them (checkpoints.SOURCE): a run started from them checks that its
    dataset was made by the same tokenizer, and takes its adapters from them where they hold a PEFT folder's.
    """
    from axgen.runtime.checkpoints import SOURCE  # after host_jax(): it imports jax

    tokenizer = hf_dir / "tokenizer.json"
    source = {
        "hf_dir": str(hf_dir.resolve()),
        "tokenizer_sha256": (
            hashlib.sha256(tokenizer.read_bytes()).hexdigest() if tokenizer.is_file() else None
        ),
        "adapter": None if adapter is None else str(Path(adapter).resolve()),
    }
    (checkpoint / SOURCE).write_text(json.dumps(source, indent=2) + "\n")


class HeldInterrupts:
    """Ctrl-C and SIGTERM while a conversion runs are held, then raised as KeyboardInterrupt at the next
    `check()` (between tensors, and before the checkpoint is published), where cleaning up is sure: raised inside
    orbax's save, one was swallowed (exit 0) or killed its executor's threads mid-write."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> HeldInterrupts:
        self.received = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self.previous = {number: signal.signal(number, self._hold) for number in self.SIGNALS}
        return self

    def _hold(self, number, frame) -> None:
        self.received = number

    def check(self) -> None:
        if self.received is not None:
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)


class _Checked(Mapping):
    """A checkpoint whose every read first raises an interrupt that arrived since the last one, and moves the
    progress bar by one tensor."""

    def __init__(self, checkpoint: Mapping, interrupts: HeldInterrupts, shown):
        self.checkpoint, self.interrupts, self.shown = checkpoint, interrupts, shown

    def __getitem__(self, name: str) -> np.ndarray:
        self.interrupts.check()
        tensor = self.checkpoint[name]
        self.shown.update(1)
        return tensor

    def __contains__(self, name) -> bool:
        return name in self.checkpoint

    def __iter__(self) -> Iterator[str]:
        return iter(self.checkpoint)

    def __len__(self) -> int:
        return len(self.checkpoint)


def _uncopied_uncompressed(ocp):
    """orbax's PyTree handler without its defensive copy of every numpy array (nothing else holds these) and
    without zstd, whose buffers held the compressed checkpoint in memory until written (22% smaller on disk for
    bf16; the peak was the price). `StandardCheckpointer.restore`, as the program uses, reads what it writes.
    """
    from orbax.checkpoint import type_handlers

    registry = type_handlers.create_type_handler_registry(
        (np.ndarray, type_handlers.NumpyHandler(deepcopy_host_arrays=False))
    )
    return ocp.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=registry)
