"""Gemma 2 9B (Gemma team, 2024): GeGLU, sqrt(d)-scaled tied embeddings, (1 + w) RMSNorms around both sub-layers,
layers alternating a 4096-position sliding window and full attention, attention scores soft-capped at 50 and
logits at 30 (HF google/gemma-2-9b's config.json; its query_pre_attn_scalar equals head_dim, the usual scale).
"""

from axgen.spec import MLP, AdamW, Attention, Decoder, MeshRule, Model, Remat, RMSNorm, Train
from axgen.spec import features as F

spec = Model(
    name="gemma2-9b",
    vocab_size=256_000,
    d_model=3584,
    tie_embeddings=True,
    decoder=Decoder(
        num_layers=42,
        attention=Attention(num_heads=16, num_kv_heads=8, head_dim=256),
        mlp=MLP(hidden_dim=14_336, activation="swiglu"),  # gemma_block makes its gate GeGLU
        norm=RMSNorm(eps=1e-6),
    ),
    features=[
        F.rope(theta=10_000.0),
        F.gemma_block(),
        F.sliding_window(window=4096, global_every=2),
        F.softcap(attention=50.0, final=30.0),
    ],
    train=Train(
        seq_len=8192,
        global_batch=512,
        steps=500_000,
        optimizer=AdamW(lr=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1),
        warmup_steps=2000,
        grad_clip=1.0,
    ),
    targets=["tpu-v5p-128", "gpu-h100-8", "cpu-8"],
    # A 256k vocab makes one 8k sequence's logits 8 GB in float32, and 42 layers of saved projections at two
    # sequences per pass took 116 GiB of temporaries (AOT): one sequence per pass; on H100 full remat as well.
    mesh_rules=[
        MeshRule(r"tpu-v5p-\d+", {"fsdp": -1}, why="9B, 256k vocab: one sequence per pass", microbatch=1),
        MeshRule(
            r"gpu-h100-\d+",
            {"fsdp": -1},
            why="9B, 256k vocab: one sequence per pass, full remat",
            microbatch=1,
            remat=Remat(policy="full"),
        ),
    ],
)
