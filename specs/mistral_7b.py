"""Mistral 7B v0.3 (Jiang et al., 2023): Llama-style with GQA (8 kv heads), RoPE theta 1e6, a 32768-token vocab."""

from axgen.spec import MLP, AdamW, Attention, Decoder, Model, RMSNorm, Train
from axgen.spec import features as F

spec = Model(
    name="mistral-7b",
    vocab_size=32_768,
    d_model=4096,
    decoder=Decoder(
        num_layers=32,
        attention=Attention(num_heads=32, num_kv_heads=8, head_dim=128),
        mlp=MLP(hidden_dim=14_336, activation="swiglu"),
        norm=RMSNorm(eps=1e-5),
    ),
    features=[F.rope(theta=1_000_000.0)],
    train=Train(
        seq_len=8192,
        global_batch=256,
        steps=500_000,
        optimizer=AdamW(lr=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1),
        warmup_steps=2000,
        grad_clip=1.0,
    ),
    targets=["gpu-h100-8", "tpu-v5e-256", "cpu-8"],
)
