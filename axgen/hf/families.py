"""The Hugging Face families a spec can be read from and written as: which family computes what a spec does, and
how that family's published checkpoints store its routed experts.

The Hub holds MoE checkpoints with one tensor per expert and projection (Mixtral:
`model.layers.L.block_sparse_moe.experts.E.w1.weight`; Qwen2-MoE: `model.layers.L.mlp.experts.E.gate_proj.weight`).
transformers 5 fuses them only when it loads (its `conversion_mapping.py`), into the names the programs' params
carry: `model.layers.L.mlp.experts.gate_up_proj` [experts, 2 * hidden, embed], each expert's gate rows over its up
rows, and `model.layers.L.mlp.experts.down_proj`; its `save_pretrained` writes the Hub's layout back. axgen reads
either layout and writes the Hub's unless asked for the fused one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from axgen.interop import CheckpointError
from axgen.spec import Model

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# The features each family's HF model computes; remat and quantize shape training only, not the weights' meaning.
TRAINING_ONLY = {"remat", "quantize"}
FAMILY_FEATURES = {
    "llama": {"rope"},
    "mistral": {"rope", "sliding_window"},
    "mixtral": {"rope", "moe"},
    "qwen2": {"rope", "qkv_bias"},
    "qwen3": {"rope", "qk_norm"},
    "qwen2_moe": {"rope", "qkv_bias", "moe"},
    "qwen3_moe": {"rope", "qk_norm", "moe"},
    "gemma2": {"rope", "gemma_block", "sliding_window", "softcap"},
    "gemma3_text": {"rope", "gemma_block", "qk_norm", "sliding_window", "softcap"},
    "gpt_oss": {
        "rope",
        "qkv_bias",
        "out_bias",
        "attention_sinks",
        "sliding_window",
        "moe",
        "gpt_oss_experts",
    },
    "deepseek_v2": {"rope", "mla", "moe"},
    "deepseek_v3": {"rope", "mla", "moe"},
}
# The families whose HF attention takes a softmax scale other than head_dim**-0.5 (`query_pre_attn_scalar`;
# DeepSeek's YaRN mscale_all_dim).
SCALED_ATTENTION = {"gemma2", "gemma3_text", "deepseek_v2", "deepseek_v3"}
# The families whose HF model gives windowed layers a RoPE theta of their own (`RoPE.local_theta`).
LOCAL_THETA = {"gemma3_text"}


def family(spec: Model) -> str:
    """The HF family whose model computes what the spec does."""
    features = {f.pass_name for f in spec.features} - TRAINING_ONLY
    moe = spec.feature("moe")
    if "gpt_oss_experts" in features:
        name = "gpt_oss"
    elif "mla" in features:
        name = _deepseek_family(spec)
    elif "gemma_block" in features:
        name = "gemma3_text" if "qk_norm" in features else "gemma2"
    elif moe is not None:
        name = _moe_family(spec)
    elif "qk_norm" in features:
        name = "qwen3"
    elif "qkv_bias" in features:
        name = "qwen2"
    else:
        name = "mistral" if "sliding_window" in features else "llama"
    extra = sorted(features - FAMILY_FEATURES[name])
    if extra:
        raise CheckpointError(
            f"{spec.origin}: {name} models in HF have no {extra[0]!r}; export-hf cannot write it"
        )
    rope = spec.feature("rope")
    if rope is not None and rope.local_theta is not None and name not in LOCAL_THETA:
        raise CheckpointError(
            f"{rope.origin}: RoPE.local_theta={rope.local_theta!r}: {name} models in HF have one theta for every layer"
        )
    attention = spec.decoder.attention
    if attention.scale is not None and name not in SCALED_ATTENTION:
        raise CheckpointError(
            f"{attention.origin}: Attention.scale={attention.scale!r}: {name} models in HF scale attention by "
            "head_dim**-0.5 only"
        )
    return name


def _moe_family(spec: Model) -> str:
    if spec.feature("mla"):
        return _deepseek_family(spec)
    if spec.feature("qk_norm"):
        return "qwen3_moe"
    return "qwen2_moe" if spec.feature("moe").shared_hidden_dim else "mixtral"


def _deepseek_family(spec: Model) -> str:
    """DeepSeek-V3 scores experts by sigmoid, V2 by softmax."""
    moe = spec.feature("moe")
    return "deepseek_v3" if moe is not None and moe.scoring == "sigmoid" else "deepseek_v2"


def mtp_tensors(names, spec: Model) -> set[str]:
    """The tensors of DeepSeek-V3's multi-token-prediction modules (num_nextn_predict_layers), which its checkpoints
    number after the decoder's layers (the Hub's `model.layers.61.*`), each marked by its `eh_proj`: axgen does not
    train them, so convert-hf leaves them out. A deeper plain model's layers have no eh_proj and stay unexpected.
    """
    if spec.feature("mla") is None or _deepseek_family(spec) != "deepseek_v3":
        return set()
    mtp = set()
    for name in names:
        parts = name.split(".")
        if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[3:] == ["eh_proj", "weight"]:
            if parts[2].isdigit() and int(parts[2]) >= spec.decoder.num_layers:
                mtp.add(f"model.layers.{parts[2]}.")
    return {name for name in names if name.startswith(tuple(mtp))}


@dataclass(frozen=True)
class ExpertLayout:
    """How a family's published checkpoints name the routed experts: `model.layers.L.<module>.gate.weight` is the
    router and `model.layers.L.<module>.experts.E.<gate|up|down>.weight` one expert's [out, in] projection."""

    module: str
    gate: str
    up: str
    down: str

    def router(self, layer: str) -> str:
        return f"{layer}.{self.module}.gate.weight"

    def expert(self, layer: str, expert: int, projection: str) -> str:
        return f"{layer}.{self.module}.experts.{expert}.{projection}.weight"


