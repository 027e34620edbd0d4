"""SimPO: the output head's log-probabilities train SimPO's reference-free loss on preference pairs. CONFIG states
the objective, beta and gamma, which the loss reads."""

from axgen.ir import Graph
from axgen.passes.manager import register
from axgen.spec import SimPO


@register("simpo", after=("lora",))
def simpo(g: Graph, cfg: SimPO) -> None:
    (head,) = g.nodes(op="lm_head")
    g.update(head, objective="simpo")
    g.attrs["config"] = (
        *g.attrs["config"],
        ("objective", "simpo", "preference pairs (axgen data --pairs); no reference"),
        ("beta", cfg.beta, "scales the mean log-probabilities"),
        ("gamma", cfg.gamma, "the target margin"),
    )
