"""QK-norm: the queries and keys of every attention are RMS-normalised over each head's channels before RoPE, with
a learned scale per channel (Qwen3's and Gemma 3's `q_norm` and `k_norm`)."""

from axgen.ir import LAYER, Graph, HFWeight, Op, Param
from axgen.passes.manager import register
from axgen.spec import QKNorm


@register("qk_norm", before=("rope",))
def qk_norm(g: Graph, cfg: QKNorm) -> None:
    for attn in list(g.nodes(op="attention")):
        for slot in ("q", "k"):
            head = g.inputs(attn)[slot].type.drop("batch", "seq", "heads", "kv_heads")
            hf = HFWeight(f"{LAYER}.self_attn.{slot}_norm.weight")
            scale = Param(f"{slot}_norm", head, init="ones", decay=False, hf=hf)
            g.insert_on_input(attn, slot, Op("rms_norm", params={"scale": scale}, eps=cfg.eps))
