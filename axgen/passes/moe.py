"""Mixture of experts: the MLP of every `every`-th layer becomes a router and `num_experts` expert MLPs.

With `every > 1` the decoder block splits in two, dense and MoE, scanned in turn; the expert weights are the
MLP's own weights with a leading `expert` axis, so the MoE keeps the spec's activation. With `first_dense_layers`
the first layers are scanned apart before the others, their dense MLP `dense_hidden_dim` wide (DeepSeek).
"""

import dataclasses

from axgen.ir import LAYER, Attrs, Graph, HFWeight, Node, Param, ShapeError, TensorType, register_op
from axgen.ir.ops import trained_size
from axgen.passes.manager import register
from axgen.spec import MoE


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEAttrs(Attrs):
    top_k: int
    capacity_factor: float | None = None
    activation: str
    renormalize: bool = True  # whether the top-k routing weights are rescaled to sum to 1
    routed_scale: float | None = None  # what the top-k routing weights are multiplied by (DeepSeek)
    # DeepSeek's routing: sigmoid scores, a correction bias (param `correction_bias`) that chooses experts and
    # weights none, and the choice limited to each token's best `topk_group` of `n_group` groups of experts.
    scoring: str = "softmax"
    correction_bias: bool = False
    n_group: int | None = None
    topk_group: int | None = None
    group_score: str | None = None
    # gpt-oss's experts (passes/gpt_oss_experts.py): biases b_gate, b_up, b_down beside the weights, and the clamped
    # SwiGLU's sigmoid gain and clamp (activation "clamped_swiglu").
    biased: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    aux: tuple[str, ...] = ()  # auxiliary outputs: losses, and metrics such as the dropped fraction
    aux_weights: tuple[tuple[str, float], ...] = ()  # loss name -> its weight in the training loss
    # Set by the target's lowering: the grouped matmul kernel of the dropless path and its tiles, or why the
    # chip's kernel was passed over for XLA's ragged_dot.
    grouped_matmul: str = "ragged_dot"
    tiles: tuple[tuple[str, int], ...] = ()
    tiles_source: str | None = None  # the backend table the tiles come from
    grouped_matmul_why: str | None = None
    check_vma: bool = True  # whether shard_map checks the experts' outputs name the mesh axes they vary over
    # Set by the target's lowering where the experts are split over devices: how the dropless path moves token
    # copies, all_gather (every token of the expert group to every device) or the all-to-all collective
    # (ragged_all_to_all, all_to_all) that sends each copy only to its expert's device; and where that came from.
    dispatch: str = "all_gather"
    dispatch_source: str | None = None
    receive_capacity: float | None = (
        None  # the all-to-all's bound (MeshRule.moe_receive_capacity), which drops
    )
    # The experts' products by the projection roles remat policies name (DotAttrs.role): under a policy, the remat
    # lowering sets `checkpointed`, and each product's output carries its role as its checkpoint name.
    roles: tuple[str, str] = ("mlp_in", "mlp_out")
    checkpointed: bool = False
    # The routed experts' products as quantized dots (passes/quantize.py: int8, fp8, `target` until lowering picks
    # the target's), by runtime.int8_ragged_dot / fp8_ragged_dot. Where the target keeps them in bf16 instead, the
    # lowering clears `quantize` and says why in `quantize_why`.
    quantize: str | None = None
    quantize_why: str | None = None


def _moe(ins, attrs, params):
    """x [batch, seq, embed] routed by router_logits [batch, seq, expert] through experts that map embed -> embed."""
    x, logits = ins["x"], ins["router_logits"]
    if logits.drop("expert") != x.drop("embed") or logits.axes[-1] != "expert":
        raise ShapeError(f"router_logits{logits} do not route x{x}")
    for role, param in params.items():
        if param.type.axes[0] != "expert" or param.type.sizes[0] != logits.sizes[-1]:
            raise ShapeError(f"expert weight {role}{param.type} does not lead with expert={logits.sizes[-1]}")
    if params["w_down"].type.axes[-1] != "embed" or params["w_up"].type.axes[1] != "embed":
        raise ShapeError(
            f"experts must map embed -> embed, got w_up{params['w_up'].type}, w_down{params['w_down'].type}"
        )
    if not 1 <= attrs.top_k <= logits.sizes[-1]:
        raise ShapeError(f"top_k={attrs.top_k} is not in [1, {logits.sizes[-1]}]")
    return x


def _moe_flops(ins, attrs, params, seq_len) -> float:
    """A token uses top_k of the experts."""
    return 6 * trained_size(params) * attrs.top_k / ins["router_logits"].size("expert")


register_op("moe", ("x", "router_logits"), _moe, "moe", MoEAttrs, _moe_flops)


