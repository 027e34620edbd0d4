"""The spec vocabulary: frozen dataclasses that a model spec file builds.

Every object remembers where it was constructed (`origin`, a spec file:line) and validates itself on
construction, so an error reads `specs/x.py:14: Attention.num_kv_heads=5 does not divide num_heads=32`.
Standard library only: spec files import this module and nothing else from axgen.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "AdamW",
    "Attention",
    "Decoder",
    "Feature",
    "GemmaBlock",
    "LayerNorm",
    "MLP",
    "MeshRule",
    "MoE",
    "Model",
    "Origin",
    "QKNorm",
    "QKVBias",
    "Quantize",
    "SlidingWindow",
    "SoftCap",
    "RMSNorm",
    "Remat",
    "RoPE",
    "RopeScaling",
    "SpecError",
    "Train",
    "features",
]

ACTIVATIONS = ("swiglu", "gelu")
QUANTIZE_DTYPES = ("int8", "fp8")
FP8_SCALINGS = ("current", "delayed")


@dataclass(frozen=True)
class RematPolicy:
    """Which projections' outputs (by role: qkv_proj, out_proj, mlp_in, mlp_out) backward keeps on the device and
    which it moves to host memory; everything else in a layer is recomputed. `checkpoint=False`: no remat."""

    save: tuple[str, ...]
    offload: tuple[str, ...]
    why: str
    checkpoint: bool = True


_DOTS = ("qkv_proj", "out_proj", "mlp_in", "mlp_out")
REMAT_POLICIES = {
    "none": RematPolicy((), (), "keep every activation: no rematerialisation", checkpoint=False),
    "full": RematPolicy((), (), "keep each layer's input only; recompute the whole layer in backward"),
    "save_dots": RematPolicy(
        _DOTS, (), "keep every projection's output; recompute norms, rope, attention and activations"
    ),
    "save_dots_except_mlp": RematPolicy(
        _DOTS[:2], (), "keep attention projections; recompute the MLP, the widest tensors"
    ),
    "save_qkv_proj": RematPolicy(_DOTS[:1], (), "keep q, k, v; recompute the rest"),
    "save_out_proj": RematPolicy(_DOTS[1:2], (), "keep the attention output projection; recompute the rest"),
    "offload_dots": RematPolicy(
        (), _DOTS, "move every projection's output to host memory and back for backward"
    ),
}
# Outermost first: `model` is innermost so its collectives use the fastest links between neighbouring devices.
MESH_AXES = ("data", "fsdp", "expert", "model")
ATTENTION_KERNELS = ("xla", "splash", "cudnn")
COMPUTE_DTYPES = ("float32", "bfloat16")
_THIS_FILE = str(Path(__file__).resolve())
_PACKAGE = Path(__file__).resolve().parent


class SpecError(ValueError):
    """A one-line error that names the field, the value, and the spec file:line of the offending object."""


@dataclass(frozen=True)
class Origin:
    """Where a spec object was constructed."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def display_path(filename: str) -> str:
    """A stable, short name for a spec file: `specs/x.py` for files in a `specs/` folder, and `backends/x.py`
    for a backend's own defaults, wherever the command runs."""
    path = Path(filename).resolve()
    if path.parent.name == "specs":
        return f"specs/{path.name}"
    if path.is_relative_to(_PACKAGE):
        return str(path.relative_to(_PACKAGE))
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _caller_origin() -> Origin:
    """The first frame outside this module and the dataclasses machinery: the spec line that built the object."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = filename == _THIS_FILE or filename.startswith("<") or filename == dataclasses.__file__
        if not internal:
            return Origin(display_path(filename), frame.f_lineno)
        frame = frame.f_back
    return Origin("<unknown>", 0)


def suggest(name: str, known: typing.Iterable[str]) -> str:
    """`; did you mean 'x'?` when `name` is close to one of `known`, else an empty string."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


