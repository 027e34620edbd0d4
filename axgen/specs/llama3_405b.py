"""Llama 3.1 405B (Grattafiori et al., 2024): the published config (tests/fixtures/hf_configs/published/
llama-3.1-405b.json, 405,853,388,800 parameters) with Meta's pretraining recipe at its final batch: 2048 sequences of
8192 tokens (16M tokens a step), peak lr 8e-5 after 8000 warmup steps, cosine to 1% of it over 1.2M steps.
On 896 H100s it runs in 7 pipeline stages, circular; on 1024, without."""

from axgen.spec import MeshRule, Remat
from axgen.spec import features as F
from axgen.specs.llama3_8b import spec as llama3_8b

spec = llama3_8b.replace(
    name="llama3-405b",
    d_model=16_384,
    max_position=131_072,
    decoder=llama3_8b.decoder.replace(
        num_layers=126,
        attention=llama3_8b.decoder.attention.replace(num_heads=128),
        mlp=llama3_8b.decoder.mlp.replace(hidden_dim=53_248),
    ),
    features=[
        F.rope(
            theta=500_000.0,
            scaling=F.rope_scaling(
                factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
            ),
        )
    ],
    train=llama3_8b.train.replace(
        global_batch=2048, optimizer=llama3_8b.train.optimizer.replace(lr=8e-5, min_lr_ratio=0.01)
    ),
    targets=["gpu-h100-1024", "gpu-h100-896", "cpu-8"],
    mesh_rules=[
        # 4.9 TB of float32 weights and AdamW moments. On 896 GPUs no split without pipeline stages divides the
        # batch; 7 stages do, each stage's weights over fsdp=16 x model=8 (5.4 GB a GPU of state). 32 microbatches
        # of one sequence a pass, going round the stages twice (each stage 2 runs of 9 layers): each stage idles
        # 6 of 70 iterations. Each iteration is rematerialized whole, so the layers inside it save their dots:
        # 69.3 GiB (docs/aot.md; `axgen plan` ranks it first on this mesh). GPipe's 6 of 38 take 57.2 GiB.
        MeshRule(
            r"gpu-h100-896",
            {"stage": 7, "fsdp": -1, "model": 8},
            why="405B on 896: 7 pipeline stages of 2 runs of 9 layers x fsdp=16 x model=8, 32 microbatches a pass",
            microbatch=32,
            pipeline_repeats=2,
            remat=Remat(policy="save_dots"),
        ),
        # Elsewhere fully sharded, model=8 in each host, the residual stream split over model too: each layer's
        # input, which full remat keeps, is 32 MiB a sequence, not 256. So a pass takes 4 sequences (30.8 GiB on
        # gpu-h100-1024), and fsdp's weight gathers across hosts, one per layer and pass, serve 4 sequences each:
        # 0.80 TB a step, not 3.21 (docs/aot.md). Unsplit, one sequence took 42.9 GiB and four 143.4.
        MeshRule(
            r"gpu-h100-\d+",
            {"fsdp": -1, "model": 8},
            why="405B: fsdp x model=8, the residual split over model, four sequences a pass, full remat",
            microbatch=4,
            remat=Remat(policy="full"),
            shard_residual=True,
        ),
    ],
)