@register("moe")
def moe(g: Graph, cfg: MoE) -> None:
    for scan in list(g.nodes(op="scan")):
        block = scan.attrs.blocks[-1]
        if cfg.first_dense_layers:
            head = g.split_head(scan, cfg.first_dense_layers, f"dense_{block}", "dense_decoder_layer")
            dense = g.subgraph(head.attrs.blocks[0], lambda n: n.label == "mlp" and n.op != "add")
            g.resize(dense.nodes, "mlp", cfg.dense_hidden_dim)
        if cfg.every > 1:
            block = g.split_block(scan, cfg.every, f"moe_{block}", "moe_decoder_layer").name
        mlp = g.subgraph(block, lambda n: n.label == "mlp" and n.op != "add")
        (h,) = mlp.inputs
        experts = TensorType.of(("expert", cfg.num_experts))
        router_hf = HFWeight(f"{LAYER}.mlp.gate.weight", transpose=True)
        router = Param("router", h.type.drop("batch", "seq").concat(experts), hf=router_hf)
        logits = g.add(block, "router", "linear", {"x": h}, {"w": router})
        mlp_weights = [p for n in mlp.nodes for p in n.params.values()]
        weights = {p.key: _expert(p, experts, len(mlp_weights) == 3) for p in mlp_weights}
        if cfg.balance_bias_rate is not None:
            weights["correction_bias"] = _correction_bias(experts, cfg.balance_bias_rate)
        # A spec without a Train block may leave the weights out (MoE.check_model): it only runs forward.
        losses = {
            "load_balance_loss": cfg.aux_loss_weight or 0.0,
            "router_z_loss": cfg.router_z_loss_weight or 0.0,
        }
        if cfg.seq_aux_loss_weight:  # only when on: a program without it prints no code for it
            losses["seq_balance_loss"] = cfg.seq_aux_loss_weight
        aux = (*losses, "dropped_fraction") if cfg.capacity_factor else tuple(losses)
        out = g.add(
            block,
            "moe",
            "moe",
            {"x": h, "router_logits": logits},
            weights,
            top_k=cfg.top_k,
            capacity_factor=cfg.capacity_factor,
            activation=next(n.op for n in mlp.nodes if n.op in ("swiglu", "gelu")),
            renormalize=cfg.renormalize,
            routed_scale=cfg.routed_scale,
            scoring=cfg.scoring,
            correction_bias=cfg.balance_bias_rate is not None,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            group_score=cfg.group_score,
            aux=aux,
            aux_weights=tuple(losses.items()),
        )
        if cfg.shared_hidden_dim:
            out = _with_shared_expert(g, h, out, cfg)
        g.replace(mlp, out)


def _with_shared_expert(g: Graph, h: Node, routed: Node, cfg: MoE) -> Node:
    """routed + the shared expert's output: the decoder's MLP at `shared_hidden_dim`, gated by sigmoid(h . w)."""
    embed, hidden = h.type.drop("batch", "seq"), TensorType.of(("mlp", cfg.shared_hidden_dim))

    def projection(name: str, x: Node, hf: str, w_type: TensorType, role: str) -> Node:
        w = Param(f"w_{name}", w_type, hf=HFWeight(f"{LAYER}.mlp.{hf}.weight", transpose=True))
        return g.add(h.region, name, "linear", {"x": x}, {"w": w}, role=role)

    up = projection("shared_up", h, "shared_expert.up_proj", embed.concat(hidden), "mlp_in")
    if routed.attrs.activation == "swiglu":
        gate = projection("shared_gate", h, "shared_expert.gate_proj", embed.concat(hidden), "mlp_in")
        act = g.add(h.region, "shared_hidden", "swiglu", {"gate": gate, "up": up})
    else:
        act = g.add(h.region, "shared_hidden", "gelu", {"x": up})
    shared = projection("shared_down", act, "shared_expert.down_proj", hidden.concat(embed), "mlp_out")
    if cfg.shared_gate:
        gate_logit = projection("shared_expert_gate", h, "shared_expert_gate", embed, None)
        shared = g.add(h.region, "shared_gated", "sigmoid_gate", {"x": shared, "gate": gate_logit})
    return g.add(h.region, "moe_and_shared", "add", {"x": routed, "y": shared})


def _sigmoid_gate(ins, attrs, params):
    x, gate = ins["x"], ins["gate"]
    if gate != x.drop(x.axes[-1]):
        raise ShapeError(f"gate{gate} is not x{x} without its last axis")
    return x


register_op("sigmoid_gate", ("x", "gate"), _sigmoid_gate, "moe")


def _correction_bias(experts: TensorType, rate: float) -> Param:
    """DeepSeek-V3's e_score_correction_bias: a statistic, not trained; the train step moves it by `rate` toward
    balance from the experts' loads its backward returns (runtime.balanced). Not decayed: AdamW never sees it.
    """
    hf = HFWeight(f"{LAYER}.mlp.gate.e_score_correction_bias")
    return Param(
        "correction_bias", experts, init="zeros", decay=False, trained=False, balance_rate=rate, hf=hf
    )


def _expert(weight: Param, experts: TensorType, gated: bool) -> Param:
    """An MLP weight with a leading expert axis, named as HF Mixtral fuses them: [gate; up] in one tensor."""
    if weight.key == "w_down":
        hf = HFWeight(f"{LAYER}.mlp.experts.down_proj", transpose=True)
    else:
        part = (int(weight.key == "w_up"), 2) if gated else None
        hf = HFWeight(f"{LAYER}.mlp.experts.{'gate_up' if gated else 'up'}_proj", transpose=True, chunk=part)
    return dataclasses.replace(weight, type=experts.concat(weight.type), hf=hf)
