"""Mixture of experts: the MLP of every `every`-th layer becomes a router and `num_experts` expert MLPs.

With `every > 1` the decoder block splits in two, dense and MoE, scanned in turn; the expert weights are the
MLP's own weights with a leading `expert` axis, so the MoE keeps the spec's activation.
"""

import dataclasses

from axgen.ir import LAYER, Graph, HFWeight, Param, TensorType
from axgen.passes.manager import register
from axgen.spec import MoE


@register("moe")
def moe(g: Graph, cfg: MoE) -> None:
    for scan in list(g.nodes(op="scan")):
        block = scan.attrs.blocks[-1]
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
        losses = {
            "load_balance_loss": cfg.aux_loss_weight,
            "router_z_loss": cfg.router_z_loss_weight,
        }
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
            aux=aux,
            aux_weights=tuple(losses.items()),
        )
        g.replace(mlp, out)


def _expert(weight: Param, experts: TensorType, gated: bool) -> Param:
    """An MLP weight with a leading expert axis, named as HF Mixtral fuses them: [gate; up] in one tensor."""
    if weight.key == "w_down":
        hf = HFWeight(f"{LAYER}.mlp.experts.down_proj", transpose=True)
    else:
        part = (int(weight.key == "w_up"), 2) if gated else None
        hf = HFWeight(f"{LAYER}.mlp.experts.{'gate_up' if gated else 'up'}_proj", transpose=True, chunk=part)
    return dataclasses.replace(weight, type=experts.concat(weight.type), hf=hf)
