"""Feature configs: each one is applied by the pass of the same name in axgen/passes/. A spec lists them in
`Model.features`, built through the `features` namespace (`F.rope(theta=...)`)."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from axgen.spec.architecture import RMSNorm
from axgen.spec.validation import SpecError, SpecNode, suggest

if TYPE_CHECKING:
    from axgen.spec.model import Model

QUANTIZE_DTYPES = ("int8", "fp8")
FP8_SCALINGS = ("current", "delayed")
MOE_SCORINGS = ("softmax", "sigmoid")
MOE_GROUP_SCORES = ("top2_sum", "max")


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


@dataclass(frozen=True, kw_only=True)
class Feature(SpecNode):
    """A feature config; `pass_name` names the pass in axgen/passes/ that applies it."""

    pass_name: typing.ClassVar[str]

    @property
    def provenance(self) -> str:
        """`specs/x.py: features.rope`: named by its pass, which is also its name in the `features` namespace
        the spec wrote it with. Unlike its index in `Model.features`, the name does not change when a feature
        is added or moved before it, and it means the same in the file that built the feature and in a spec
        derived from that file's model."""
        return self.origin.provenance(f"features.{self.pass_name}")

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

    rule: typing.ClassVar[str] = "llama3"
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
class LinearRopeScaling(SpecNode):
    """Linear position interpolation (HF's rope_type "linear"): every frequency divided by `factor`, as if the
    positions were (Gemma 3's global layers at 4B and up: 8)."""

    rule: typing.ClassVar[str] = "linear"
    HF_KEYS = {"factor": "rope_scaling.factor"}
    factor: float

    def __str__(self) -> str:
        return f"linear(factor={self.factor})"

    def validate(self) -> None:
        self.require_positive("factor")


@dataclass(frozen=True, kw_only=True)
class YarnRopeScaling(SpecNode):
    """YaRN (HF's rope_type "yarn", as transformers' `_compute_yarn_parameters`): channel pairs that turn fewer
    than `beta_slow` times over the original context are slowed by `factor`, those that turn more than
    `beta_fast` times are kept, and a linear ramp over the pairs between blends the two; cos and sin are scaled
    by `attention_factor`. `truncate` rounds the ramp's ends outwards to whole pairs. No field has a default: an
    import states the values transformers takes for the keys a config leaves out."""

    rule: typing.ClassVar[str] = "yarn"
    HF_KEYS = {
        "factor": "rope_scaling.factor",
        "beta_fast": "rope_scaling.beta_fast",
        "beta_slow": "rope_scaling.beta_slow",
        "original_max_position": "rope_scaling.original_max_position_embeddings",
        "attention_factor": "rope_scaling.attention_factor (or from mscale and mscale_all_dim)",
        "truncate": "rope_scaling.truncate",
    }
    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position: int
    attention_factor: float
    truncate: bool

    def __str__(self) -> str:
        return (
            f"yarn(factor={self.factor}, beta_fast={self.beta_fast}, beta_slow={self.beta_slow}, "
            f"original_max_position={self.original_max_position}, attention_factor={self.attention_factor}, "
            f"truncate={self.truncate})"
        )

    def validate(self) -> None:
        self.require_positive("factor", "beta_fast", "beta_slow", "original_max_position", "attention_factor")
        if self.beta_fast <= self.beta_slow:
            self.fail("beta_fast", f"must be > beta_slow={self.beta_slow}")


