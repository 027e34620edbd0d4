"""CPU targets `cpu-N`: N host devices (fake ones on one machine), XLA kernels, float32 compute.

float32 because these AVX2 CPUs have no fast bf16 path: MaxText's bf16 steps ran ~1.5x slower than fp32 here.
"""

from axgen.backends.common import GIB, Chip, Family
from axgen.spec import MeshRule

FAMILY = Family(
    name="cpu",
    pattern=r"cpu-(\d+)",
    display="cpu-N",
    # Nominal: one AVX2 core of a 24 GiB host (this project's CI machine), 2 FMA units x 8 float32 lanes x 2 FLOPs
    # x ~3 GHz.
    # XLA's CPU backend has a native int8 dot with int32 accumulation; fp8 and host offload it does not have.
    chip=Chip(
        "host CPU core",
        peak_bf16_flops=96e9,
        hbm_bytes=24 * GIB,
        devices_per_host=1024,
        capabilities=frozenset({"int8"}),
        published_peak=False,  # peak_bf16_flops is an estimate for plans, not a rate anyone published
        # Fake devices share the host's memory: one core's share of a server's DRAM bandwidth, and copies.
        hbm_bandwidth=20e9,
        link_bandwidth=10e9,
        host_bandwidth=20e9,
        shares_host_memory=True,  # cpu-8 is one 24 GiB host's cores: 3 GiB a device
    ),
    # Sharded CPU programs take at most 4 sequences per device per pass: XLA's CPU compiler dies (SIGFPE) on a
    # 7B model's 64 x 8k-token pass, and a pass that large has no use on a CPU.
    rules=(
        MeshRule(
            r"cpu-8",
            {"data": 2, "fsdp": 2, "model": 2},
            why="every mesh axis at size 2, so CPU runs exercise the sharding that accelerator targets use",
            microbatch=4,
        ),
        MeshRule(r"cpu-1", {}, why="one device: the unsharded reference run"),
        MeshRule(
            r"cpu-\d+", {"fsdp": -1}, why="fully sharded data parallel over all host devices", microbatch=4
        ),
    ),
    # Every cpu-N program shows jax N devices, whichever rule (a spec's, or `axgen plan`'s candidate) gave the mesh.
    device_count_flag="--xla_force_host_platform_device_count={}",
    compute_dtype="float32",
    attention="xla",
    platform="cpu",
)
