"""A tiny Llama: the default spec of `make demo` (a 512-token BPE of the demo corpus) and of the tests (bytes)."""

from axgen.spec import MLP, AdamW, Attention, Decoder, Model, RMSNorm, Train
from axgen.spec import features as F

spec = Model(
    name="llama-tiny",
    vocab_size=512,
    d_model=128,
    decoder=Decoder(
        num_layers=4,
        attention=Attention(num_heads=4, num_kv_heads=2, head_dim=32),
        mlp=MLP(hidden_dim=384, activation="swiglu"),
        norm=RMSNorm(eps=1e-5),
    ),
    features=[F.rope(theta=10_000.0)],
    train=Train(
        seq_len=128,
        global_batch=16,
        steps=400,
        optimizer=AdamW(lr=3e-3, b2=0.95, weight_decay=0.1),
        warmup_steps=20,
        checkpoint_every=100,
    ),
    targets=["cpu-1", "cpu-8", "tpu-v5e-8", "tpu-v5e-4x2", "gpu-h100-8", "trn2-16"],
)