@dataclass(frozen=True, kw_only=True)
class RoPE(Feature):
    """Rotary position embeddings on queries and keys (rotate-half layout, as in HF Llama). `local_theta` is the
    theta of the layers whose attention has a sliding window (Gemma 3: 10,000 there, `theta` 1,000,000 on its
    global layers); `scaling` applies to the other layers only when it is set. `rotary_dim`: only the last
    rotary_dim channels of each query and key head rotate, the others carry no position (DeepSeek's
    qk_rope_head_dim); `interleaved`: the rotated pairs are adjacent channels (2i, 2i + 1), as DeepSeek's
    checkpoints need (transformers' deepseek_v2 multiplies adjacent pairs as complex numbers; deepseek_v3's
    `rope_interleave`), not the halves of HF Llama's rotate-half."""

    pass_name: typing.ClassVar[str] = "rope"
    HF_KEYS = {"theta": "rope_theta (transformers 5: rope_parameters.rope_theta)"}
    theta: float
    scaling: RopeScaling | LinearRopeScaling | YarnRopeScaling | None = None
    local_theta: float | None = None
    rotary_dim: int | None = None
    interleaved: bool = False

    def validate(self) -> None:
        self.require_positive("theta")
        if self.local_theta is not None:
            self.require_positive("local_theta")
        if self.rotary_dim is not None:
            self.require_positive("rotary_dim")
            if self.rotary_dim % 2:
                self.fail("rotary_dim", "must be even (rope rotates pairs of channels)")

    def check_model(self, model: Model) -> None:
        if model.decoder.attention.head_dim % 2:
            model.decoder.attention.fail("head_dim", "must be even for rope (it rotates pairs of channels)")
        if self.rotary_dim is not None and self.rotary_dim > model.decoder.attention.head_dim:
            self.fail("rotary_dim", f"is more than the heads' head_dim={model.decoder.attention.head_dim}")
        if self.local_theta is not None and model.feature("sliding_window") is None:
            self.fail("local_theta", "is the theta of windowed layers, and the model has no sliding_window")


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
    `routed_scale` multiplies the routed experts' weights, so their output (DeepSeek's `routed_scaling_factor`).

    DeepSeek's routing: `scoring="sigmoid"` scores each expert by sigmoid(logit) and weights the chosen k by their
    scores (renormalised to sum to 1 when `renormalize`; the balance losses take the scores over their sum as
    probabilities). `balance_bias_rate` adds a per-expert correction bias (HF `mlp.gate.e_score_correction_bias`)
    to the scores for choosing experts only; it takes no gradient, and each train step moves it by the rate
    toward balance, bias += rate * sign(mean load - load) over the step's tokens (DeepSeek-V3's auxiliary-loss-free
    balancing; 0.0 holds it fixed, as to fine-tune). `n_group` splits the experts into that many equal groups and
    a token chooses among the experts of its best `topk_group` groups, a group ranked by `group_score`: "top2_sum"
    (its two highest scores, bias included: V3's `noaux_tc`) or "max" (V2's `group_limited_greedy`).
    `seq_aux_loss_weight` weighs DeepSeek-V3's sequence-wise balance loss (0.0: off). The first
    `first_dense_layers` layers keep a dense MLP, `dense_hidden_dim` wide (DeepSeek's `first_k_dense_replace` and
    `intermediate_size`; the experts' width, `moe_intermediate_size`, is the decoder's), scanned apart before the
    others.
    """

    pass_name: typing.ClassVar[str] = "moe"
    HF_KEYS = {
        "num_experts": "num_local_experts or num_experts",
        "top_k": "num_experts_per_tok",
        "renormalize": "norm_topk_prob (Mixtral: true)",
        "aux_loss_weight": "router_aux_loss_coef",
        "routed_scale": "routed_scaling_factor (DeepSeek)",
        "scoring": "scoring_func (DeepSeek)",
        "n_group": "n_group (DeepSeek)",
        "topk_group": "topk_group (DeepSeek)",
        "group_score": "topk_method: noaux_tc -> top2_sum, group_limited_greedy -> max (DeepSeek)",
        "first_dense_layers": "first_k_dense_replace (DeepSeek)",
        "dense_hidden_dim": "intermediate_size (DeepSeek; the experts' moe_intermediate_size is the decoder's)",
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
    routed_scale: float | None = None
    scoring: str = "softmax"
    balance_bias_rate: float | None = None
    n_group: int | None = None
    topk_group: int | None = None
    group_score: str | None = None
    seq_aux_loss_weight: float = 0.0
    first_dense_layers: int = 0
    dense_hidden_dim: int | None = None

    def validate(self) -> None:
        self.require_positive("top_k", "every")
        self._validate_deepseek_routing()
        if self.routed_scale is not None:
            self.require_positive("routed_scale")
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

    def _validate_deepseek_routing(self) -> None:
        if self.scoring not in MOE_SCORINGS:
            self.fail(
                "scoring", f"is not one of {', '.join(MOE_SCORINGS)}{suggest(self.scoring, MOE_SCORINGS)}"
            )
        if self.balance_bias_rate is not None and self.balance_bias_rate < 0:
            self.fail("balance_bias_rate", "must be >= 0 (0.0 holds the correction bias fixed)")
        if self.first_dense_layers < 0:
            self.fail("first_dense_layers", "must be >= 0")
        if self.first_dense_layers and self.dense_hidden_dim is None:
            self.fail("dense_hidden_dim", f"is needed for the first_dense_layers={self.first_dense_layers}")
        if self.dense_hidden_dim is not None:
            self.require_positive("dense_hidden_dim")
            if not self.first_dense_layers:
                self.fail(
                    "dense_hidden_dim", "is the width of the first dense layers: set first_dense_layers"
                )
            if self.every > 1:
                self.fail(
                    "every", "must be 1 with first_dense_layers (the dense layers between would differ)"
                )
        if self.seq_aux_loss_weight < 0:
            self.fail("seq_aux_loss_weight", "must be >= 0 (0.0 turns the loss off)")
        if self.n_group is None:
            for name in ("topk_group", "group_score"):
                if getattr(self, name) is not None:
                    self.fail(name, "applies to group-limited routing: set n_group")
            return
        self.require_positive("n_group")
        if self.num_experts % self.n_group:
            self.fail("n_group", f"does not divide num_experts={self.num_experts}")
        if self.topk_group is None or not 1 <= self.topk_group <= self.n_group:
            self.fail("topk_group", f"must be in [1, n_group={self.n_group}]")
        if self.group_score not in MOE_GROUP_SCORES:
            self.fail("group_score", f"is not one of {', '.join(MOE_GROUP_SCORES)}")
        group_size = self.num_experts // self.n_group
        if self.group_score == "top2_sum" and group_size < 2:
            self.fail("n_group", f"leaves {group_size} expert per group; top2_sum ranks a group by two")
        if self.top_k > self.topk_group * group_size:
            self.fail(
                "top_k", f"is more than the {self.topk_group * group_size} experts of topk_group groups"
            )

    def unremarkable(self) -> tuple[str, ...]:
        usual = ("renormalize",) if self.renormalize else ()
        return (*usual, "scoring") if self.scoring == "softmax" else usual

    def check_model(self, model: Model) -> None:
        if self.first_dense_layers >= model.decoder.num_layers:
            self.fail(
                "first_dense_layers", f"leaves no MoE layer of Decoder.num_layers={model.decoder.num_layers}"
            )
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
    steps (`"delayed"`, as Transformer Engine does), kept beside the weights. A dropless MoE's routed experts are
    quantized only when `include` names their `moe` node (`moe_layers/moe`), with current scaling
    (docs/quantized_experts.md)."""

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
    alternates local and global layers with k=2, Gemma 3 has k=6; layers after the last whole group are local
    (Gemma 3 27B: 62 layers, the last 2)."""

    pass_name: typing.ClassVar[str] = "sliding_window"
    window: int
    global_every: int | None = None

    def validate(self) -> None:
        self.require_positive("window")
        if self.global_every is not None and self.global_every < 2:
            self.fail("global_every", "must be >= 2 (or None: every layer local)")

    def check_model(self, model: Model) -> None:
        if self.global_every and model.decoder.num_layers < self.global_every:
            self.fail("global_every", f"is more than Decoder.num_layers={model.decoder.num_layers}")


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


@dataclass(frozen=True, kw_only=True)
class AttentionSinks(Feature):
    """A learned logit per query head joins each query's softmax beside its keys' scores: it takes a share of the
    probability mass and contributes no value, so a query may attend to nothing (gpt-oss's `self_attn.sinks`).
    """

    pass_name: typing.ClassVar[str] = "attention_sinks"


@dataclass(frozen=True, kw_only=True)
class OutBias(Feature):
    """A learned bias on the attention's output projection (HF `self_attn.o_proj.bias`), as gpt-oss has beside its
    q, k and v biases (`attention_bias: true`)."""

    pass_name: typing.ClassVar[str] = "out_bias"


@dataclass(frozen=True, kw_only=True)
class GptOssExperts(Feature):
    """gpt-oss's routed experts on the MoE: the router adds a bias (HF `mlp.router.bias`), each expert's gate, up
    and down projections add biases, and the activation is the clamped SwiGLU, gate = min(gate, limit),
    up = clip(up, -limit, limit), out = (up + 1) * gate * sigmoid(alpha * gate) (HF `swiglu_alpha`,
    `swiglu_limit`). Routing is the MoE's: top-k of the router's logits, softmax over the k chosen, which is
    softmax-then-renormalise. The weights carry gpt-oss's HF names, whose fused `gate_up_proj` [experts, embed,
    2 * hidden] interleaves the gate's and up's columns."""

    pass_name: typing.ClassVar[str] = "gpt_oss_experts"
    HF_KEYS = {"alpha": "swiglu_alpha", "limit": "swiglu_limit"}
    alpha: float
    limit: float

    def validate(self) -> None:
        self.require_positive("alpha", "limit")

    def check_model(self, model: Model) -> None:
        moe = model.feature("moe")
        if moe is None:
            self.fail("alpha", "applies to routed experts: the model has no F.moe")
        elif not moe.renormalize:
            moe.fail("renormalize", "must be True for gpt_oss_experts (softmax over the k chosen logits)")
        if model.decoder.mlp.activation != "swiglu":
            model.decoder.mlp.fail(
                "activation", "must be swiglu for gpt_oss_experts, whose clamped SwiGLU replaces it"
            )


@dataclass(frozen=True, kw_only=True)
class MLA(Feature):
    """Multi-head latent attention (DeepSeek-V2/V3) in place of the q, k and v projections. Queries come from a
    low-rank latent, q_b(rmsnorm(q_a(x))), or from one projection where `q_lora_rank` is None (V2-Lite's
    q_proj); keys and values from one latent of `kv_lora_rank` channels, rmsnorm'd and up-projected per head to
    `qk_nope_head_dim` key and `v_head_dim` value channels; the key's last `qk_rope_head_dim` channels are one
    head projected beside the latent (kv_a_proj_with_mqa) and shared by every head. RoPE turns only those
    channels, of q and k: the model's F.rope must say rotary_dim=qk_rope_head_dim, and interleaved=True for
    adjacent pairs as DeepSeek's checkpoints turn them (V3's rope_interleave=false turns halves: interleaved=False).
    `eps` is the latent norms' (transformers' DeepSeek: 1e-6, whatever rms_norm_eps says).
    Attention sees q/k of qk_nope_head_dim + qk_rope_head_dim channels, which Attention.head_dim states, and
    v of v_head_dim; its scale is Attention.scale (None: head_dim**-0.5). Every value is required."""

    pass_name: typing.ClassVar[str] = "mla"
    HF_KEYS = {
        "q_lora_rank": "q_lora_rank",
        "kv_lora_rank": "kv_lora_rank",
        "qk_nope_head_dim": "qk_nope_head_dim",
        "qk_rope_head_dim": "qk_rope_head_dim",
        "v_head_dim": "v_head_dim",
        "eps": "no key: 1e-6, the default of the RMSNorm transformers' DeepSeek norms the latents with",
    }
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    eps: float

    def validate(self) -> None:
        self.require_positive("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "eps")
        if self.q_lora_rank is not None:
            self.require_positive("q_lora_rank")
        if self.qk_rope_head_dim % 2:
            self.fail("qk_rope_head_dim", "must be even (rope rotates pairs of channels)")

    def check_model(self, model: Model) -> None:
        attention, qk = model.decoder.attention, self.qk_nope_head_dim + self.qk_rope_head_dim
        if attention.head_dim != qk:
            attention.fail("head_dim", f"must be qk_nope_head_dim + qk_rope_head_dim = {qk} for F.mla")
        if attention.num_kv_heads != attention.num_heads:
            attention.fail(
                "num_kv_heads", f"must be num_heads={attention.num_heads} for F.mla (one k, v per head)"
            )
        rope = model.feature("rope")
        if rope is None or rope.rotary_dim != self.qk_rope_head_dim:
            self.fail(
                "qk_rope_head_dim",
                f"needs F.rope(rotary_dim={self.qk_rope_head_dim}), as MLA turns its rope channels only",
            )
        for other in ("qkv_bias", "qk_norm"):
            if model.feature(other) is not None:
                self.fail("q_lora_rank", f"replaces the q, k, v projections that F.{other} changes")


# The projections F.lora adapts, by the module names PEFT's `target_modules` gives them (HF's Linear layers).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_BASE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class LoRA(Feature):
    """Low-rank adapters (Hu et al., 2021), trained as PEFT trains them: each projection `targets` names (PEFT's
    `target_modules`: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) adds `scale * (x A) B` to
    its frozen weight's product, A [in, rank] drawn as PEFT draws it (Kaiming-uniform), B [rank, out] zeros.
    `scale` is alpha / rank, or alpha / sqrt(rank) with `use_rslora` (Kalajdzievski, 2023). Only the adapters
    train: every other param is frozen, so gradients, optimizer moments and checkpoints hold the adapters alone.
    `base_dtype="bfloat16"` stores the frozen params in bfloat16, half their float32 bytes (the adapters stay
    float32); a base loaded from float32 is rounded once, as a bfloat16 forward would round it anyway.
    `dropout` is PEFT's `lora_dropout`: in a training step each adapter's input, and only its, loses that fraction of
    its values at random (the rest scaled up to keep the mean), drawn afresh per step, row, layer and projection
    from the seed; evaluation, export and the base's own product never drop anything."""

    pass_name: typing.ClassVar[str] = "lora"
    rank: int
    alpha: float
    targets: tuple[str, ...] = LORA_TARGETS
    use_rslora: bool = False
    base_dtype: str = "float32"
    dropout: float = 0.0

    def validate(self) -> None:
        self.require_positive("rank", "alpha")
        if not 0 <= self.dropout < 1:
            self.fail("dropout", "must be >= 0 and < 1 (the fraction of each adapter's input a step drops)")
        if self.base_dtype not in LORA_BASE_DTYPES:
            self.fail(
                "base_dtype",
                f"is not one of {', '.join(LORA_BASE_DTYPES)}{suggest(self.base_dtype, LORA_BASE_DTYPES)}",
            )
        if not self.targets:
            self.fail("targets", f"names no projection; PEFT's names are {', '.join(LORA_TARGETS)}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown:
            self.fail(
                "targets",
                f"names {unknown[0]!r}, which is not one of {', '.join(LORA_TARGETS)}"
                f"{suggest(unknown[0], LORA_TARGETS)}",
            )

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)

    def unremarkable(self) -> tuple[str, ...]:
        return ("base_dtype",) if self.base_dtype == "float32" else ()


