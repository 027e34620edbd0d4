"""Llama 3.1 8B at 131,072 tokens on tpu-v5p-128, the sequence over 16 chips: the long-context row of
docs/maxtext.md, against MaxText's llama3.1-8b with ici_context_parallelism=16 (its all-gather strategy, load
balanced) at per_device_batch_size=0.0625 (8 sequences over 128 chips)."""

from axgen.spec import MeshRule
from axgen.spec import features as F
from axgen.spec.feature_configs import RopeScaling
from axgen.specs.llama3_8b import spec as llama3

scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
spec = llama3.replace(
    name="llama3.1-8b-128k",
    features=[F.rope(theta=500_000.0, scaling=scaling)],
    train=llama3.train.replace(seq_len=131_072, global_batch=8),
    mesh_rules=[
        MeshRule("tpu-v5p-128", {"fsdp": 8, "context": 16}, why="128k tokens: each sequence over 16 chips")
    ],
    targets=["tpu-v5p-128"],
)
