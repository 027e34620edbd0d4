"""gpt-oss-120b (OpenAI, 2025): gpt-oss-20b's layers, 36 of them, each MLP made 128 experts, top-4 (HF
openai/gpt-oss-120b's config.json, tests/fixtures/hf_configs/published/gpt-oss-120b.json). 116.8B parameters as
transformers builds the config (experts in bfloat16, not the Hub's MXFP4), 5.1B used per token besides the input
embedding. Derived from gpt-oss-20b: only what differs is written here.
"""

from axgen.spec import MeshRule, Remat
from axgen.specs.gpt_oss_20b import spec as gpt_oss_20b

spec = gpt_oss_20b.replace(
    name="gpt-oss-120b",
    decoder=gpt_oss_20b.decoder.replace(num_layers=36),
    features=[
        feature.replace(num_experts=128) if feature.pass_name == "moe" else feature
        for feature in gpt_oss_20b.features
    ],
    targets=["gpu-h100-64", "tpu-v5p-256", "cpu-8"],
    # 116.8B parameters with Adam moments are 1.4 TB: sharded over all 64 GPUs, not 8 per host as the backend's rule
    # does; one sequence per pass and full remat, as gpt-oss-20b needs on 8: AOT peak 61.3 of 75.2 GiB.
    # On tpu-v5p-256 the backend's fsdp=256 cannot split the 2880-wide embed (2880 / 256 is no integer), so every
    # weight would be whole on every chip (libtpu: 1.74T of temporaries); fsdp=64 divides it and the experts split
    # 4 ways over the rest: AOT peak 26.7 of 95.0 GiB.
    mesh_rules=[
        MeshRule(
            r"gpu-h100-\d+",
            {"fsdp": -1},
            why="116.8B MoE: fully sharded over every GPU, one sequence per pass, full remat",
            microbatch=1,
            remat=Remat(policy="full"),
        ),
        MeshRule(
            r"tpu-v5p-256",
            {"fsdp": 64, "expert": 4},
            why="116.8B MoE: fsdp=64 divides the 2880-wide embed, experts split 4 ways, one sequence per pass",
            microbatch=1,
            remat=Remat(policy="full"),
        ),
    ],
)