@dataclass(frozen=True, kw_only=True)
class DPO(Feature):
    """Direct preference optimisation (Rafailov et al., 2023) as TRL's DPOTrainer trains it (its default
    loss_type "sigmoid"), on preference pairs (`axgen data --pairs`): each pair's loss is -log sigmoid(beta *
    ((log p(chosen) - log p_ref(chosen)) - (log p(rejected) - log p_ref(rejected)))), each log-probability summed
    over the completion's tokens, and the step's loss their mean. The reference p_ref costs one more forward pass
    a step, without a backward one. With F.lora it is the model with the adapters off, the frozen base itself (as
    TRL does for a PEFT model): no second copy of the weights. Without, it is a frozen copy of the initial
    params (TRL's ref_model), kept on the devices beside the trained ones, as they are sharded, and reloaded from
    --init-from at a resume rather than checkpointed: a params-sized buffer more (a quarter of what the trained
    params' gradients and AdamW moments already take), where precomputed reference log-probabilities would need a
    pass over the data before training and a dataset of them for each --data. The metrics are TRL's:
    rewards/chosen and rewards/rejected (beta times each log-ratio), rewards/accuracies, rewards/margins,
    logps/chosen, logps/rejected."""

    pass_name: typing.ClassVar[str] = "dpo"
    beta: float = 0.1

    def validate(self) -> None:
        self.require_positive("beta")

    def check_model(self, model: Model) -> None:
        if model.feature("simpo") is not None:
            raise SpecError(f"{self.provenance}: F.dpo and F.simpo are two losses; keep one")


