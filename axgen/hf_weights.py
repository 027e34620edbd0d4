"""`axgen convert-hf`: a Hugging Face checkpoint folder (sharded safetensors and their index, or one
model.safetensors) becomes an orbax checkpoint of the emitted program's params, which the program starts from with
`--init-from`.

Tensors are read one at a time from memory-mapped shards and keep their dtype (bf16 stays bf16; the program casts
to its own on restore), so the host holds the params once, plus one param's layers while they are stacked.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from axgen.interop import CheckpointError, hf_layout, hf_names, hf_to_params, host_jax
from axgen.spec import Model

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Tensors some checkpoints carry that are not weights: RoPE's inverse frequencies, recomputed from theta.
NOT_WEIGHTS = ("rotary_emb.inv_freq",)


class HFCheckpoint(Mapping):
    """A checkpoint folder's tensors by name, each read from its shard when asked for."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._handles: dict[str, object] = {}
        if (self.directory / INDEX).is_file():
            self.files = self._index()
        elif (self.directory / SINGLE).is_file():
            self.files = dict.fromkeys(self._open(SINGLE).keys(), SINGLE)
        else:
            raise CheckpointError(f"{self.directory}: holds neither {INDEX} nor {SINGLE}")

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

    def _open(self, file: str):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(self.directory / file), framework="numpy")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(
                    f"{self.directory / file}: not a readable safetensors file ({err})"
                ) from None
        return self._handles[file]

    def __getitem__(self, name: str) -> np.ndarray:
        file = self.files[name]
        try:
            return self._open(file).get_tensor(name)
        except SafetensorError as err:
            raise CheckpointError(f"{self.directory / file}: tensor {name!r} is unreadable ({err})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


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
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out}: already exists (pass --force to replace it)")
    checkpoint = HFCheckpoint(hf_dir)
    check_names(checkpoint, spec, str(hf_dir))
    params = hf_to_params(checkpoint, spec, dtype=None)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(staging / "params", params)
        if out.exists():
            shutil.rmtree(out)
        (staging / "params").rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return params