@dataclass(frozen=True, kw_only=True)
class SpecNode:
    """Base of every spec object: records its origin, normalises lists to tuples, checks types, validates."""

    origin: Origin | None = field(default=None, compare=False, repr=False)
    # The Hugging Face config key that supplies each field whose value changes a model's numbers: such a field has
    # no default, and the error for a missing one names the key.
    HF_KEYS: typing.ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        if self.origin is None:
            object.__setattr__(self, "origin", _caller_origin())
        elif not isinstance(self.origin, Origin):
            raise SpecError(
                f"{_caller_origin()}: {type(self).__name__}.origin={self.origin!r} is where axgen records "
                "the line that built the object; a spec does not set it"
            )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
        self._check_types()
        self.validate()

    def validate(self) -> None:
        """Checks of this object's own fields; subclasses extend it."""

    def replace(self, **changes) -> typing.Self:
        """A copy with `changes` applied; the copy's origin is the line that called `replace`."""
        known = {f.name for f in dataclasses.fields(self)} - {"origin"}
        for name in changes:
            if name not in known:
                raise SpecError(
                    f"{_caller_origin()}: {type(self).__name__} has no field {name!r}{suggest(name, known)}"
                )
        return dataclasses.replace(self, origin=_caller_origin(), **changes)

    def fail(self, field_name: str, message: str) -> typing.NoReturn:
        value = getattr(self, field_name)
        raise SpecError(f"{self.origin}: {type(self).__name__}.{field_name}={value!r} {message}")

    def require_positive(self, *field_names: str) -> None:
        for name in field_names:
            if getattr(self, name) <= 0:
                self.fail(name, "must be > 0")

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            if f.name == "origin":
                continue
            expected = hints[f.name]
            value = getattr(self, f.name)
            if not _matches(value, expected):
                self.fail(f.name, f"must be {_type_name(expected)}")
            if isinstance(value, float) and not math.isfinite(value):
                self.fail(f.name, "must be a finite number")


def _matches(value, expected) -> bool:
    origin = typing.get_origin(expected)
    if expected is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(expected))
    if origin is tuple:
        item_type = typing.get_args(expected)[0]
        return isinstance(value, tuple) and all(_matches(v, item_type) for v in value)
    if origin is dict:
        key_type, value_type = typing.get_args(expected)
        return isinstance(value, dict) and all(
            _matches(k, key_type) and _matches(v, value_type) for k, v in value.items()
        )
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _type_name(expected) -> str:
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(expected))
    if origin is tuple:
        return f"a list of {_plural_name(typing.get_args(expected)[0])}"
    if origin is dict:
        key_type, value_type = typing.get_args(expected)
        return f"a dict of {_plural_name(key_type)} to {_plural_name(value_type)}"
    if expected is type(None):
        return "None"
    article = "an" if expected.__name__[0] in "aeiou" else "a"
    return f"{article} {expected.__name__}"


def _plural_name(expected) -> str:
    """What a list or dict holds: `str`, `Feature`, `int or None`, without the article of a single value."""
    return re.sub(r"\ban? ", "", _type_name(expected))


# --- model structure -------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RMSNorm(SpecNode):
    HF_KEYS = {"eps": "rms_norm_eps"}
    eps: float

    def validate(self) -> None:
        self.require_positive("eps")


@dataclass(frozen=True, kw_only=True)
class LayerNorm(SpecNode):
    HF_KEYS = {"eps": "layer_norm_eps"}
    eps: float

    def validate(self) -> None:
        self.require_positive("eps")


