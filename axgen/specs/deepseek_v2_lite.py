"""DeepSeek-V2-Lite (DeepSeek-AI, 2024): 27 layers 2048 wide; multi-head latent attention with 16 heads and no q
latent (one q_proj), k/v from a 512-channel latent, q/k heads of 128 + 64 RoPE channels in adjacent pairs, v heads
of 128; YaRN factor 40 over 4096 positions (mscale 0.707, mscale_all_dim 0.707); the first layer dense at 10944,
then DeepSeek-MoE: 64 routed experts of 1408, softmax top-6 not renormalised, and two experts' width of shared
expert. Written as `axgen import-hf` writes the published config.json (tests/fixtures/hf_configs/published/
deepseek-v2-lite.json, the Hub's bytes), whose aux_loss_alpha 0.001 is the experts' balance-loss weight.
15,706,484,224 parameters as transformers counts them."""

from axgen.spec import MLP, AdamW, Attention, Decoder, MeshRule, Model, Remat, RMSNorm, Train
from axgen.spec import features as F

spec = Model(
    name="deepseek-v2-lite",
    vocab_size=102_400,
    d_model=2048,
    tie_embeddings=False,
    checkpoint_dtype="bfloat16",
    decoder=Decoder(
        num_layers=27,
        attention=Attention(
            num_heads=16, num_kv_heads=16, head_dim=192, scale=0.1147213867929261
        ),  # 192**-0.5 * mscale(40, mscale_all_dim=0.707)**2
        mlp=MLP(hidden_dim=1408, activation="swiglu"),
        norm=RMSNorm(eps=1e-06),
    ),
    features=[
        F.rope(
            theta=10_000.0,
            scaling=F.rope_yarn(
                factor=40.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position=4096,
                attention_factor=1.0,
                truncate=True,
            ),
            rotary_dim=64,
            interleaved=True,
        ),
        F.mla(
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            eps=1e-06,
        ),
        F.moe(
            num_experts=64,
            top_k=6,
            renormalize=False,
            routed_scale=1.0,
            shared_hidden_dim=2816,
            first_dense_layers=1,
            dense_hidden_dim=10_944,
            aux_loss_weight=0.001,
            router_z_loss_weight=0.0,
        ),
    ],
    train=Train(
        seq_len=4096,
        global_batch=512,
        steps=1000,
        warmup_steps=10,
        optimizer=AdamW(lr=1e-05),
    ),
    targets=["gpu-h100-16", "tpu-v5p-64", "cpu-8"],
    # 15.7B with Adam moments is about 250 GB: fully sharded, one sequence per pass, full remat, as qwen3_30b_a3b.
    mesh_rules=[
        MeshRule(
            r"(tpu-v5p|gpu-h100)-\d+",
            {"fsdp": -1},
            why="15.7B MoE: fully sharded, one sequence per pass, full remat",
            microbatch=1,
            remat=Remat(policy="full"),
        ),
    ],
)
