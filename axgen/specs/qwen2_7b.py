"""Qwen2 7B (Yang et al., 2024): a Llama with biases on the q, k and v projections, GQA with 4 kv heads, a
152k vocab and RoPE theta 1e6 (HF Qwen/Qwen2-7B's config.json)."""

from axgen.spec import MLP, AdamW, Attention, Decoder, Model, RMSNorm, Train
from axgen.spec import features as F

spec = Model(
    name="qwen2-7b",
    vocab_size=152_064,
    d_model=3584,
    decoder=Decoder(
        num_layers=28,
        attention=Attention(num_heads=28, num_kv_heads=4, head_dim=128),
        mlp=MLP(hidden_dim=18_944, activation="swiglu"),
        norm=RMSNorm(eps=1e-6),
    ),
    features=[F.rope(theta=1_000_000.0), F.qkv_bias()],
    train=Train(
        seq_len=4096,
        global_batch=1024,
        steps=500_000,
        optimizer=AdamW(lr=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1),
        warmup_steps=2000,
        grad_clip=1.0,
    ),
    targets=["gpu-h100-8", "tpu-v5p-128", "cpu-8"],
)
