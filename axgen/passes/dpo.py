"""DPO: the output head's log-probabilities train the DPO loss on preference pairs, against a reference model:
with F.lora, the same params with the adapters off (the frozen base: no second copy of the weights); without
it, a frozen copy of the initial params, which the state keeps beside the trained ones. CONFIG states the
objective, the reference and beta, which the runtime and the loss read."""

from axgen.ir import Graph
from axgen.passes.manager import register
from axgen.spec import DPO


@register("dpo", after=("lora",))
def dpo(g: Graph, cfg: DPO) -> None:
    (head,) = g.nodes(op="lm_head")
    adapters = any(p.adapter for node in g.nodes() for p in node.params.values())
    reference = "adapters off" if adapters else "copy"
    g.update(head, objective="dpo", reference=reference)
    g.attrs["config"] = (
        *g.attrs["config"],
        ("objective", "dpo", "preference pairs (axgen data --pairs)"),
        ("reference", reference, _REFERENCES[reference]),
        ("beta", cfg.beta, "the DPO loss's temperature"),
    )


_REFERENCES = {
    "adapters off": "the frozen base: these params with F.lora's adapters zero",
    "copy": "a frozen copy of the initial params, kept beside them and not checkpointed",
}
