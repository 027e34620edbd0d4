"""Rematerialisation: names each projection in the decoder blocks and wraps each block in `jax.checkpoint`.

Names are MaxText's: `qkv_proj` and `out_proj` for attention, `mlp_in` and `mlp_out` for the MLP. A policy says
which named outputs the backward pass keeps (or offloads to host memory); everything else is recomputed.
"""

from axgen.ir import Graph
from axgen.passes.manager import register
from axgen.spec import Remat

DOTS = ("qkv_proj", "out_proj", "mlp_in", "mlp_out")

# policy -> (names kept on device, names offloaded to pinned host memory, why)
POLICIES = {
    "full": ((), (), "keep each layer's input only; recompute the whole layer in backward"),
    "save_dots": (
        DOTS,
        (),
        "keep every projection's output; recompute norms, rope, attention and activations",
    ),
    "save_dots_except_mlp": (
        DOTS[:2],
        (),
        "keep attention projections; recompute the MLP, the widest tensors",
    ),
    "save_qkv_proj": (DOTS[:1], (), "keep q, k, v; recompute the rest"),
    "save_out_proj": (DOTS[1:2], (), "keep the attention output projection; recompute the rest"),
    "offload_dots": ((), DOTS, "move every projection's output to host memory and back for backward"),
}
# (label, whether the projection writes the residual stream's embed axis) -> checkpoint name
NAMES = {
    ("attention", False): "qkv_proj",
    ("attention", True): "out_proj",
    ("mlp", False): "mlp_in",
    ("mlp", True): "mlp_out",
}


@register("remat", after=("moe",))
def remat(g: Graph, cfg: Remat) -> None:
    if cfg.policy == "none":
        return
    save, offload, why = POLICIES[cfg.policy]
    for region in g.blocks():
        for node in list(g.nodes(op="linear", region=region.name)):
            name = NAMES.get((node.label, node.type.axes[-1] == "embed"))
            if name:
                g.update(node, checkpoint_name=name)
        policy = {
            "policy": cfg.policy,
            "save": save,
            "offload": offload,
            "why": why,
            "source": str(cfg.origin),
        }
        g.set_region_attrs(region.name, remat=policy)
