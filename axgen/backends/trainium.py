"""AWS Trainium2 targets `trn2-N`: N chips, 16 per trn2.48xlarge host, bf16 compute, XLA attention.

No Neuron compiler is reachable from here: these programs are proven on CPU with the trn2 mesh on fake devices.
"""

from axgen.backends.common import GIB, Chip, Family
from axgen.spec import MeshRule, Remat

FAMILY = Family(
    name="trainium",
    pattern=r"trn2-(\d+)",
    display="trn2-N",
    # Trainium2: ~667 TFLOP/s dense bf16 and 96 GiB HBM per chip.
    # fp8 matmuls run at twice the bf16 rate; there is no int8 path.
    chip=Chip(
        "AWS Trainium2",
        peak_bf16_flops=667e12,
        hbm_bytes=96 * GIB,
        devices_per_host=16,
        capabilities=frozenset({"fp8"}),
        hbm_bandwidth=2.9e12,
        link_bandwidth=640e9,  # NeuronLink-v3: 1.28 TB/s per chip, both ways
        host_bandwidth=32e9,  # PCIe Gen5 x8 (assumed)
    ),
    rules=(
        # Tensor parallelism over 4 chips keeps its all-reduces on the fastest NeuronLink ring; fsdp across. Each
        # group of 4 runs one batch, so two sequences per pass give each chip a quarter of 2 sequences' work.
        MeshRule(
            r"trn2-\d+",
            {"fsdp": -1, "model": 4},
            why="model=4 inside a chip group, fsdp across",
            microbatch=2,
        ),
    ),
    compute_dtype="bfloat16",
    attention="xla",
    platform="neuron",
    # 96 GiB per chip, like H100's 80: keep every projection's output.
    remat=Remat(policy="save_dots"),
    quantize_dtype="fp8",
)
