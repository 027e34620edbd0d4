"""NVIDIA H100 targets `gpu-h100-N`: N GPUs, 8 per host, bf16 compute, cuDNN fused attention."""

from axgen.backends.common import GIB, Chip, Family, MeshRule
from axgen.spec import Remat

FAMILY = Family(
    name="gpu",
    pattern=r"gpu-h100-(\d+)",
    display="gpu-h100-N",
    # H100 SXM: 989 TFLOP/s dense bf16, 80 GiB HBM3, 8 GPUs per HGX host.
    chip=Chip(
        "NVIDIA H100 SXM",
        peak_bf16_flops=989e12,
        hbm_bytes=80 * GIB,
        devices_per_host=8,
        capabilities=frozenset({"host_offload", "int8", "fp8"}),
    ),
    rules=(
        # NVLink inside a host is fast enough for FSDP's all-gathers; across hosts InfiniBand is not, so replicate.
        MeshRule(r"gpu-h100-[1-8]", {"fsdp": -1}, why="fully sharded data parallel over one host's NVLink"),
        MeshRule(r"gpu-h100-\d+", {"data": -1, "fsdp": 8}, why="data parallel across hosts, fsdp within each"),
    ),
    compute_dtype="bfloat16",
    attention="cudnn",
    # Latency-hiding scheduler overlaps FSDP's collectives with compute.
    xla_flags=("--xla_gpu_enable_latency_hiding_scheduler=true",),
    # 80 GiB holds every projection's output of a 7-8B model at 8k context; recomputing only the cheap
    # elementwise work costs about 5% of a step instead of the third that full remat costs.
    remat=Remat(policy="save_dots"),
    # Hopper's fp8 tensor cores run at twice the bf16 rate, and fp8 keeps more range than int8 for activations.
    quantize_dtype="fp8",
)
