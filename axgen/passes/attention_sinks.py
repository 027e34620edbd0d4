"""Attention sinks: each query head learns one logit that joins every query's softmax beside its keys' scores and
carries no value, as in gpt-oss (HF's `self_attn.sinks`). The logit is an attention param; each target's lowering
hands it to a kernel that takes sinks or to XLA's path."""

from axgen.ir import LAYER, Graph, HFWeight, Param, TensorType
from axgen.passes.manager import register
from axgen.spec import AttentionSinks


@register("attention_sinks")
def attention_sinks(g: Graph, cfg: AttentionSinks) -> None:
    for attn in list(g.nodes(op="attention")):
        heads = TensorType.of(("heads", attn.type.size("heads")))
        # HF initialises the sinks from normal(0, initializer_range); they are logits, not scales, so no decay.
        sinks = Param("sinks", heads, decay=False, hf=HFWeight(f"{LAYER}.self_attn.sinks"))
        g.update(attn, params={"sinks": sinks}, sinks=True)
