"""The op vocabulary. Each op is one registration: its input slots, its typed attrs, its shape rule over named
axes, its training FLOPs, and the macro file in `templates/ops/` that prints it.

A shape rule takes the input types, the attrs and the params, checks them, and returns the output type. Rules
raise `ShapeError` with the op and the offending axes, so a pass that builds an ill-typed graph fails at once. A
pass that needs an op of its own registers it from its own file with `register_op`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from axgen.ir.types import Param, TensorType


class ShapeError(ValueError):
    pass


# --- attrs: what a node of each op carries; passes and lowering rewrite them with Graph.update -------------------


@dataclass(frozen=True, kw_only=True)
class Attrs:
    """What every op may carry. `constrain`: the logical axes the `shard` lowering pins the output's sharding to."""

    constrain: tuple[str, ...] | None = None

    def changed(self) -> dict:
        """The attrs that differ from their defaults, in field order: what a dump shows."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.default is dataclasses.MISSING or getattr(self, f.name) != f.default
        }


@dataclass(frozen=True, kw_only=True)
class InputAttrs(Attrs):
    type: TensorType


@dataclass(frozen=True, kw_only=True)
class NormAttrs(Attrs):
    """`offset`: the norm scales by offset + w, as Gemma's scale by 1 + w (the param holds w, as HF's does)."""

    eps: float
    offset: float = 0.0


@dataclass(frozen=True, kw_only=True)
class DotAttrs(Attrs):
    """A matmul with a weight. `role` names what the projection is (MaxText's names, which remat policies use);
    `quantize` is the dot's number format (int8, fp8, fp8_delayed; `target` until lowering picks the target's);
    `checkpoint_name` is set by the remat lowering where a policy saves or recomputes the output by name."""

    role: str | None = None
    quantize: str | None = None
    checkpoint_name: str | None = None
    lora_scale: float | None = None  # F.lora: the output adds lora_scale * (x lora_a) lora_b
    lora_dropout: float | None = None  # F.lora: a training step drops this fraction of x on its way to lora_a


@dataclass(frozen=True, kw_only=True)
class LmHeadAttrs(DotAttrs):
    """The output head. `loss` is the lowering's: `fused`, the training loss takes the head's input and weight and
    computes the logits and their cross-entropy `loss_chunk` positions at a time (capped by `loss_soft_cap`, the
    softcap node after the head), so the whole logits never exist in a training step; `logits`, it takes the
    logits the head and the nodes after it make. `objective` is the preference loss the head's log-probabilities
    train (F.dpo's "dpo", F.simpo's "simpo") on pairs; None, the next-token cross-entropy itself. DPO's
    `reference`: "adapters off" (F.lora's base) or "copy" (a frozen copy of the initial params)."""

    tied: bool = False
    vocab: int
    objective: str | None = None
    reference: str | None = None
    loss: str | None = None
    context: bool = False
    loss_chunk: int | None = None
    loss_soft_cap: float | None = None


@dataclass(frozen=True, kw_only=True)
class AttentionAttrs(Attrs):
    """Attention over keys at or before each query (`causal`) of the query's own document (`segment_ids`).
    `window`: a query sees only the last `window` positions, itself included; `softcap`: scores pass through
    softcap * tanh(score / softcap) before the softmax; `scale` multiplies the scores, where it is not
    head_dim**-0.5; `sinks`: the `sinks` param, a learned logit per query head, joins each query's softmax and
    takes a share of the probability mass without a value. `kernel`, `kernel_why`, `block`, `document_mask`,
    `v_head_dim` and `pad_v` are the lowering's, read off the kernel's entry in runtime/kernels.py, which the
    runtime runs by: which kernel runs it (and why not the target's, where it is another), its block length, how
    the kernel is told where documents end, v's head dim where it differs from q/k's, and whether v is then
    zero-padded to q/k's head dim for a kernel that takes one head dim and the output's padding sliced off: zero
    value channels add zero output channels, so the result is exact."""

    causal: bool = True
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    sinks: bool = False
    kernel: str | None = None
    kernel_why: str | None = None
    block: int | None = None
    document_mask: str | None = None
    v_head_dim: int | None = None
    pad_v: bool = False
    context: str | None = None
    context_why: str | None = None


@dataclass(frozen=True, kw_only=True)
class EmbedAttrs(Attrs):
    """`lookup` is the lowering's: "vocab_parallel" where each device looks up its own rows of a table whose
    vocabulary is split (runtime.vocab_parallel_take), with why; None, the plain gather."""

    lookup: str | None = None
    lookup_why: str | None = None


@dataclass(frozen=True, kw_only=True)
class ContextOrderAttrs(Attrs):
    """The lowering's, where the mesh splits each sequence over `shards` context shards (runtime/context.py):
    `to="context"` puts a [batch, seq, ...] input into context order (shard i holds the chunks i and
    2 * shards - 1 - i of the sequence's 2 * shards), `to="sequence"` puts the model's output (its logits) back.
    """

    to: str
    shards: int


@dataclass(frozen=True)
class ScanCall:
    """One block's layers within one step of a scan: `per_step` layers of the function `function`."""

    block: str
    function: str
    per_step: int
    aux: bool

    def __str__(self) -> str:
        return f"{self.per_step}x{self.function}{'+aux' if self.aux else ''}"


@dataclass(frozen=True, kw_only=True)
class ScanAttrs(Attrs):
    """Runs `blocks` in turn, `steps` times. The scan lowering says what one step calls: `function` (a block's own
    function, or a group of several layers), its `calls`, and whether it returns auxiliary losses; the pipeline
    lowering, in how many stages the steps run."""

    blocks: tuple[str, ...]
    steps: int
    function: str | None = None
    calls: tuple[ScanCall, ...] = ()
    returns_aux: bool = False
    # Pipeline stages (the lowering's `pipeline` step): how many, their schedule (PIPELINE_SCHEDULES), the times
    # each microbatch goes round them (1: GPipe or 1F1B; more: circular), the sequences per device of each
    # microbatch they take in turn, and the program's comment on them.
    stages: int = 1
    stage_schedule: str | None = None
    stage_repeats: int = 1
    stage_microbatch: int | None = None
    pipeline: str | None = None

    @staticmethod
    def groups(calls: tuple[ScanCall, ...]) -> bool:
        """Whether one step of these calls runs more than one layer: a mixed stack, or several layers of a block."""
        return len(calls) > 1 or calls[0].per_step > 1


# --- shape rules -------------------------------------------------------------------------------------------------

Rule = Callable[[dict[str, TensorType], Attrs, dict[str, Param]], TensorType]


def same_as(slot: str, *others: str) -> Rule:
    def rule(ins, attrs, params):
        for other in others:
            if ins[other] != ins[slot]:
                raise ShapeError(f"{other}{ins[other]} differs from {slot}{ins[slot]}")
        return ins[slot]

    return rule


def _input(ins, attrs, params):
    return attrs.type


def _positions(ins, attrs, params):
    if ins["segment_ids"] != ins["tokens"]:
        raise ShapeError(f"segment_ids{ins['segment_ids']} differ from tokens{ins['tokens']}")
    return ins["tokens"]


def _embed(ins, attrs, params):
    table = params["table"].type
    return ins["tokens"].concat(table.drop("vocab"))


def _norm(ins, attrs, params):
    x = ins["x"]
    last = TensorType(x.axes[-1:], x.sizes[-1:])
    for role, param in params.items():
        if param.type != last:
            raise ShapeError(f"norm {role}{param.type} does not match the last axis of x{x}")
    return x


def _linear(ins, attrs, params):
    """An einsum: contracts the axes that x and w share, keeps the rest of x, then the rest of w."""
    x, w = ins["x"], params["w"].type
    contracted = [a for a in w.axes if a in x.axes]
    if not contracted:
        raise ShapeError(f"w{w} shares no axis with x{x}")
    for axis in contracted:
        if x.size(axis) != w.size(axis):
            raise ShapeError(f"axis {axis}: x has {x.size(axis)}, w has {w.size(axis)}")
    kept = w.drop(*contracted)
    if "lora_a" in params:  # F.lora: A takes what w contracts to the rank, B the rank to what w makes
        rank = TensorType.of(("lora_rank", params["lora_a"].type.size("lora_rank")))
        a, b = params["lora_a"].type, params["lora_b"].type
        if a != w.drop(*kept.axes).concat(rank) or b != rank.concat(kept):
            raise ShapeError(f"lora_a{a} and lora_b{b} do not factor w{w} through a rank")
    return x.drop(*contracted).concat(kept)


def _attention(ins, attrs, params):
    """q and k share a head dim; v's may differ (DeepSeek's MLA: q/k 192 = 128 + 64 RoPE channels, v 128), and
    the output has v's."""
    q, k, v = ins["q"], ins["k"], ins["v"]
    if k.axes != v.axes or k.sizes[:-1] != v.sizes[:-1]:
        raise ShapeError(f"k{k} and v{v} differ in more than head_dim")
    if q.axes != ("batch", "seq", "heads", "head_dim") or k.axes != ("batch", "seq", "kv_heads", "head_dim"):
        raise ShapeError(
            f"expected q[batch, seq, heads, head_dim], k[batch, seq, kv_heads, head_dim]; got q{q}, k{k}"
        )
    if q.size("heads") % k.size("kv_heads") or q.size("head_dim") != k.size("head_dim"):
        raise ShapeError(f"q{q} and k{k} do not group")
    if ins["segment_ids"].axes != ("batch", "seq"):
        raise ShapeError(f"segment_ids must be [batch, seq], got {ins['segment_ids']}")
    if attrs.window is not None and attrs.window < 1:
        raise ShapeError(f"window={attrs.window} must be >= 1")
    heads = TensorType.of(("heads", q.size("heads")))
    if attrs.sinks != ("sinks" in params) or attrs.sinks and params["sinks"].type != heads:
        raise ShapeError(f"sinks={attrs.sinks} needs one sinks{heads} param, got {list(params)}")
    return q.drop("head_dim").concat(TensorType.of(("head_dim", v.size("head_dim"))))


def _lm_head(ins, attrs, params):
    x = ins["x"]
    vocab = attrs.vocab if attrs.tied else params["w"].type.size("vocab")
    return x.drop("embed").concat(TensorType.of(("vocab", vocab)))


# --- training FLOPs per token: 6 per multiply-add of a weight a token uses (forward + backward) -----------------

Flops = Callable[[dict[str, TensorType], Attrs, dict[str, Param], int], float]


def no_flops(ins, attrs, params, seq_len) -> float:
    return 0


def trained_size(params: dict[str, Param]) -> int:
    return sum(math.prod(p.shape) for p in params.values() if p.trained)


def _dot_flops(ins, attrs, params, seq_len) -> float:
    """6 per multiply-add; a frozen weight's (F.lora's base) takes no weight gradient, so 4 (forward and the
    input's gradient)."""
    return sum((4 if p.frozen else 6) * math.prod(p.shape) for p in params.values() if p.trained)


def _lm_head_flops(ins, attrs, params, seq_len) -> float:
    if attrs.tied:  # multiplies by the embedding table
        return 6 * attrs.vocab * ins["x"].size("embed")
    return _dot_flops(ins, attrs, params, seq_len)


def _attention_flops(ins, attrs, params, seq_len) -> float:
    """As in the PaLM paper's appendix B: 6 * heads * (qk head_dim + v head_dim) per key a query sees (scores and
    values, forward and backward; 12 * heads * head_dim where the two agree). A causal query sees seq / 2 keys on average; within a window, the mean of min(i + 1, window).
    """
    keys = seq_len / 2 if attrs.causal else seq_len
    if attrs.window is not None and attrs.window < seq_len:
        keys = attrs.window - attrs.window * (attrs.window - 1) / (2 * seq_len)
    return 6 * keys * ins["q"].size("heads") * (ins["q"].size("head_dim") + ins["v"].size("head_dim"))


# --- the registry ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpDef:
    name: str
    slots: tuple[str, ...]
    attrs: type[Attrs]
    rule: Rule
    template: str  # templates/ops/<template>.j2 defines a macro named after the op
    flops: Flops = no_flops


OPS: dict[str, OpDef] = {}


def register_op(
    name: str,
    slots: tuple[str, ...],
    rule: Rule,
    template: str,
    attrs: type[Attrs] = Attrs,
    flops: Flops = no_flops,
) -> OpDef:
    if name in OPS:
        raise ValueError(f"op {name!r} is registered twice")
    OPS[name] = OpDef(name, slots, attrs, rule, template, flops)
    return OPS[name]


register_op("input", (), _input, "embed", InputAttrs)
register_op("positions", ("tokens", "segment_ids"), _positions, "embed")
register_op("embed", ("tokens",), _embed, "embed", EmbedAttrs)
register_op("rms_norm", ("x",), _norm, "norm", NormAttrs)
register_op("layer_norm", ("x",), _norm, "norm", NormAttrs)
register_op("linear", ("x",), _linear, "linear", DotAttrs, _dot_flops)
register_op("lm_head", ("x",), _lm_head, "linear", LmHeadAttrs, _lm_head_flops)
register_op(
    "attention", ("q", "k", "v", "segment_ids"), _attention, "attention", AttentionAttrs, _attention_flops
)
register_op("swiglu", ("gate", "up"), same_as("gate", "up"), "mlp")
register_op("gelu", ("x",), same_as("x"), "mlp")
register_op("add", ("x", "y"), same_as("x", "y"), "residual")
register_op("scan", ("x", "positions", "segment_ids"), same_as("x"), "scan", ScanAttrs)
register_op("context_order", ("x",), same_as("x"), "context", ContextOrderAttrs)
