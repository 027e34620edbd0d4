"""Qwen1.5-MoE-A2.7B (Qwen team, 2024): Qwen2's attention (q/k/v biases) at 2048 wide and 24 deep, each MLP made
60 fine-grained experts (1408 wide), top-4 without renormalising, plus a 5632-wide shared expert gated by sigmoid
(HF Qwen/Qwen1.5-MoE-A2.7B's config.json). 14.3B parameters, 2.7B used per token. Derived from Qwen2 7B."""

from axgen.spec import MeshRule
from axgen.spec import features as F
from axgen.specs.qwen2_7b import spec as qwen2_7b

spec = qwen2_7b.replace(
    name="qwen2-moe-a2.7b",
    vocab_size=151_936,
    d_model=2048,
    decoder=qwen2_7b.decoder.replace(
        num_layers=24,
        attention=qwen2_7b.decoder.attention.replace(num_heads=16, num_kv_heads=16),
        mlp=qwen2_7b.decoder.mlp.replace(hidden_dim=1408),  # each routed expert's width
    ),
    features=[
        *qwen2_7b.features,
        F.moe(
            num_experts=60,
            top_k=4,
            renormalize=False,
            shared_hidden_dim=5632,
            shared_gate=True,
            aux_loss_weight=0.001,
            router_z_loss_weight=0.0,
        ),
    ],
    targets=["gpu-h100-8", "cpu-8"],
    # 14.3B parameters with Adam moments take 20 GiB per GPU over 8; two sequences per pass peaked at 79.5 of
    # 80 GiB (AOT), too close to the chip's edge: one sequence per pass.
    mesh_rules=[
        MeshRule(r"gpu-h100-[1-8]", {"fsdp": -1}, why="14.3B MoE: one sequence per pass", microbatch=1),
    ],
)
