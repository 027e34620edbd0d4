"""NVIDIA H100 targets `gpu-h100-N`: N GPUs, 8 per host, bf16 compute, cuDNN fused attention."""

import math

from axgen.backends.common import Chip, Family, GroupedMatmul
from axgen.spec import MeshRule, Remat

GPUS_PER_HOST = 8

# Published H100 SXM5 facts (NVIDIA H100 Tensor Core GPU Architecture whitepaper; CUDA occupancy tables for
# compute capability 9.0): what XLA's GPU compiler needs to compile for the chip without one.
H100_SXM = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 48 * 1024,  # without opt-in
    "shared_memory_per_block_optin": 227 * 1024,
    "shared_memory_per_core": 228 * 1024,
    "threads_per_core_limit": 2048,
    "core_count": 132,  # streaming multiprocessors
    "fpus_per_core": 128,  # FP32 lanes per SM
    "block_dim_limit_x": 2**31 - 1,
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
    "memory_bandwidth": 3_352_320_000_000,  # bytes/s, HBM3
    "l2_cache_size": 50 * 1024**2,
    "clock_rate_ghz": 1.98,  # boost
    "device_memory_size": 84_942_979_072,  # the 80 GiB HBM3 as CUDA reports it
    "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
}
COMPUTE_CAPABILITY = (9, 0)  # Hopper
CUDNN_VERSION = (9, 8, 0)  # the cuDNN the compile assumes; 9.x is what enables cuDNN fused attention in XLA


def target_config() -> str:
    """XLA's GpuTargetConfigProto, as text, for an H100 SXM: what `axgen aot` hands the CUDA plugin."""
    info = "\n".join(f"  {key}: {value}" for key, value in H100_SXM.items())
    major, minor, patch = CUDNN_VERSION
    cc_major, cc_minor = COMPUTE_CAPABILITY
    return (
        f"gpu_device_info {{\n{info}\n  cuda_compute_capability {{\n    major: {cc_major}\n    minor: {cc_minor}\n  }}\n}}\n"
        f'platform_name: "CUDA"\n'
        f"dnn_version_info {{\n  major: {major}\n  minor: {minor}\n  patch: {patch}\n}}\n"
        f'device_description_str: "NVIDIA H100 80GB HBM3"\n'
    )


# Tiles of jax's Mosaic GPU grouped matmul (`ragged_dot_mgpu`, and `transposed_ragged_dot_mgpu` for the weight
# gradient), tried in order: block_m, block_n, block_k, max_concurrent_steps. The first is the fastest of jax's own
# sweep on one H100 for Mixtral's [16384, 4096] x [8, 4096, 14336] (393-606 TFLOP/s, against ragged_dot's ~100);
# the second, untuned, takes experts whose widths are multiples of 64 only. No tile sweep of ours has run on an H100
# (`bench/h100.py` times the kernel against ragged_dot with these tiles).
GROUPED_MATMUL_TILES = ((128, 128, 64, 4), (64, 64, 64, 4))
# Output columns each SM walks before the next row of blocks (grid_block_n), widest first: 4 measured best.
GRID_BLOCK_N = (4, 2, 1)


def grouped_matmul_tiles(embed: int, hidden: int) -> dict[str, int] | str:
    """The kernel's tiles for experts of one device that map `embed` -> `hidden` -> `embed`, else why it cannot run.

    Every product of the expert MLP and of its gradient splits both widths into blocks: each is a row block
    (block_m) of the weight gradient, a contraction step (block_k) of one product and an output block of another
    (block_n x grid_block_n)."""
    for block_m, block_n, block_k, steps in GROUPED_MATMUL_TILES:
        if any(width % math.lcm(block_m, block_n, block_k) for width in (embed, hidden)):
            continue
        grid_block_n = next(n for n in GRID_BLOCK_N if embed % (n * block_n) == hidden % (n * block_n) == 0)
        return {
            "block_m": block_m,
            "block_n": block_n,
            "block_k": block_k,
            "max_concurrent_steps": steps,
            "grid_block_n": grid_block_n,
        }
    smallest = min(math.lcm(*tiles[:3]) for tiles in GROUPED_MATMUL_TILES)
    return f"embed={embed} and mlp={hidden} per device are not both multiples of {smallest}"


