"""QKV bias: each of the query, key and value projections adds a learned bias, as in Qwen2 (HF keeps it as the
projection's `bias`). It comes before any norm or rotation of q and k, as part of the projection."""

from axgen.ir import LAYER, Graph, HFWeight, Op, Param, ShapeError, register_op
from axgen.passes.manager import register
from axgen.spec import QKVBias


def _bias(ins, attrs, params):
    x, b = ins["x"], params["b"].type
    if x.axes[-len(b.axes) :] != b.axes or x.sizes[-len(b.axes) :] != b.sizes:
        raise ShapeError(f"bias b{b} is not the trailing axes of x{x}")
    return x


register_op("bias", ("x",), _bias, "bias")


@register("qkv_bias", before=("qk_norm", "rope"))
def qkv_bias(g: Graph, cfg: QKVBias) -> None:
    for attn in list(g.nodes(op="attention")):
        for slot in ("q", "k", "v"):
            projection = g.inputs(attn)[slot]
            hf = HFWeight(f"{LAYER}.self_attn.{slot}_proj.bias")
            b = Param(f"b{slot}", projection.type.drop("batch", "seq"), init="zeros", decay=False, hf=hf)
            g.insert_on_input(attn, slot, Op("bias", params={"b": b}))
