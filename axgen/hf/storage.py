"""How published checkpoints store weights otherwise than the model computes with them, read as the weights: gpt-oss's
MXFP4 experts (`quantization_config.quant_method` mxfp4) and DeepSeek-V3's FP8 blocks (fp8). Each is a view of a
checkpoint (name -> array) that dequantizes one tensor when it is asked for; a family's adapter
(`axgen.hf.adapter.Family.from_hf`) puts them under its names.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from axgen.interop import CheckpointError

# --- gpt-oss's MXFP4 experts ---------------------------------------------------------------------------------------

# The e2m1 value of each 4-bit code (sign bit high), as transformers' integrations/mxfp4.py FP4_VALUES.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
MODEL_DTYPES = {
    None: np.float32,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype, name: str) -> np.ndarray:
    """`name`_blocks [experts, rows, groups, 16] (uint8: two e2m1 codes a byte, the low nibble first) and
    `name`_scales [experts, rows, groups] (uint8 e8m0: 2**(s - 127) for each group of 32 values) as the weight HF's
    model holds, [experts, groups * 32, rows] in `dtype`: what transformers' convert_moe_packed_tensors makes.
    """
    if (
        blocks.dtype != np.uint8
        or scales.dtype != np.uint8
        or blocks.ndim != 4
        or blocks.shape[-1] != 16
        or blocks.shape[:-1] != scales.shape
    ):
        raise CheckpointError(
            f"{name}_blocks {blocks.dtype}{list(blocks.shape)} with {name}_scales {scales.dtype}{list(scales.shape)} "
            "are not MXFP4 experts (blocks uint8 [experts, rows, groups, 16], scales uint8 [experts, rows, groups])"
        )
    values = np.empty((*blocks.shape[:-1], 32), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    with np.errstate(over="ignore"):  # an overflow is inf, which the reader refuses by name
        values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    experts, rows, groups, _ = blocks.shape
    return np.ascontiguousarray(values.reshape(experts, rows, groups * 32).swapaxes(1, 2), dtype)


class Mxfp4Experts(Mapping):
    """A gpt-oss checkpoint's tensors with each MXFP4 pair, `X_blocks` and `X_scales` (the Hub's experts), read as
    the one weight `X` in `dtype`; every other tensor as it is. A pair with one half missing is named."""

    def __init__(self, checkpoint: Mapping, dtype, source: str):
        self.checkpoint, self.dtype, self.source = checkpoint, dtype, source
        self.names: dict[str, str | None] = (
            {}
        )  # name -> the checkpoint's tensor, or None for a dequantized pair
        for name in checkpoint:
            stem, suffix = name.rsplit("_", 1) if name.endswith(("_blocks", "_scales")) else (name, None)
            if suffix is None:
                self.names[name] = name
                continue
            partner = f"{stem}_{'scales' if suffix == 'blocks' else 'blocks'}"
            if partner not in checkpoint:
                raise CheckpointError(f"{source}: holds {name!r} without {partner!r}, its MXFP4 other half")
            self.names[stem] = None

    def __getitem__(self, name: str) -> np.ndarray:
        stored = self.names[name]
        if stored is not None:
            return self.checkpoint[stored]
        blocks, scales = self.checkpoint[f"{name}_blocks"], self.checkpoint[f"{name}_scales"]
        try:
            weight = dequantize_mxfp4(blocks, scales, self.dtype, name)
        except CheckpointError as err:
            raise CheckpointError(f"{self.source}: {err}") from None
        if not np.isfinite(weight).all():  # scale 255 is e8m0's NaN; 254 overflows float16
            bad = int(weight.size - np.isfinite(weight).sum())
            raise CheckpointError(
                f"{self.source}: {name}_scales make {bad} infinite or NaN weights; training from them would skip "
                "every step"
            )
        return weight

    def __contains__(self, name) -> bool:  # by name: a Mapping's `in` would dequantize the tensor
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


# --- DeepSeek-V3's FP8 blocks --------------------------------------------------------------------------------------

# `X_scale_inv` beside `X`: the Hub's `*.weight_scale_inv`, and a fused expert tensor's likewise.
FP8_SCALE = "_scale_inv"


def fp8_block_size(hf_dir: Path, scale_name: str) -> tuple[int, int]:
    """The block (rows, columns) each float32 scale_inv covers, as the checkpoint folder's config.json states it
    (quantization_config.weight_block_size): a scale grid alone does not tell it where the edge blocks are partial.
    `scale_name` is a scale the checkpoint holds, for the error.
    """
    path = Path(hf_dir) / "config.json"
    try:
        storage = json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        storage = None
    block = storage.get("weight_block_size") if isinstance(storage, dict) else None
    if not (
        isinstance(storage, dict)
        and storage.get("quant_method") == "fp8"
        and isinstance(block, list)
        and len(block) == 2
        and all(type(size) is int and size > 0 for size in block)
    ):
        raise CheckpointError(
            f"{hf_dir}: holds {scale_name!r}, but {path.name} beside it states no FP8 quantization_config with a "
            f"weight_block_size of two sizes (found {storage!r}), so the blocks' size is unknown"
        )
    return block[0], block[1]


def dequantize_fp8_blocks(
    weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], dtype, name: str
) -> np.ndarray:
    """`name` (float8_e4m3fn [..., rows, columns]) times the float32 `name`_scale_inv of its block
    ([..., ceil(rows / block[0]), ceil(columns / block[1])]; the last row and column of blocks may be partial),
    multiplied in float32 and then cast to `dtype`, as transformers' Fp8Dequantize and DeepSeek's weight_dequant.
    """
    rows, columns = weight.shape[-2:] if weight.ndim >= 2 else (0, 0)
    grid = (*weight.shape[:-2], -(-rows // block[0]), -(-columns // block[1]))
    if (
        weight.dtype != ml_dtypes.float8_e4m3fn
        or scale_inv.dtype != np.float32
        or weight.ndim < 2
        or scale_inv.shape != grid
    ):
        raise CheckpointError(
            f"tensor {name!r} {weight.dtype}{list(weight.shape)} with {name + FP8_SCALE!r} "
            f"{scale_inv.dtype}{list(scale_inv.shape)} are not FP8 blocks of {block[0]} x {block[1]} "
            f"(float8_e4m3fn [..., rows, columns] and float32 [..., ceil(rows / {block[0]}), "
            f"ceil(columns / {block[1]})])"
        )
    scales = np.repeat(np.repeat(scale_inv, block[0], axis=-2)[..., :rows, :], block[1], axis=-1)
    with np.errstate(over="ignore"):  # an overflow is inf, which the reader refuses by name
        return (weight.astype(np.float32) * scales[..., :columns]).astype(dtype)


class Fp8Blocks(Mapping):
    """A checkpoint's tensors with each FP8 pair, `X` and `X_scale_inv` (DeepSeek-V3's projections on the Hub,
    `X` a `*.weight`, or a fused expert tensor), read as the one weight `X` dequantized to `dtype`, one tensor at a
    time; every other tensor as it is. `block_size` gives the block each scale covers, from the name of a scale the
    checkpoint holds (`fp8_block_size` of its folder's config.json), asked only where there are scales."""

    def __init__(self, checkpoint: Mapping, dtype, block_size: Callable[[str], tuple[int, int]], source: str):
        self.checkpoint, self.dtype, self.source = checkpoint, dtype, source
        order = list(checkpoint)
        stored = set(order)  # names only: a Mapping's `in` would read the tensor
        scales = sorted(name for name in stored if name.endswith(FP8_SCALE))
        for scale in scales:
            if scale.removesuffix(FP8_SCALE) not in stored:
                raise CheckpointError(
                    f"{source}: holds {scale!r} without {scale.removesuffix(FP8_SCALE)!r}, the FP8 weight it scales"
                )
        self.block = block_size(scales[0]) if scales else None
        self.quantized = {scale.removesuffix(FP8_SCALE) for scale in scales}
        self.order = [name for name in order if not name.endswith(FP8_SCALE)]
        self.names = set(self.order)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.names:
            raise KeyError(name)
        if name not in self.quantized:
            tensor = self.checkpoint[name]
            if tensor.dtype == ml_dtypes.float8_e4m3fn:
                raise CheckpointError(
                    f"{self.source}: tensor {name!r} is float8_e4m3fn without {name + FP8_SCALE!r} to scale it"
                )
            return tensor
        try:
            weight = dequantize_fp8_blocks(
                self.checkpoint[name], self.checkpoint[name + FP8_SCALE], self.block, self.dtype, name
            )
        except CheckpointError as err:
            raise CheckpointError(f"{self.source}: {err}") from None
        if not np.isfinite(weight).all():  # a scale whose products overflow the dtype
            bad = int(weight.size - np.isfinite(weight).sum())
            raise CheckpointError(
                f"{self.source}: {name + FP8_SCALE} make {bad} infinite weights in {np.dtype(self.dtype).name}; "
                "training from them would skip every step"
            )
        return weight

    def __contains__(self, name) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)
