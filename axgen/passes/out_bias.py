"""Output-projection bias: the attention's output projection adds a learned bias, as gpt-oss's does (HF keeps it
as `self_attn.o_proj.bias`), before the sub-layer joins the residual stream (and before Gemma's post-norm)."""

from axgen.ir import LAYER, Graph, HFWeight, Op, Param
from axgen.passes.manager import register
from axgen.spec import OutBias


@register("out_bias", before=("gemma_block",))
def out_bias(g: Graph, cfg: OutBias) -> None:
    for region in g.blocks():
        for residual in [n for n in g.nodes(op="add", region=region.name) if n.label == "attention"]:
            projection = g.inputs(residual)["y"]
            hf = HFWeight(f"{LAYER}.self_attn.o_proj.bias")
            b = Param("bo", projection.type.drop("batch", "seq"), init="zeros", decay=False, hf=hf)
            g.insert_on_input(residual, "y", Op("bias", params={"b": b}))