def topology(gpus: int) -> str:
    """The CUDA plugin's `slices x hosts x GPUs per host` for `gpus` H100s."""
    return f"1x{math.ceil(gpus / GPUS_PER_HOST)}x{min(gpus, GPUS_PER_HOST)}"


FAMILY = Family(
    name="gpu",
    pattern=r"gpu-h100-(\d+)",
    display="gpu-h100-N",
    # H100 SXM: 989 TFLOP/s dense bf16, 80 GB HBM3 (79.1 GiB as CUDA counts it), 8 GPUs per HGX host.
    chip=Chip(
        "NVIDIA H100 SXM",
        peak_bf16_flops=989e12,
        hbm_bytes=H100_SXM["device_memory_size"],
        devices_per_host=GPUS_PER_HOST,
        capabilities=frozenset({"host_offload", "int8", "fp8"}),
        hbm_bandwidth=H100_SXM["memory_bandwidth"],
        link_bandwidth=450e9,  # NVLink 4: 900 GB/s both ways, inside a host
        host_bandwidth=64e9,  # PCIe Gen5 x16
        network_bandwidth=50e9,  # across hosts: one 400 Gb/s InfiniBand NIC per GPU
    ),
    rules=(
        # NVLink inside a host is fast enough for FSDP's all-gathers; across hosts InfiniBand is not, so replicate.
        # Two 4k sequences per pass keep a 7-8B model's saved projections near 22 GiB of the 80.
        MeshRule(
            r"gpu-h100-[1-8]",
            {"fsdp": -1},
            why="fully sharded data parallel over one host's NVLink",
            microbatch=2,
        ),
        MeshRule(
            r"gpu-h100-\d+",
            {"data": -1, "fsdp": 8},
            why="data parallel across hosts, fsdp within each",
            microbatch=2,
        ),
    ),
    compute_dtype="bfloat16",
    attention="cudnn",
    kernels=("cudnn", "xla"),
    platform="cuda",
    # Latency-hiding scheduler overlaps FSDP's collectives with compute.
    xla_flags=("--xla_gpu_enable_latency_hiding_scheduler=true",),
    # 80 GiB holds every projection's output of a 7-8B model at 8k context; recomputing only the cheap
    # elementwise work costs about 5% of a step instead of the third that full remat costs.
    remat=Remat(policy="save_dots"),
    # Hopper's fp8 tensor cores run at twice the bf16 rate, and fp8 keeps more range than int8 for activations.
    quantize_dtype="fp8",
    topology=topology,
    # What the kernel takes is its entry in runtime/kernels.py (no int8 or fp8). XLA's GPU compiler rewrites ragged_dot
    # to a dense dot over every expert a device holds, rows masked. Measured on an H200 (jax 0.11.2, 8192 rows,
    # 4096 -> 14336, bench/quantized_experts.py): with 8 experts, fp8 by ragged_dot 9.41 ms forward against the
    # kernel's 1.80 in bf16; with one, 1.51 against 2.45.
    grouped_matmul=GroupedMatmul("mosaic_gpu", grouped_matmul_tiles, ragged_dot_dense=True),
    # XLA lowers jax.lax.ragged_all_to_all here: each token copy travels to its expert's device alone, with no
    # padding to a per-destination capacity.
    moe_all_to_all="ragged_all_to_all",
    # jax's allocator takes 75% of a GPU unless told otherwise: a Mixtral-width program that fit 74 GiB ran out of
    # memory at 60 (PLATFORM.md). 95% leaves 4 GiB to the CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers.
    memory_fraction=0.95,
)
