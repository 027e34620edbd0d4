"""Llama 3 8B (Grattafiori et al., 2024): grouped-query attention with 8 kv heads, RoPE theta 5e5, 128k vocab."""

from axgen.spec import MLP, AdamW, Attention, Decoder, Model, RMSNorm, Train
from axgen.spec import features as F

spec = Model(
    name="llama3-8b",
    vocab_size=128_256,
    d_model=4096,
    decoder=Decoder(
        num_layers=32,
        attention=Attention(num_heads=32, num_kv_heads=8, head_dim=128),
        mlp=MLP(hidden_dim=14_336, activation="swiglu"),
        norm=RMSNorm(eps=1e-5),
    ),
    features=[F.rope(theta=500_000.0)],
    train=Train(
        seq_len=8192,
        global_batch=512,
        steps=1_200_000,
        optimizer=AdamW(lr=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1),
        warmup_steps=8000,
        grad_clip=1.0,
    ),
    targets=["tpu-v5p-128", "gpu-h100-64", "trn2-64", "cpu-8"],
)