@dataclass(frozen=True, kw_only=True)
class SimPO(Feature):
    """SimPO (Meng et al., 2024), a preference loss with no reference model, as TRL's CPOTrainer trains it with
    loss_type="simpo" and cpo_alpha=0: each pair's loss is -log sigmoid(beta * (mean log p(chosen) - mean log
    p(rejected)) - gamma), each mean over the completion's tokens, on preference pairs (`axgen data --pairs`).
    No reference forward pass, and no frozen copy for a full fine-tune; the length normalisation keeps it from
    preferring the longer completion. Its metrics are DPO's names, with rewards beta times each mean
    log-probability and logps those means (as TRL logs them)."""

    pass_name: typing.ClassVar[str] = "simpo"
    beta: float = 2.0
    gamma: float = 0.5

    def validate(self) -> None:
        self.require_positive("beta")
        if self.gamma < 0:
            self.fail("gamma", "must be >= 0 (the target margin between the mean log-probabilities)")


class features:  # noqa: N801 - a namespace, used as `features as F` in spec files
    """Feature constructors for `Model.features`: `F.rope(theta=5e5, scaling=F.rope_scaling(factor=8.0))`."""

    rope = RoPE
    rope_scaling = RopeScaling
    rope_linear = LinearRopeScaling
    rope_yarn = YarnRopeScaling
    moe = MoE
    remat = Remat
    quantize = Quantize
    qkv_bias = QKVBias
    qk_norm = QKNorm
    sliding_window = SlidingWindow
    softcap = SoftCap
    gemma_block = GemmaBlock
    attention_sinks = AttentionSinks
    out_bias = OutBias
    gpt_oss_experts = GptOssExperts
    mla = MLA
    lora = LoRA
    dpo = DPO
    simpo = SimPO
