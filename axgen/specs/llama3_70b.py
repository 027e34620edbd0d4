"""Llama 3 70B: the 8B recipe at 8192 wide and 80 deep with 64 query heads, derived rather than copied."""

from axgen.spec import MeshRule, Remat
from axgen.specs.llama3_8b import spec as llama3_8b

spec = llama3_8b.replace(
    name="llama3-70b",
    d_model=8192,
    decoder=llama3_8b.decoder.replace(
        num_layers=80,
        attention=llama3_8b.decoder.attention.replace(num_heads=64),
        mlp=llama3_8b.decoder.mlp.replace(hidden_dim=28_672),
    ),
    train=llama3_8b.train.replace(optimizer=llama3_8b.train.optimizer.replace(lr=1.5e-4)),
    targets=["tpu-v5p-512", "gpu-h100-64", "trn2-64", "cpu-8"],
    mesh_rules=[
        # The backend's v5p-512 layout, data x fsdp=64 (1.1 TB of weights and Adam moments at 18 GB per chip), but
        # full remat: saving every projection of 80 layers would take 110 GB per 8k sequence.
        MeshRule(
            r"tpu-v5p-\d+",
            {"data": -1, "fsdp": 64},
            why="70B: data x fsdp=64, one sequence per pass, full remat",
            microbatch=1,
            remat=Remat(policy="full"),
        ),
        # 1.1 TB of weights and Adam moments fit 80 GiB GPUs only when sharded over all of them, not 8 per host;
        # one 8k sequence per pass and full remat keep 80 layers' activations near 10 GiB.
        MeshRule(
            r"gpu-h100-\d+",
            {"fsdp": -1},
            why="70B: fully sharded over every GPU",
            microbatch=1,
            remat=Remat(policy="full"),
        ),
        # Likewise on Trainium2: the backend's model=4 x fsdp, but one sequence per pass and full remat.
        MeshRule(
            r"trn2-\d+",
            {"fsdp": -1, "model": 4},
            why="70B: model=4 x fsdp, one sequence per pass",
            microbatch=1,
            remat=Remat(policy="full"),
        ),
    ],
)
