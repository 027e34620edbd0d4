"""`axgen convert-hf`: a Hugging Face checkpoint folder (sharded safetensors and their index, or one
model.safetensors) becomes an orbax checkpoint of the emitted program's params, which the program starts from with
`--init-from`.

Tensors are read one at a time and keep their dtype (bf16 stays bf16; the program casts to its own on restore),
so the host holds the params once, plus one tensor while a param's layers are stacked (bench/hf_convert.py).
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from axgen.files import check_replaceable, staging_dir
from axgen.interop import CheckpointError, hf_layout, hf_names, hf_to_params, host_jax
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
}
# Tensors some checkpoints carry that are not weights: RoPE's inverse frequencies, recomputed from theta.
NOT_WEIGHTS = ("rotary_emb.inv_freq",)


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
        self.entries = {name: (file, entry) for file in files for name, entry in self._header(file).items()}

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
        header.pop("__metadata__", None)
        size = path.stat().st_size
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            entry["range"] = (8 + length + begin, 8 + length + end)
            if entry["range"][1] > size or entry["dtype"] not in DTYPES:
                why = "truncated" if entry["range"][1] > size else f"dtype {entry['dtype']} is not read"
                raise CheckpointError(f"{path}: tensor {name!r}: {why}")
        return header

    def __getitem__(self, name: str) -> np.ndarray:
        file, entry = self.entries[name]
        begin, end = entry["range"]
        tensor = np.empty(entry["shape"], DTYPES[entry["dtype"]])
        if tensor.nbytes != end - begin:
            raise CheckpointError(f"{self.directory / file}: tensor {name!r} is not {entry['shape']}")
        with open(self.directory / file, "rb") as f:
            f.seek(begin)
            f.readinto(tensor.reshape(-1).view(np.uint8))  # bf16 has no buffer format: read its bytes
        return tensor

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
        for name in set(checkpoint) - needed
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


def convert_hf(spec: Model, hf_dir: Path, out: Path, overwrite: bool = False) -> dict:
    """Writes the program's params from an HF checkpoint folder as an orbax checkpoint at `out`, published only
    when complete; returns the params."""
    host_jax()
    import orbax.checkpoint as ocp

    out = Path(out).resolve()
    check_replaceable(out, overwrite, "_CHECKPOINT_METADATA")
    checkpoint = HFCheckpoint(hf_dir)
    check_names(checkpoint, spec, str(hf_dir))
    params = hf_to_params(checkpoint, spec, dtype=None)
    staging = staging_dir(out)
    try:
        with ocp.Checkpointer(_uncopied_uncompressed(ocp)) as checkpointer:
            checkpointer.save(staging / "params", args=ocp.args.PyTreeSave(params))
        if out.exists():
            shutil.rmtree(out)
        (staging / "params").rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return params


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
