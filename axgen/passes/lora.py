"""LoRA: each targeted projection adds `scale * (x A) B` to its weight's product, and every param but the adapters
is frozen (no gradient, no optimizer moments, loaded rather than checkpointed).

A projection is targeted by the module name PEFT's `target_modules` gives it, read off its weight's Hugging Face
name (`model.layers.{layer}.self_attn.q_proj.weight` is `q_proj`), so the adapters' own HF names are PEFT's
(`base_model.model.model.layers.{layer}.self_attn.q_proj.lora_A.weight`, [rank, in]; `lora_B`, [out, rank]) and
an adapter reads and writes as PEFT saves it. A weight HF fuses with others (Phi-3's qkv_proj) has no module of its
own for an adapter to name, and MoE experts and MLA projections have no PEFT module of these names: they are refused
rather than adapted under a name PEFT would not load.
"""

import dataclasses

from axgen.ir import Graph, HFWeight, Node, Param, TensorType
from axgen.passes.manager import PassError, register
from axgen.spec import LoRA


def module_name(node: Node) -> str | None:
    """The PEFT module name of a linear node's weight (`q_proj`), or None where HF has no Linear of its own."""
    hf = node.params["w"].hf
    if hf is None or hf.chunk or hf.interleave or not hf.name.endswith(".weight"):
        return None
    return hf.name.split(".")[-2]


def _adapters(w: Param, x: TensorType, rank: int) -> dict[str, Param]:
    """A [what w contracts, rank] and B [rank, what w makes], named in PEFT's file beside w's module."""
    module = w.hf.name.removesuffix(".weight")
    rank_axis = TensorType.of(("lora_rank", rank))
    made = [axis for axis in w.type.axes if axis not in x.axes]
    a_type = w.type.drop(*made).concat(rank_axis)
    b_type = rank_axis.concat(w.type.drop(*[axis for axis in w.type.axes if axis not in made]))
    return {
        f"lora_{part}": Param(
            f"{w.key}_lora_{part}",
            type_,
            init=init,
            adapter=True,
            hf=HFWeight(f"base_model.model.{module}.lora_{part.upper()}.weight", transpose=True),
        )
        for part, type_, init in (("a", a_type, "kaiming_uniform"), ("b", b_type, "zeros"))
    }


@register("lora", after=("moe", "mla", "qkv_bias", "out_bias", "gemma_block", "gpt_oss_experts", "quantize"))
def lora(g: Graph, cfg: LoRA) -> None:
    linears = [n for n in g.nodes(op="linear") if n.region != "main"]
    chosen = [n for n in linears if module_name(n) in cfg.targets]
    names = {module_name(n) for n in linears} - {None}
    missing = [t for t in cfg.targets if t not in names]
    if missing:
        raise PassError(
            f"{cfg.provenance}: targets names {missing[0]!r}, which this model has no projection of"
            f" (it has {', '.join(sorted(names))})"
        )
    for node in chosen:
        adapters = _adapters(node.params["w"], g.inputs(node)["x"].type, cfg.rank)
        g.update(node, adapters, lora_scale=cfg.scale, lora_dropout=cfg.dropout or None)
    # Everything else is the frozen base; statistics (fp8 amax histories) go on following their dots.
    for node in list(g.nodes()):
        frozen = {
            role: dataclasses.replace(p, frozen=True, dtype=cfg.base_dtype)
            for role, p in node.params.items()
            if p.trained and not p.adapter
        }
        if frozen:
            g.update(node, frozen)
