"""Mistral 7B v0.1 (Jiang et al., 2023): Llama 3 8B's layers (GQA with 8 kv heads, SwiGLU at 14336) with a
32000-token vocab, RoPE theta 1e4, and sliding-window attention over the last 4096 positions of an 8k context.
Derived from Llama 3 8B: only what differs is written here."""

from axgen.spec import features as F
from axgen.specs.llama3_8b import spec as llama3_8b

spec = llama3_8b.replace(
    name="mistral-7b",
    vocab_size=32_000,
    features=[F.rope(theta=10_000.0), F.sliding_window(window=4096)],
    train=llama3_8b.train.replace(global_batch=256, steps=500_000, warmup_steps=2000),
    targets=["gpu-h100-8", "tpu-v5e-256", "cpu-8"],
)
