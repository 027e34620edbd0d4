"""Llama 2 7B (Touvron et al., 2023): multi-head attention, SwiGLU, RoPE theta 1e4, 4k context."""

from axgen.spec import MLP, AdamW, Attention, Decoder, Model, RMSNorm, Train
from axgen.spec import features as F

spec = Model(
    name="llama2-7b",
    vocab_size=32_000,
    d_model=4096,
    decoder=Decoder(
        num_layers=32,
        attention=Attention(num_heads=32, num_kv_heads=32, head_dim=128),
        mlp=MLP(hidden_dim=11_008, activation="swiglu"),
        norm=RMSNorm(eps=1e-5),
    ),
    features=[F.rope(theta=10_000.0)],
    train=Train(
        seq_len=4096,
        global_batch=1024,  # 4M tokens, as in the paper
        steps=500_000,
        optimizer=AdamW(lr=3e-4, b1=0.9, b2=0.95, eps=1e-5, weight_decay=0.1),
        warmup_steps=2000,
        grad_clip=1.0,
    ),
    targets=["tpu-v5e-256", "tpu-v5e-256x2", "gpu-h100-8", "trn2-16", "cpu-8"],
)
