"""Mixtral 8x7B (Jiang et al., 2024): Mistral 7B's layers with each MLP made 8 experts, top-2 routing, dropless.

46.7B parameters, 12.9B used per token. Derived from Mistral 7B, not copied: Mixtral attends over its whole 32k
context (no sliding window) with RoPE theta 1e6.
"""

from axgen.spec import MeshRule
from axgen.spec import features as F
from axgen.specs.mistral_7b import spec as mistral_7b

spec = mistral_7b.replace(
    name="mixtral-8x7b",
    features=[
        F.rope(theta=1_000_000.0),
        F.moe(num_experts=8, top_k=2, renormalize=True, aux_loss_weight=0.02, router_z_loss_weight=0.001),
    ],
    targets=["tpu-v5p-256", "gpu-h100-64", "cpu-8"],
    # 750 GB of weights and Adam moments fit 80 GiB GPUs only when sharded over all 64, not 8 per host.
    mesh_rules=[
        MeshRule(r"gpu-h100-\d+", {"fsdp": -1}, why="46.7B: fully sharded over every GPU", microbatch=1)
    ],
)
