"""TPU targets `tpu-v5e-N`, `tpu-v5p-N`, `tpu-v6e-N`: N chips, bf16 compute, XLA attention."""

from axgen.backends.common import GIB, Chip, Family, MeshRule
from axgen.spec import Remat

# Every generation has int8 MXU paths and host memory that XLA can offload to; none has fp8 matmuls.
CAPABILITIES = frozenset({"host_offload", "int8"})
# Published per-chip figures: dense bf16 FLOP/s and HBM.
CHIPS = {
    "v5e": Chip("TPU v5e", 197e12, hbm_bytes=16 * GIB, devices_per_host=4, capabilities=CAPABILITIES),
    "v5p": Chip("TPU v5p", 459e12, hbm_bytes=95 * GIB, devices_per_host=4, capabilities=CAPABILITIES),
    "v6e": Chip("TPU v6e", 918e12, hbm_bytes=32 * GIB, devices_per_host=4, capabilities=CAPABILITIES),
}
# Default remat by HBM: 16 GiB v5e keeps attention projections only (the MLP's are the widest); the larger
# chips keep every projection.
REMAT = {
    "v5e": Remat(policy="save_dots_except_mlp"),
    "v5p": Remat(policy="save_dots"),
    "v6e": Remat(policy="save_dots"),
}

RULES = (
    # Past 256 chips one slice's ICI ends: data parallel across slices, FSDP within one.
    MeshRule(r"tpu-v5p-(512|1024|2048)", {"data": -1, "fsdp": 256}, why="data across slices, fsdp within"),
    # A 7-8B model's weights and optimizer state only fit 16 GiB chips when sharded over every chip.
    MeshRule(r"tpu-v.*", {"fsdp": -1}, why="fully sharded data parallel over every chip of the slice"),
)


def family(generation: str) -> Family:
    return Family(
        name="tpu",
        pattern=rf"tpu-{generation}-(\d+)",
        display=f"tpu-{generation}-N",
        chip=CHIPS[generation],
        rules=RULES,
        compute_dtype="bfloat16",
        attention="xla",
        remat=REMAT[generation],
    )


FAMILIES = tuple(family(g) for g in CHIPS)
