"""Gemma 3 27B's text model (Gemma team, 2025): Gemma 2's block (GeGLU, sqrt(d)-scaled tied embeddings, (1 + w)
RMSNorms around both sub-layers) with (1 + w) q/k norms, 62 layers of 5 with a 1024-position window to 1 global
(10 groups, then 2 windowed), theta 10,000 on the windowed layers and 1,000,000 with linear scaling 8 on the global
ones, scores scaled by query_pre_attn_scalar 168 (hidden / heads, not head_dim 128), no soft-capping (HF
google/gemma-3-27b-it's text_config, with Gemma3TextConfig's defaults for the keys it leaves out: vocab 262,208,
rms_norm_eps 1e-6, rope thetas 1e6 and 1e4, sliding_window_pattern 6).
"""

from axgen.spec import MLP, AdamW, Attention, Decoder, MeshRule, Model, Remat, RMSNorm, Train
from axgen.spec import features as F

spec = Model(
    name="gemma3-27b",
    vocab_size=262_208,
    d_model=5376,
    tie_embeddings=True,
    decoder=Decoder(
        num_layers=62,
        attention=Attention(num_heads=32, num_kv_heads=16, head_dim=128, scale=168**-0.5),
        mlp=MLP(hidden_dim=21_504, activation="swiglu"),  # gemma_block makes its gate GeGLU
        norm=RMSNorm(eps=1e-6),
    ),
    features=[
        F.rope(theta=1_000_000.0, scaling=F.rope_linear(factor=8.0), local_theta=10_000.0),
        F.gemma_block(),
        F.qk_norm(eps=1e-6),
        F.sliding_window(window=1024, global_every=6),
    ],
    train=Train(
        seq_len=8192,
        global_batch=512,
        steps=500_000,
        optimizer=AdamW(lr=2e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1),
        warmup_steps=2000,
        grad_clip=1.0,
    ),
    targets=["tpu-v5p-128", "gpu-h100-64", "cpu-8"],
    # 27B params with Adam moments in float32 are 0.44 TB: sharded over every chip. A 262k vocab makes one 8k
    # sequence's logits 8.6 GB in float32, so one sequence per pass, and full remat for 62 layers' activations.
    mesh_rules=[
        MeshRule(
            r"tpu-v5p-\d+",
            {"fsdp": -1},
            why="27B, 262k vocab: fully sharded, one sequence per pass, full remat",
            microbatch=1,
            remat=Remat(policy="full"),
        ),
        MeshRule(
            r"gpu-h100-\d+",
            {"fsdp": -1},
            why="27B, 262k vocab: fully sharded over every GPU, one sequence per pass, full remat",
            microbatch=1,
            remat=Remat(policy="full"),
        ),
    ],
)
