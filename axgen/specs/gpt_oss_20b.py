"""gpt-oss-20b (OpenAI, 2025): 24 layers at 2880 wide, 64 query heads of 64 (so head_dim is not d_model / heads)
over 8 kv heads, biases on q, k, v and o, a learned sink logit per head, a 128-token window on every other layer
(even layers windowed, odd ones full), and MLPs made 32 experts 2880 wide, top-4 with biases on the router and on
every expert's projections, and the SwiGLU clamped at 7.0 with an up + 1 term (HF openai/gpt-oss-20b's config.json,
tests/fixtures/hf_configs/published/gpt-oss-20b.json). 20.9B parameters as transformers builds the config (experts
in bfloat16, not the Hub's MXFP4), 3.6B used per token besides the input embedding.

RoPE at theta 150000 with YaRN, factor 32 over a 4096-token original context, as published (transformers' attention
factor for it, 0.1 ln 32 + 1).
"""

from axgen.spec import MLP, AdamW, Attention, Decoder, MeshRule, Model, Remat, RMSNorm, Train
from axgen.spec import features as F

spec = Model(
    name="gpt-oss-20b",
    vocab_size=201_088,
    d_model=2880,
    decoder=Decoder(
        num_layers=24,
        attention=Attention(num_heads=64, num_kv_heads=8, head_dim=64),
        mlp=MLP(
            hidden_dim=2880, activation="swiglu"
        ),  # each expert's width; gpt_oss_experts clamps its SwiGLU
        norm=RMSNorm(eps=1e-5),
    ),
    features=[
        F.rope(
            theta=150_000.0,
            scaling=F.rope_yarn(
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position=4096,
                attention_factor=1.3465735902799727,
                truncate=False,
            ),
        ),
        F.qkv_bias(),
        F.out_bias(),
        F.attention_sinks(),
        F.sliding_window(window=128, global_every=2),
        # router_aux_loss_coef is 0.9 in the published config.
        F.moe(num_experts=32, top_k=4, renormalize=True, aux_loss_weight=0.9, router_z_loss_weight=0.0),
        F.gpt_oss_experts(alpha=1.702, limit=7.0),
    ],
    # 4096 tokens: the context gpt-oss was pre-trained at before YaRN stretched it (initial_context_length).
    train=Train(
        seq_len=4096,
        global_batch=512,
        steps=500_000,
        optimizer=AdamW(lr=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1),
        warmup_steps=2000,
        grad_clip=1.0,
    ),
    targets=["gpu-h100-8", "tpu-v5p-64", "cpu-8"],
    # 20.9B parameters with Adam moments take 29 GiB per GPU over 8; two 4k sequences per pass peaked at 111.3 GiB
    # and one at 82.0 GiB (AOT, save_dots): one sequence per pass with full remat peaks at 72.3 of 75.2 GiB.
    # On tpu-v5p-64 the backend's rule (fsdp=64, two sequences per pass) peaks at 50.8 of 95.0 GiB (AOT).
    mesh_rules=[
        MeshRule(
            r"gpu-h100-[1-8]",
            {"fsdp": -1},
            why="20.9B MoE: one sequence per pass, full remat",
            microbatch=1,
            remat=Remat(policy="full"),
        ),
    ],
)