EXPERT_LAYOUTS = {
    "mixtral": ExpertLayout("block_sparse_moe", gate="w1", up="w3", down="w2"),
    "qwen2_moe": ExpertLayout("mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "qwen3_moe": ExpertLayout("mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "deepseek_v2": ExpertLayout("mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "deepseek_v3": ExpertLayout("mlp", gate="gate_proj", up="up_proj", down="down_proj"),
}
# Families whose shared expert is named otherwise than the params' `mlp.shared_expert.` (Qwen2-MoE's): DeepSeek's
# n_shared_experts are one module, `mlp.shared_experts.`, in both of its expert layouts.
SHARED_EXPERT_NAMES = {"deepseek_v2": ".mlp.shared_experts.", "deepseek_v3": ".mlp.shared_experts."}
_SHARED_EXPERT = ".mlp.shared_expert."


def family_names(tensors: Iterator[tuple[str, np.ndarray]], spec: Model) -> Iterator[tuple[str, np.ndarray]]:
    """The params' HF tensors under the names the spec's family gives them (its shared expert's)."""
    theirs = SHARED_EXPERT_NAMES.get(_moe_family(spec)) if spec.feature("moe") else None
    for name, tensor in tensors:
        yield (name.replace(_SHARED_EXPERT, theirs) if theirs else name), tensor


class SharedExpertNames(Mapping):
    """A checkpoint of a family in SHARED_EXPERT_NAMES under the params' names; every other tensor as it is."""

    def __init__(self, checkpoint: Mapping, theirs: str):
        self.checkpoint = checkpoint
        self.names = {name.replace(theirs, _SHARED_EXPERT): name for name in checkpoint}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.checkpoint[self.names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


_FUSED = re.compile(r"(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)")


def expert_layout(spec: Model) -> ExpertLayout | None:
    """The Hub's expert layout of the spec's family; None for a model without routed experts, and for gpt-oss,
    whose Hub checkpoints hold the fused tensors (in MXFP4: `Mxfp4Experts`)."""
    if spec.feature("gpt_oss_experts") is not None:
        return None
    return EXPERT_LAYOUTS[_moe_family(spec)] if spec.feature("moe") else None


def hub_tensors(
    tensors: Iterator[tuple[str, np.ndarray]], layout: ExpertLayout
) -> Iterator[tuple[str, np.ndarray]]:
    """The fused tensors as the Hub holds them: each expert's projections apart, the router renamed."""
    for name, tensor in tensors:
        match = _FUSED.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        layer, what = match.groups()
        if what == "gate.weight":
            yield layout.router(layer), tensor
        elif what == "experts.down_proj":
            yield from ((layout.expert(layer, e, layout.down), part) for e, part in enumerate(tensor))
        else:
            hidden = tensor.shape[1] // 2
            for e, part in enumerate(tensor):
                yield layout.expert(layer, e, layout.gate), part[:hidden]
                yield layout.expert(layer, e, layout.up), part[hidden:]


class FusedExperts(Mapping):
    """A Hub-layout checkpoint's tensors under the fused names the params carry; every other tensor as it is.

    Each fused tensor is stacked from its experts when asked for, so the host holds one layer's experts at a time.
    A missing expert, an expert index beyond `num_experts` and an expert tensor of another shape than its fused
    tensor's part (`shapes`: the fused HF shape of each name) are named as the Hub names them."""

    def __init__(
        self, checkpoint: Mapping, layout: ExpertLayout, num_experts: int, shapes: dict, source: str
    ):
        self.checkpoint, self.layout, self.num_experts, self.source = checkpoint, layout, num_experts, source
        self.shapes = shapes
        pattern = re.compile(
            rf"(model\.layers\.\d+)\.{re.escape(layout.module)}\.(?:experts\.(\d+)\.(\w+)\.weight|gate\.weight)"
        )
        # Each name -> the checkpoint's tensor of that name, or (layer, projections) a fused tensor stacks.
        self.names: dict[str, str | tuple[str, tuple[str, ...]]] = {}
        for name in checkpoint:
            match = pattern.fullmatch(name)
            if match is None:
                self.names[name] = name
                continue
            layer, expert, projection = match.groups()
            if expert is None:
                self.names[f"{layer}.mlp.gate.weight"] = name
            elif projection not in (layout.gate, layout.up, layout.down):
                self.names[name] = name  # not an expert projection: the name check reports it
            elif int(expert) >= num_experts:
                raise CheckpointError(
                    f"{source}: holds {name!r}, but the spec has {num_experts} experts (0 to {num_experts - 1})"
                )
            else:
                if projection == layout.down:
                    self.names[f"{layer}.mlp.experts.down_proj"] = (layer, (layout.down,))
                else:
                    self.names[f"{layer}.mlp.experts.gate_up_proj"] = (layer, (layout.gate, layout.up))

    def __getitem__(self, name: str) -> np.ndarray:
        stored = self.names[name]
        if isinstance(stored, str):
            return self.checkpoint[stored]
        layer, projections = stored
        shape = self.shapes.get(name)
        stacked = None
        for e in range(self.num_experts):
            parts = [self._part(layer, e, projection, shape, len(projections)) for projection in projections]
            expert = np.concatenate(parts) if len(parts) > 1 else parts[0]
            if stacked is None:
                stacked = np.empty((self.num_experts, *expert.shape), expert.dtype)
            stacked[e] = expert
        return stacked

    def _part(self, layer: str, expert: int, projection: str, fused_shape, count: int) -> np.ndarray:
        name = self.layout.expert(layer, expert, projection)
        if name not in self.checkpoint:
            raise CheckpointError(f"{self.source}: has no tensor {name!r}, which the spec needs")
        tensor = self.checkpoint[name]
        if fused_shape is not None:
            expected = (fused_shape[1] // count, *fused_shape[2:])
            if tuple(tensor.shape) != expected:
                raise CheckpointError(
                    f"{self.source}: tensor {name!r} is {list(tensor.shape)}; the spec needs {list(expected)}"
                )
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def fused_view(checkpoint: Mapping, spec: Model, shapes: dict, source: str) -> Mapping:
    """The checkpoint under the fused names, whichever expert layout it holds; a mix of both is an error. gpt-oss's
    MXFP4 experts are dequantized as read."""
    if spec.feature("gpt_oss_experts") is not None:
        return Mxfp4Experts(checkpoint, MODEL_DTYPES[spec.checkpoint_dtype], source)
    layout = expert_layout(spec)
    if layout is None:
        return checkpoint
    theirs = SHARED_EXPERT_NAMES.get(_moe_family(spec))
    if theirs is not None:
        checkpoint = SharedExpertNames(checkpoint, theirs)
    per_expert_name = re.compile(rf"model\.layers\.\d+\.{re.escape(layout.module)}\.experts\.\d+\.")
    fused = min((name for name in checkpoint if _FUSED.fullmatch(name) and ".experts." in name), default=None)
    per_expert = min((name for name in checkpoint if per_expert_name.match(name)), default=None)
    if fused and per_expert:
        raise CheckpointError(
            f"{source}: holds both expert layouts ({fused!r}, fused, and {per_expert!r}, one per expert)"
        )
    if per_expert is None:
        return checkpoint
    return FusedExperts(checkpoint, layout, spec.feature("moe").num_experts, shapes, source)


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
    time; every other tensor as it is. The block size is the checkpoint's config.json's (`fp8_block_size`)."""

    def __init__(self, checkpoint: Mapping, dtype, hf_dir: Path, source: str):
        self.checkpoint, self.dtype, self.source = checkpoint, dtype, source
        order = list(checkpoint)
        stored = set(order)  # names only: a Mapping's `in` would read the tensor
        scales = sorted(name for name in stored if name.endswith(FP8_SCALE))
        for scale in scales:
            if scale.removesuffix(FP8_SCALE) not in stored:
                raise CheckpointError(
                    f"{source}: holds {scale!r} without {scale.removesuffix(FP8_SCALE)!r}, the FP8 weight it scales"
                )
        self.block = fp8_block_size(hf_dir, scales[0]) if scales else None
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
