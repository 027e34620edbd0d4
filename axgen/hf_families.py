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

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

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
}
# The families whose HF attention takes a softmax scale other than head_dim**-0.5 (`query_pre_attn_scalar`;
# DeepSeek's YaRN mscale_all_dim).
SCALED_ATTENTION = {"gemma2", "gemma3_text", "deepseek_v2"}
# The families whose HF model gives windowed layers a RoPE theta of their own (`RoPE.local_theta`).
LOCAL_THETA = {"gemma3_text"}


def family(spec: Model) -> str:
    """The HF family whose model computes what the spec does."""
    features = {f.pass_name for f in spec.features} - TRAINING_ONLY
    moe = spec.feature("moe")
    if "gpt_oss_experts" in features:
        name = "gpt_oss"
    elif "mla" in features:
        name = "deepseek_v2"
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
        return "deepseek_v2"
    if spec.feature("qk_norm"):
        return "qwen3_moe"
    return "qwen2_moe" if spec.feature("moe").shared_hidden_dim else "mixtral"


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
}
# Families whose shared expert is named otherwise than the params' `mlp.shared_expert.` (Qwen2-MoE's): DeepSeek's
# n_shared_experts are one module, `mlp.shared_experts.`, in both of its expert layouts.
SHARED_EXPERT_NAMES = {"deepseek_v2": ".mlp.shared_experts."}
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
