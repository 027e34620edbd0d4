"""gpt-oss's experts on the MoE node: a biased router, biased expert projections and the clamped SwiGLU with its
`up + 1` term, under gpt-oss's HF names. HF fuses each layer's gate and up projections into `gate_up_proj`
[experts, embed, 2 * hidden] with the gate's and up's columns interleaved (`[..., ::2]` the gate, `[..., 1::2]` up)
and keeps `down_proj` as [experts, hidden, embed]: neither is transposed, unlike Mixtral's."""

import dataclasses

from axgen.ir import LAYER, Graph, HFWeight, Op, Param
from axgen.passes.manager import FeatureConflict, register
from axgen.spec import GptOssExperts


@register("gpt_oss_experts", after=("moe",))
def gpt_oss_experts(g: Graph, cfg: GptOssExperts) -> None:
    for experts in list(g.nodes(op="moe")):
        if experts.attrs.activation != "swiglu":
            raise FeatureConflict(
                "moe", f"{experts} runs {experts.attrs.activation}, not the SwiGLU gpt-oss clamps"
            )
        router = g.inputs(experts)["router_logits"]
        w = router.params["w"]
        g.update(
            router, {"w": dataclasses.replace(w, hf=HFWeight(f"{LAYER}.mlp.router.weight", transpose=True))}
        )
        router_bias = Param(
            "router_bias",
            w.type.drop("embed"),
            init="zeros",
            decay=False,
            hf=HFWeight(f"{LAYER}.mlp.router.bias"),
        )
        g.insert_on_input(experts, "router_logits", Op("bias", params={"b": router_bias}))
        fused = f"{LAYER}.mlp.experts.gate_up_proj"
        names = {
            "w_gate": HFWeight(fused, interleave=(0, 2)),
            "w_up": HFWeight(fused, interleave=(1, 2)),
            "w_down": HFWeight(f"{LAYER}.mlp.experts.down_proj"),
        }
        params = {key: dataclasses.replace(experts.params[key], hf=hf) for key, hf in names.items()}
        for key, hf in [
            ("w_gate", HFWeight(f"{fused}_bias", interleave=(0, 2))),
            ("w_up", HFWeight(f"{fused}_bias", interleave=(1, 2))),
            ("w_down", HFWeight(f"{LAYER}.mlp.experts.down_proj_bias")),
        ]:
            weight = experts.params[key].type  # [expert, in, out]: a bias per expert and output
            bias_type = weight.drop(weight.axes[1])
            params[f"b_{key[2:]}"] = Param(f"b_{key[2:]}", bias_type, init="zeros", decay=False, hf=hf)
        g.update(
            experts,
            params,
            activation="clamped_swiglu",
            biased=True,
            swiglu_alpha=cfg.alpha,
            swiglu_limit=cfg.limit,
        )
