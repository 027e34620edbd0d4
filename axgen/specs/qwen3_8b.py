"""Qwen3 8B (Qwen team, 2025): Qwen2's layout without q/k/v biases and with RMSNorm on each head of q and k before
RoPE (HF Qwen/Qwen3-8B's config.json). Derived from Qwen2 7B: only what differs is written here."""

from axgen.spec import features as F
from axgen.specs.qwen2_7b import spec as qwen2_7b

spec = qwen2_7b.replace(
    name="qwen3-8b",
    vocab_size=151_936,
    d_model=4096,
    decoder=qwen2_7b.decoder.replace(
        num_layers=36,
        attention=qwen2_7b.decoder.attention.replace(num_heads=32, num_kv_heads=8),
        mlp=qwen2_7b.decoder.mlp.replace(hidden_dim=12_288),
    ),
    features=[F.rope(theta=1_000_000.0), F.qk_norm(eps=1e-6)],
    targets=["gpu-h100-8", "tpu-v5e-256", "cpu-8"],
)
