"""Tensor and parameter types in named axes. Sizes are concrete except `None` for axes known only at run time."""

from __future__ import annotations

from dataclasses import dataclass

RUNTIME_AXES = ("batch", "seq")

# The logical axes every tensor and param is named in, each with the letter it has in an emitted einsum
# ("bse,ehd->bshd"). The backends' rules table maps each of them to mesh axes.
LOGICAL_AXES: dict[str, str] = {
    "batch": "b",
    "seq": "s",
    "embed": "e",
    "heads": "h",
    "kv_heads": "k",
    "head_dim": "d",
    "mlp": "f",
    "vocab": "v",
    "expert": "x",
    "latent": "r",  # MLA's low-rank latents of the queries and of the keys and values
    "amax_history": "a",  # fp8 delayed scaling's history of maxima
    "fp8_operand": "o",  # x, w and the gradient of an fp8 dot
    "layers": "l",  # a block's params stacked over its layers
    "lora_rank": "n",  # a low-rank adapter's rank (F.lora)
    # The residual stream's embed where MeshRule.shard_residual splits it over `model`: a name of the constraints
    # between layers (the `shard` lowering), not of a tensor type, so the layers' weights keep `embed`'s rule.
    "residual_embed": "c",
}


@dataclass(frozen=True)
class TensorType:
    axes: tuple[str, ...]
    sizes: tuple[int | None, ...]

    def __post_init__(self) -> None:
        unknown = [a for a in self.axes if a not in LOGICAL_AXES]
        if unknown:
            raise ValueError(
                f"unknown logical axis {unknown[0]!r}; axes are {', '.join(LOGICAL_AXES)} (ir/types.py)"
            )

    @classmethod
    def of(cls, *axes: str | tuple[str, int]) -> TensorType:
        """`TensorType.of("batch", "seq", ("embed", 64))`: bare names are run-time sized."""
        named = [(a, None) if isinstance(a, str) else a for a in axes]
        return cls(tuple(n for n, _ in named), tuple(s for _, s in named))

    def size(self, axis: str) -> int | None:
        return self.sizes[self.axes.index(axis)]

    def drop(self, *axes: str) -> TensorType:
        kept = [(a, s) for a, s in zip(self.axes, self.sizes) if a not in axes]
        return TensorType(tuple(a for a, _ in kept), tuple(s for _, s in kept))

    def concat(self, other: TensorType) -> TensorType:
        return TensorType(self.axes + other.axes, self.sizes + other.sizes)

    def __str__(self) -> str:
        return "[" + ", ".join(a if s is None else f"{a}={s}" for a, s in zip(self.axes, self.sizes)) + "]"


@dataclass(frozen=True)
class HFWeight:
    """Where a param lives in a Hugging Face checkpoint: its tensor `name` (`{layer}` stands for the layer index),
    which of `chunk=(index, count)` equal parts along the second-to-last axis it is, when HF fuses several,
    which of `interleave=(index, count)` parts whose columns alternate along the last axis it is (`[..., index::count]`:
    gpt-oss's fused gate and up projections), and whether HF keeps its last two axes the other way round
    (`transpose`: torch's Linear stores [out, in]).
    """

    name: str
    transpose: bool = False
    chunk: tuple[int, int] | None = None
    interleave: tuple[int, int] | None = None


@dataclass(frozen=True)
class Param:
    """A learned tensor. `key` is its name in the params tree; `axes` are logical, mapped to mesh axes later."""

    key: str
    type: TensorType
    init: str = "normal"  # normal(0, std) | ones | zeros | kaiming_uniform (PEFT's lora_A)
    std: float = 0.02
    decay: bool = True  # whether AdamW's weight decay applies
    trained: bool = True  # False: a statistic the step overwrites with what backward returns for it
    # A statistic whose backward value is each expert's load: the step moves it by this rate toward balance.
    balance_rate: float | None = None
    hf: HFWeight | None = None  # None: not in HF checkpoints (starts from its init)
    # Loaded and never trained: no gradient, no optimizer moments, not in the run's checkpoints (F.lora's base).
    frozen: bool = False
    dtype: str = "float32"  # how the program stores it (F.lora's base may be bfloat16)
    # A low-rank adapter (F.lora): `hf` names its tensor in a PEFT adapter file, not in the model's checkpoint.
    adapter: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for s in self.type.sizes if s is not None)

    def __str__(self) -> str:
        init = f"normal({self.std})" if self.init == "normal" else self.init
        flags = "".join(
            [
                "" if self.decay else " no-decay",
                "" if self.trained else " untrained",
                " frozen" if self.frozen else "",
                f" {self.dtype}" if self.dtype != "float32" else "",
                " adapter" if self.adapter else "",
            ]
        )
        return f"{self.key}{self.type} {init}{flags}{self._balanced()}"

    def _balanced(self) -> str:
        return "" if self.balance_rate is None else f" balance_rate={self.balance_rate}"
