"""Llama 3.1 8B at 32,768 tokens on tpu-v5p-128, the sequence over 4 chips: the shorter long-context row of
docs/maxtext.md, against MaxText's llama3.1-8b with ici_context_parallelism=4 at per_device_batch_size=0.25 (32
sequences over 128 chips)."""

from axgen.spec import MeshRule
from specs.llama3_1_8b_128k import spec as llama31

spec = llama31.replace(
    name="llama3.1-8b-32k",
    train=llama31.train.replace(seq_len=32_768, global_batch=32),
    mesh_rules=[
        MeshRule("tpu-v5p-128", {"fsdp": 32, "context": 4}, why="32k tokens: each sequence over 4 chips")
    ],
)
