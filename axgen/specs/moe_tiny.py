"""A tiny mixture of experts: llama_tiny with every second MLP made 4 experts, top-2, dropless; for the tests."""

from axgen.spec import features as F
from axgen.specs.llama_tiny import spec as llama_tiny

spec = llama_tiny.replace(
    name="moe-tiny",
    features=[
        *llama_tiny.features,
        F.moe(
            num_experts=4,
            top_k=2,
            renormalize=True,
            every=2,
            aux_loss_weight=0.01,
            router_z_loss_weight=0.001,
        ),
    ],
    targets=["cpu-1", "cpu-8"],
)
