"""Qwen3-235B-A22B (Qwen team, 2025): Qwen3-30B-A3B's layer at 4096 wide and 94 deep, 64 query heads and 4 kv
heads of 128, 128 experts of 1536, top-8 renormalised (HF Qwen/Qwen3-235B-A22B's config.json). 235.1B
parameters, 22B used per token. Derived from Qwen3-30B-A3B: only what differs is written here."""

from axgen.spec import MeshRule, Remat
from axgen.specs.qwen3_30b_a3b import spec as qwen3_30b_a3b

spec = qwen3_30b_a3b.replace(
    name="qwen3-235b-a22b",
    d_model=4096,
    decoder=qwen3_30b_a3b.decoder.replace(
        num_layers=94,
        attention=qwen3_30b_a3b.decoder.attention.replace(num_heads=64),
        mlp=qwen3_30b_a3b.decoder.mlp.replace(hidden_dim=1536),
    ),
    targets=["tpu-v5p-256", "gpu-h100-128", "cpu-8"],
    # 235B with Adam moments is 2.8 TB: fully sharded over every chip, one sequence per pass, and full remat (the
    # backend's two sequences per v5p pass, keeping every projection, needed 148 GB of temporaries per chip). AOT
    # peaks per device: 59.1 GiB on tpu-v5p-256, 53.0 on gpu-h100-128 (92.2 on gpu-h100-64: over its 75.2).
    mesh_rules=[
        MeshRule(
            r"(tpu-v5p|gpu-h100)-\d+",
            {"fsdp": -1},
            why="235B MoE: fully sharded, one sequence per pass, full remat",
            microbatch=1,
            remat=Remat(policy="full"),
        ),
    ],
)
