"""A Hugging Face family's adapter: everything axgen knows of one family, in both directions, in one object
(`Family`), which `import-hf`, `convert-hf`, `export-hf` and `axgen.interop.hf_to_params` all read. Each family
module (llama.py, qwen.py, gemma.py, gpt_oss.py, deepseek.py) states its families; `axgen.hf.families` lists them
and picks the one a spec is.

- config.json: `read` takes a config (`axgen.hf.config.Config`) to the spec's source (import-hf); `write` takes a
  spec to the family's own keys of config.json (export-hf adds those every family shares); `defaults` are the
  values its transformers config class gives the keys a config leaves out.
- tensors: the params carry transformers 5's in-memory names (`Param.hf`): routed experts fused
  (`model.layers.L.mlp.experts.gate_up_proj` [experts, 2 * hidden, embed], each expert's gate rows over its up
  rows, and `...experts.down_proj`), a shared expert as `mlp.shared_expert.`. `from_hf` views a checkpoint in the
  family's names (the Hub's one tensor per expert, or fused; its shared-expert name; FP8 blocks and MXFP4 experts
  dequantized) under the params' names, and `to_hf` is its inverse: the params' tensors in the family's names, the
  experts as the Hub holds them (one tensor per expert and projection: Mixtral's
  `model.layers.L.block_sparse_moe.experts.E.w1.weight`) unless asked for the fused layout. transformers 5 fuses the
  Hub's experts only when it loads (its `conversion_mapping.py`) and its `save_pretrained` writes them back apart.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from axgen.hf.storage import MODEL_DTYPES, Fp8Blocks, Mxfp4Experts
from axgen.interop import CheckpointError
from axgen.spec import Model


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


# Qwen2-MoE's and DeepSeek's layout (Mixtral's is its own).
GATE_UP_DOWN = ExpertLayout("mlp", gate="gate_proj", up="up_proj", down="down_proj")
# The params' name of a shared expert (Qwen2-MoE's).
SHARED_EXPERT = ".mlp.shared_expert."


def no_untrained_tensors(names: Iterable[str], spec: Model) -> set[str]:
    return set()


@dataclass(frozen=True)
class Family:
    """One Hugging Face family, both directions (see the module's docstring)."""

    model_type: str
    read: Callable  # (Config) -> SpecSource
    defaults: Mapping[str, object]
    # (Model) -> the family's own config.json keys; None for a config import-hf reads and export-hf never writes
    # (Gemma 3's image-text config, whose text model is gemma3_text).
    write: Callable[[Model], dict] | None = None
    architecture: str | None = None
    # The features its HF model computes (remat and quantize shape training only, and go with every family).
    features: frozenset[str] = frozenset()
    # Its HF attention takes a softmax scale other than head_dim**-0.5 (Gemma's query_pre_attn_scalar, DeepSeek's
    # YaRN mscale_all_dim).
    scaled_attention: bool = False
    # Its HF model gives windowed layers a RoPE theta of their own (`RoPE.local_theta`).
    local_theta: bool = False
    # Its config states DeepSeek's layout: RoPE on part of each head in adjacent pairs, routed experts' weights
    # scaled, DeepSeek's routing (scoring, correction bias, groups, leading dense layers).
    deepseek_layout: bool = False
    # The Hub's per-expert names of its routed experts; None where its checkpoints hold the fused tensors (gpt-oss).
    experts: ExpertLayout | None = None
    # Its name for the params' shared expert, `.mlp.shared_expert.` (DeepSeek's n_shared_experts: `shared_experts`).
    shared_expert: str = SHARED_EXPERT
    # How its published checkpoints store weights (quantization_config.quant_method): "mxfp4", "fp8" or None.
    storage: str | None = None
    # The tensors of its checkpoints that axgen does not train (DeepSeek-V3's multi-token prediction), of `names`.
    untrained: Callable[[Iterable[str], Model], set[str]] = no_untrained_tensors
    # Its config.json keys that state tensors export-hf does not write (quantized storage, untrained layers): written
    # as the spec's config states them (or left out), whatever a base config says.
    not_exported: tuple[str, ...] = ()

    def from_hf(
        self,
        checkpoint: Mapping,
        spec: Model,
        shapes: dict,
        source: str,
        fp8_block: Callable[[str], tuple[int, int]],
    ) -> Mapping:
        """The checkpoint (name -> array, in the family's names, either expert layout) under the params' names, each
        tensor read when asked for: FP8 blocks dequantized first, under the family's names, so that experts are
        stacked from their weights; MXFP4 experts dequantized; the shared expert renamed; the Hub's per-expert
        tensors stacked into the fused ones (a mix of both layouts is an error). `shapes` are the fused HF shapes
        of the spec's tensors, `fp8_block` the block size of a checkpoint holding FP8 scales
        (`axgen.hf.storage.Fp8Blocks`)."""
        dtype = MODEL_DTYPES[spec.checkpoint_dtype]
        checkpoint = Fp8Blocks(checkpoint, dtype, fp8_block, source)
        if self.storage == "mxfp4":
            checkpoint = Mxfp4Experts(checkpoint, dtype, source)
        if self.shared_expert != SHARED_EXPERT:
            checkpoint = SharedExpertNames(checkpoint, self.shared_expert)
        if self.experts is None or spec.feature("moe") is None:
            return checkpoint
        per_expert_name = re.compile(rf"model\.layers\.\d+\.{re.escape(self.experts.module)}\.experts\.\d+\.")
        fused = min(
            (name for name in checkpoint if _FUSED.fullmatch(name) and ".experts." in name), default=None
        )
        per_expert = min((name for name in checkpoint if per_expert_name.match(name)), default=None)
        if fused and per_expert:
            raise CheckpointError(
                f"{source}: holds both expert layouts ({fused!r}, fused, and {per_expert!r}, one per expert)"
            )
        if per_expert is None:
            return checkpoint
        return FusedExperts(checkpoint, self.experts, spec.feature("moe").num_experts, shapes, source)

    def to_hf(
        self, tensors: Iterator[tuple[str, np.ndarray]], fused_experts: bool = False
    ) -> Iterator[tuple[str, np.ndarray]]:
        """`from_hf`'s inverse: the params' HF tensors (`axgen.interop.iter_hf_tensors`) in the family's names, the
        routed experts as its published checkpoints hold them unless `fused_experts` (transformers 5's layout in
        memory, which it also loads). Weights are written as the model computes with them: never quantized."""
        if self.experts is not None and not fused_experts:
            tensors = hub_tensors(tensors, self.experts)
        for name, tensor in tensors:
            yield name.replace(SHARED_EXPERT, self.shared_expert), tensor


class SharedExpertNames(Mapping):
    """A checkpoint whose shared expert is named `theirs` under the params' names; every other tensor as it is."""

    def __init__(self, checkpoint: Mapping, theirs: str):
        self.checkpoint = checkpoint
        self.names = {name.replace(theirs, SHARED_EXPERT): name for name in checkpoint}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.checkpoint[self.names[name]]

    def __contains__(self, name) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


_FUSED = re.compile(r"(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)")


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

    def __contains__(self, name) -> bool:  # by name: a Mapping's `in` would stack the experts
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
