"""Gemma's block on a Llama graph: GeGLU in place of SwiGLU, embeddings scaled by sqrt(d_model), RMSNorms that
scale by 1 + w (the param holds w, initialised to zeros, as HF's does), and a norm after each sub-layer, before it
joins the residual stream (HF: post_attention_layernorm, post_feedforward_layernorm; the MLP's input norm is
pre_feedforward_layernorm)."""

import dataclasses
import math

from axgen.ir import LAYER, Attrs, Graph, HFWeight, Node, Op, Param, register_op, same_as
from axgen.passes.manager import register
from axgen.spec import GemmaBlock


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleAttrs(Attrs):
    factor: float


register_op("scale", ("x",), same_as("x"), "gemma", ScaleAttrs)
register_op("geglu", ("gate", "up"), same_as("gate", "up"), "gemma")

POST_NORMS = {"attention": "post_attention_layernorm", "mlp": "post_feedforward_layernorm"}


@register("gemma_block", after=("moe", "qk_norm", "sliding_window"))
def gemma_block(g: Graph, cfg: GemmaBlock) -> None:
    scan = next(g.nodes(op="scan"))
    g.insert_on_input(scan, "x", Op("scale", factor=math.sqrt(scan.type.size("embed"))))
    for region in g.blocks():
        mlp_norm = g.node(region.name, "mlp_norm")
        _set_hf(g, mlp_norm, HFWeight(f"{LAYER}.pre_feedforward_layernorm.weight"))
        residuals = [n for n in g.nodes(op="add", region=region.name) if n.label in POST_NORMS]
        for (
            residual
        ) in residuals:  # the two that join the residual stream, not an MoE's sum with its shared expert
            hf = HFWeight(f"{LAYER}.{POST_NORMS[residual.label]}.weight")
            scale = Param(
                f"post_{residual.label}_norm", mlp_norm.params["scale"].type, "zeros", decay=False, hf=hf
            )
            g.insert_on_input(residual, "y", Op("rms_norm", params={"scale": scale}, eps=mlp_norm.attrs.eps))
        for swiglu in list(g.nodes(op="swiglu", region=region.name)):
            geglu = g.add(region.name, "hidden_geglu", "geglu", g.inputs(swiglu))
            g.replace(g.subgraph(region.name, lambda n, old=swiglu: n is old), geglu)
        for experts in g.nodes(op="moe", region=region.name):  # routed experts: GeGLU as the dense MLP is
            if experts.attrs.activation == "swiglu":
                g.update(experts, activation="geglu")
    for norm in list(g.nodes(op="rms_norm")):  # every norm, q and k norms too, scales by 1 + w
        g.update(norm, {"scale": dataclasses.replace(norm.params["scale"], init="zeros")}, offset=1.0)


def _set_hf(g: Graph, norm: Node, hf: HFWeight) -> None:
    g.update(norm, {"scale": dataclasses.replace(norm.params["scale"], hf=hf)})