@dataclass(frozen=True, kw_only=True)
class Attention(SpecNode):
    """Causal multi-head attention; `num_kv_heads < num_heads` is grouped-query attention."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def validate(self) -> None:
        self.require_positive("num_heads", "num_kv_heads", "head_dim")
        if self.num_heads % self.num_kv_heads:
            self.fail("num_kv_heads", f"does not divide num_heads={self.num_heads}")


@dataclass(frozen=True, kw_only=True)
class MLP(SpecNode):
    HF_KEYS = {"hidden_dim": "intermediate_size", "activation": "hidden_act (silu: swiglu)"}
    hidden_dim: int
    activation: str

    def validate(self) -> None:
        self.require_positive("hidden_dim")
        if self.activation not in ACTIVATIONS:
            self.fail(
                "activation",
                f"is not one of {', '.join(ACTIVATIONS)}{suggest(self.activation, ACTIVATIONS)}",
            )


@dataclass(frozen=True, kw_only=True)
class Decoder(SpecNode):
    """`num_layers` identical pre-norm layers: x + attention(norm(x)), then x + mlp(norm(x))."""

    num_layers: int
    attention: Attention
    mlp: MLP
    norm: RMSNorm | LayerNorm

    def validate(self) -> None:
        self.require_positive("num_layers")


# --- training ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AdamW(SpecNode):
    """AdamW with linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""

    lr: float
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1

    def validate(self) -> None:
        self.require_positive("lr", "eps")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                self.fail(name, "must be in [0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            self.fail("min_lr_ratio", "must be in [0, 1]")
        if self.weight_decay < 0:
            self.fail("weight_decay", "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class Train(SpecNode):
    seq_len: int
    global_batch: int
    steps: int = 1000
    optimizer: AdamW = field(default_factory=lambda: AdamW(lr=3e-4))
    warmup_steps: int = 100
    grad_clip: float | None = 1.0
    seed: int = 0
    checkpoint_every: int = 100

    def validate(self) -> None:
        self.require_positive("seq_len", "global_batch", "steps", "checkpoint_every")
        # The program seeds jax.random.key (32 bits without x64) and numpy's default_rng (no negatives) with it.
        if not 0 <= self.seed < 2**32:
            self.fail("seed", "must be in [0, 2**32)")
        if not 0 <= self.warmup_steps < self.steps:
            self.fail("warmup_steps", f"must be in [0, steps={self.steps})")
        if self.grad_clip is not None and self.grad_clip <= 0:
            self.fail("grad_clip", "must be > 0 (or None for no clipping)")


# --- features: each one is applied by the pass of the same name in axgen/passes/ --------------------------------


@dataclass(frozen=True, kw_only=True)
class Feature(SpecNode):
    """A feature config; `pass_name` names the pass in axgen/passes/ that applies it."""

    pass_name: typing.ClassVar[str]

    def check_model(self, model: Model) -> None:
        """Checks of the feature against the model it is part of; subclasses extend it."""

    def requires(self) -> tuple[str, ...]:
        """Chip capabilities the feature needs (`host_offload`, `int8`, `fp8`); a target without one is an error."""
        return ()

    def summary(self) -> str:
        """`rope(theta=500000.0)`: how the feature is named in an emitted file's header."""
        args = ", ".join(
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if f.name not in ("origin", *self.unremarkable()) and getattr(self, f.name) not in (None, False)
        )
        return f"{self.pass_name}({args})"

    def unremarkable(self) -> tuple[str, ...]:
        """Fields the summary leaves out because their values say nothing here."""
        return ()


@dataclass(frozen=True, kw_only=True)
class RopeScaling(SpecNode):
    """Llama-3 frequency scaling: long wavelengths slowed by `factor`, short kept, a smooth band between."""

    HF_KEYS = {
        "factor": "rope_scaling.factor",
        "low_freq_factor": "rope_scaling.low_freq_factor",
        "high_freq_factor": "rope_scaling.high_freq_factor",
        "original_max_position": "rope_scaling.original_max_position_embeddings",
    }
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def __str__(self) -> str:
        return (
            f"llama3(factor={self.factor}, low={self.low_freq_factor}, high={self.high_freq_factor}, "
            f"original_max_position={self.original_max_position})"
        )

    def validate(self) -> None:
        self.require_positive("factor", "low_freq_factor", "original_max_position")
        if self.high_freq_factor <= self.low_freq_factor:
            self.fail("high_freq_factor", f"must be > low_freq_factor={self.low_freq_factor}")


@dataclass(frozen=True, kw_only=True)
class RoPE(Feature):
    """Rotary position embeddings on queries and keys (rotate-half layout, as in HF Llama)."""

    pass_name: typing.ClassVar[str] = "rope"
    HF_KEYS = {"theta": "rope_theta (transformers 5: rope_parameters.rope_theta)"}
    theta: float
    scaling: RopeScaling | None = None

    def validate(self) -> None:
        self.require_positive("theta")

    def check_model(self, model: Model) -> None:
        if model.decoder.attention.head_dim % 2:
            model.decoder.attention.fail("head_dim", "must be even for rope (it rotates pairs of channels)")


@dataclass(frozen=True, kw_only=True)
class MoE(Feature):
    """Mixture of experts in place of the MLP of every `every`-th layer (the last of each group of `every`).

    Routing as in Mixtral: softmax over experts, top-k, the k weights renormalised (`renormalize=False` keeps the
    k probabilities as they are, as Qwen1.5-MoE's `norm_topk_prob=False`). Dropless when `capacity_factor` is
    None; otherwise each expert takes `top_k * seq * capacity_factor / num_experts` tokens of a sequence and drops
    the rest. The training loss adds `aux_loss_weight` times the Switch Transformer load-balancing loss and
    `router_z_loss_weight` times the ST-MoE router z-loss; both are needed only to train. The experts' width is
    `Decoder.mlp.hidden_dim`.

    `shared_hidden_dim` adds a shared expert that every token takes: the decoder's MLP at that width, added to
    the routed experts' output (DeepSeek-MoE), scaled by sigmoid(x . w) when `shared_gate` (Qwen2-MoE).
    """

    pass_name: typing.ClassVar[str] = "moe"
    HF_KEYS = {
        "num_experts": "num_local_experts or num_experts",
        "top_k": "num_experts_per_tok",
        "renormalize": "norm_topk_prob (Mixtral: true)",
        "aux_loss_weight": "router_aux_loss_coef",
    }
    num_experts: int
    top_k: int
    renormalize: bool
    capacity_factor: float | None = None
    every: int = 1
    aux_loss_weight: float | None = None
    router_z_loss_weight: float | None = None
    shared_hidden_dim: int | None = None
    shared_gate: bool = False

    def validate(self) -> None:
        self.require_positive("top_k", "every")
        if self.shared_hidden_dim is not None:
            self.require_positive("shared_hidden_dim")
        elif self.shared_gate:
            self.fail("shared_gate", "needs a shared expert: set shared_hidden_dim")
        if self.num_experts < 2:
            self.fail("num_experts", "must be >= 2")
        if self.top_k > self.num_experts:
            self.fail("top_k", f"must be <= num_experts={self.num_experts}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            self.fail("capacity_factor", "must be > 0 (or None for dropless routing)")
        for name in ("aux_loss_weight", "router_z_loss_weight"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                self.fail(name, "must be >= 0")

    def unremarkable(self) -> tuple[str, ...]:
        return ("renormalize",) if self.renormalize else ()

    def check_model(self, model: Model) -> None:
        if model.decoder.num_layers % self.every:
            self.fail("every", f"does not divide Decoder.num_layers={model.decoder.num_layers}")
        if model.train is not None:
            for name in ("aux_loss_weight", "router_z_loss_weight"):
                if getattr(self, name) is None:
                    self.fail(
                        name, "is needed to train (the model has a Train block); 0.0 turns the loss off"
                    )


@dataclass(frozen=True, kw_only=True)
class Remat(Feature):
    """Rematerialisation of each decoder layer: which matmul outputs the backward pass keeps, and which it
    recomputes. `full` keeps only the layer inputs; `save_*` keep the named projections; `offload_dots` moves all
    of them to pinned host memory; `none` keeps everything (overrides a backend's default)."""

    pass_name: typing.ClassVar[str] = "remat"
    policy: str = "full"

    def validate(self) -> None:
        if self.policy not in REMAT_POLICIES:
            self.fail(
                "policy", f"is not one of {', '.join(REMAT_POLICIES)}{suggest(self.policy, REMAT_POLICIES)}"
            )

    def requires(self) -> tuple[str, ...]:
        return ("host_offload",) if self.policy.startswith("offload") else ()


@dataclass(frozen=True, kw_only=True)
class Quantize(Feature):
    """Quantized matmuls for the projections whose `region/node` name matches `include` and not `exclude`
    (default: every projection of the decoder blocks except an MoE router; the output head only when `include`
    names `main/logits`). `dtype=None` takes the target's preferred dtype: int8 on TPU, fp8 on H100 and Trainium.
    A target without the dtype is an error unless `emulate=True`, which runs the same arithmetic in wider types.
    fp8 scales each tensor by its own max (`scaling="current"`) or by the largest max of the last `amax_history`
    steps (`"delayed"`, as Transformer Engine does), kept beside the weights."""

    pass_name: typing.ClassVar[str] = "quantize"
    dtype: str | None = None
    include: str | None = None
    exclude: str | None = None
    scaling: str = "current"
    amax_history: int = 16
    emulate: bool = False

    def validate(self) -> None:
        if self.dtype is not None and self.dtype not in QUANTIZE_DTYPES:
            self.fail(
                "dtype", f"is not one of {', '.join(QUANTIZE_DTYPES)}{suggest(self.dtype, QUANTIZE_DTYPES)}"
            )
        if self.scaling not in FP8_SCALINGS:
            self.fail(
                "scaling", f"is not one of {', '.join(FP8_SCALINGS)}{suggest(self.scaling, FP8_SCALINGS)}"
            )
        if self.scaling == "delayed" and self.dtype == "int8":
            self.fail("scaling", "applies to fp8; int8 scales each token and channel by its own max")
        self.require_positive("amax_history")
        for name in ("include", "exclude"):
            try:
                re.compile(getattr(self, name) or "")
            except re.error as err:
                self.fail(name, f"is not a regular expression ({err})")

    def requires(self) -> tuple[str, ...]:
        return () if self.emulate or self.dtype is None else (self.dtype,)

    def unremarkable(self) -> tuple[str, ...]:
        return () if self.scaling == "delayed" else ("scaling", "amax_history")


@dataclass(frozen=True, kw_only=True)
class QKVBias(Feature):
    """Learned biases on the query, key and value projections, as Qwen2 has; the output projection keeps none."""

    pass_name: typing.ClassVar[str] = "qkv_bias"


@dataclass(frozen=True, kw_only=True)
class QKNorm(Feature):
    """RMSNorm over each head of the queries and keys, before RoPE, each with its own learned scale (Qwen3,
    Gemma 3). `eps` has no default: a checkpoint's value is its config's `rms_norm_eps`."""

    pass_name: typing.ClassVar[str] = "qk_norm"
    eps: float

    def validate(self) -> None:
        self.require_positive("eps")


@dataclass(frozen=True, kw_only=True)
class SlidingWindow(Feature):
    """Each query attends to the last `window` positions, itself included (Mistral 7B v0.1: 4096; HF's
    `sliding_window`). With `global_every=k`, the last layer of each group of k keeps full attention: Gemma 2
    alternates local and global layers with k=2."""

    pass_name: typing.ClassVar[str] = "sliding_window"
    window: int
    global_every: int | None = None

    def validate(self) -> None:
        self.require_positive("window")
        if self.global_every is not None and self.global_every < 2:
            self.fail("global_every", "must be >= 2 (or None: every layer local)")

    def check_model(self, model: Model) -> None:
        if self.global_every and model.decoder.num_layers % self.global_every:
            self.fail("global_every", f"does not divide Decoder.num_layers={model.decoder.num_layers}")


@dataclass(frozen=True, kw_only=True)
class SoftCap(Feature):
    """Soft-capping, as in Gemma 2 (HF's `attn_logit_softcapping`, `final_logit_softcapping`): attention scores
    become attention * tanh(score / attention) before the softmax, the output logits final * tanh(logit / final).
    Either may be None."""

    pass_name: typing.ClassVar[str] = "softcap"
    attention: float | None = None
    final: float | None = None

    def validate(self) -> None:
        if self.attention is None and self.final is None:
            self.fail("attention", "and SoftCap.final are both None: cap at least one of them")
        for name in ("attention", "final"):
            if getattr(self, name) is not None:
                self.require_positive(name)


@dataclass(frozen=True, kw_only=True)
class GemmaBlock(Feature):
    """Gemma's decoder layer on a Llama: the gated MLP's gate goes through tanh-approximate GELU (GeGLU), the
    embeddings are scaled by sqrt(d_model), every RMSNorm scales by 1 + w, and norms sit around both sub-layers
    (after attention and after the MLP, before each joins the residual stream). The decoder's MLP must be gated.
    """

    pass_name: typing.ClassVar[str] = "gemma_block"

    def check_model(self, model: Model) -> None:
        if model.decoder.mlp.activation != "swiglu":
            model.decoder.mlp.fail("activation", "must be swiglu for gemma_block, whose gate GeGLU replaces")
        if not isinstance(model.decoder.norm, RMSNorm):
            model.decoder.fail("norm", "must be an RMSNorm for gemma_block")


class features:  # noqa: N801 - a namespace, used as `features as F` in spec files
    """Feature constructors for `Model.features`: `F.rope(theta=5e5, scaling=F.rope_scaling(factor=8.0))`."""

    rope = RoPE
    rope_scaling = RopeScaling
    moe = MoE
    remat = Remat
    quantize = Quantize
    qkv_bias = QKVBias
    qk_norm = QKNorm
    sliding_window = SlidingWindow
    softcap = SoftCap
    gemma_block = GemmaBlock


# --- targets -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshRule(SpecNode):
    """A regex over target names -> a mesh over `data, fsdp, expert, model` (-1: the devices left over) and the
    modifiers that go with it; a modifier left None keeps the backend's choice. Each backend tries its rules in
    order and the first match wins; a spec's `Model.mesh_rules` are tried before the backend's. On a multi-slice
    target (`tpu-v5e-256x2`) the mesh is one slice's and the slices multiply `data`.

    `microbatch` is the sequences each device runs per forward and backward pass: a step whose per-device batch
    is larger accumulates gradients over `per-device batch / microbatch` passes. `attention_block` is the query
    and key/value block length of the splash attention kernel. `memory_fraction` is the share of each device's
    memory the program's allocator takes (GPU), and what `axgen aot` checks the peak against."""

    pattern: str
    mesh: dict[str, int]
    _: dataclasses.KW_ONLY
    why: str
    compute_dtype: str | None = None
    attention: str | None = None
    attention_block: int | None = None
    microbatch: int | None = None
    remat: Remat | None = None
    quantize_dtype: str | None = None
    memory_fraction: float | None = None
    xla_flags: tuple[str, ...] = ()

    def validate(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as err:
            self.fail("pattern", f"is not a regular expression ({err})")
        for axis, size in self.mesh.items():
            if axis not in MESH_AXES:
                self.fail(
                    "mesh", f"has axis {axis!r}, not one of {', '.join(MESH_AXES)}{suggest(axis, MESH_AXES)}"
                )
            if size < 1 and size != -1:
                self.fail("mesh", f"gives {axis}={size}; sizes are >= 1, or -1 for the devices left over")
        if list(self.mesh.values()).count(-1) > 1:
            self.fail("mesh", "has more than one -1 axis")
        for name, known in (
            ("compute_dtype", COMPUTE_DTYPES),
            ("attention", ATTENTION_KERNELS),
            ("quantize_dtype", QUANTIZE_DTYPES),
        ):
            value = getattr(self, name)
            if value is not None and value not in known:
                self.fail(name, f"is not one of {', '.join(known)}{suggest(value, known)}")
        for name in ("attention_block", "microbatch"):
            if getattr(self, name) is not None:
                self.require_positive(name)
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            self.fail("memory_fraction", "is not in (0, 1]")
        if self.attention_block is not None and self.attention_block % 128:
            self.fail("attention_block", "must be a multiple of 128 (the TPU lane width)")

    def matches(self, target: str) -> bool:
        return re.fullmatch(self.pattern, target) is not None


# --- the model ---------------------------------------------------------------------------------------------------

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


@dataclass(frozen=True, kw_only=True)
class Model(SpecNode):
    name: str
    vocab_size: int
    d_model: int
    decoder: Decoder
    train: Train | None = None  # needed to build a training program, not to load or run weights
    features: tuple[Feature, ...] = ()
    targets: tuple[str, ...] = ()
    mesh_rules: tuple[MeshRule, ...] = ()  # tried before the backend's rules
    tie_embeddings: bool = False

    def validate(self) -> None:
        if not _NAME.fullmatch(self.name):  # `$` of re.match would let a trailing newline through
            self.fail("name", "must be lower-case letters, digits, '.', '_' or '-'")
        self.require_positive("vocab_size", "d_model")
        if not self.targets:
            self.fail("targets", "must name at least one target, e.g. ['cpu-8']")
        seen: dict[str, Feature] = {}
        for feature in self.features:
            if feature.pass_name in seen:
                raise SpecError(
                    f"{feature.origin}: Model.features has {feature.pass_name!r} twice "
                    f"(first at {seen[feature.pass_name].origin})"
                )
            seen[feature.pass_name] = feature
            feature.check_model(self)

    def feature(self, pass_name: str) -> Feature | None:
        return next((f for f in self.features if f.pass_name == pass_name), None)
