"""Qwen3-30B-A3B (Qwen team, 2025): Qwen3's attention (q/k RMSNorm, no biases; 32 query heads of 128 over a
2048-wide model, so head_dim is not d_model / heads) in 48 layers whose MLPs are 128 fine-grained experts (768 wide),
top-8 with the k weights renormalised, no shared expert (HF Qwen/Qwen3-30B-A3B's config.json). 30.5B parameters,
3.3B used per token. Derived from Qwen3 8B: only what differs is written here."""

from axgen.spec import MeshRule
from axgen.spec import features as F
from axgen.specs.qwen3_8b import spec as qwen3_8b

spec = qwen3_8b.replace(
    name="qwen3-30b-a3b",
    d_model=2048,
    decoder=qwen3_8b.decoder.replace(
        num_layers=48,
        attention=qwen3_8b.decoder.attention.replace(num_heads=32, num_kv_heads=4, head_dim=128),
        mlp=qwen3_8b.decoder.mlp.replace(hidden_dim=768),  # each routed expert's width
    ),
    features=[
        *qwen3_8b.features,
        F.moe(num_experts=128, top_k=8, renormalize=True, aux_loss_weight=0.001, router_z_loss_weight=0.0),
    ],
    targets=["gpu-h100-16", "tpu-v5p-64", "cpu-8"],
    # 30.5B parameters with Adam moments and float32 gradients peak at 100.6 GiB per GPU sharded over one host's 8
    # (AOT, one sequence per pass): two hosts, fully sharded.
    mesh_rules=[
        MeshRule(r"gpu-h100-\d+", {"fsdp": -1}, why="30.5B MoE: fully sharded over two hosts", microbatch=1),
    ],
)
