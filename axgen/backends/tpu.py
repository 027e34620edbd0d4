"""TPU targets `tpu-v5e-N`, `tpu-v5p-N`, `tpu-v6e-N`: N chips, bf16 compute, splash attention; `tpu-v5e-NxS` is
S slices of N chips."""

import functools
import math

from axgen.backends.common import GIB, Chip, Family, GroupedMatmul
from axgen.spec import MeshRule, Remat, SpecError

# Every generation has int8 MXU paths and host memory that XLA can offload to; none has fp8 matmuls.
CAPABILITIES = frozenset({"host_offload", "int8"})
# Published per-chip figures: dense bf16 FLOP/s, HBM size and bandwidth, inter-chip interconnect (ICI: 1,600,
# 4,800 and 3,584 Gbit/s). Host transfers assume one PCIe Gen4 x16 link (32 GB/s) shared by a host's 4 chips.
CHIPS = {
    "v5e": Chip(
        "TPU v5e",
        197e12,
        hbm_bytes=16 * GIB,
        devices_per_host=4,
        capabilities=CAPABILITIES,
        hbm_bandwidth=819e9,
        link_bandwidth=200e9,
        host_bandwidth=8e9,
    ),
    "v5p": Chip(
        "TPU v5p",
        459e12,
        hbm_bytes=95 * GIB,
        devices_per_host=4,
        capabilities=CAPABILITIES,
        hbm_bandwidth=2765e9,
        link_bandwidth=600e9,
        host_bandwidth=8e9,
    ),
    "v6e": Chip(
        "TPU v6e",
        918e12,
        hbm_bytes=32 * GIB,
        devices_per_host=4,
        capabilities=CAPABILITIES,
        hbm_bandwidth=1640e9,
        link_bandwidth=448e9,
        host_bandwidth=8e9,
    ),
}
# Default remat by HBM: 16 GiB v5e keeps attention projections only (the MLP's are the widest); the larger
# chips keep every projection.
REMAT = {
    "v5e": Remat(policy="save_dots_except_mlp"),
    "v5p": Remat(policy="save_dots"),
    "v6e": Remat(policy="save_dots"),
}

RULES = (
    # AXLearn's v5e recipe for 7B: weights and Adam moments fit 16 GiB only when sharded over all 256 chips, and
    # one 4k sequence per chip per pass, with every saved projection offloaded to host memory, leaves room for the
    # activations; the spec's batch is reached by accumulating passes.
    MeshRule(
        r"tpu-v5e-256(x\d+)?",
        {"fsdp": -1},
        why="fully sharded over the slice, projections offloaded to host, one sequence per chip per pass",
        remat=Remat(policy="offload_dots"),
        microbatch=1,
    ),
    # Slices meet over the data-centre network, a fraction of ICI's bandwidth: only data parallelism's one
    # gradient reduction per step crosses it (the slices multiply `data`).
    MeshRule(r"tpu-v\w+-\d+x\d+", {"fsdp": -1}, why="data across slices over DCN, fsdp within each slice"),
    # A 64-chip group holds a 70B model's 1.1 TB of weights and Adam moments at 18 GB per 95 GB chip, and keeps
    # FSDP's all-gathers among 64 chips; 64 is a product of the 8x8x8 and 8x8x16 tori's sides, as a mesh axis must
    # be (256 is not: fsdp=256 on v5p-512 does not compile).
    MeshRule(
        r"tpu-v5p-(512|1024)", {"data": -1, "fsdp": 64}, why="data across 64-chip cubes, fsdp within each"
    ),
    # On v5p a 7-8B model's weights and Adam moments take 1 GB per chip when fully sharded; two 8k sequences per
    # pass keep every saved projection (save_dots, 45 GB) in 95 GB of HBM, where four would need 110 GB.
    MeshRule(
        r"tpu-v5p-\d+", {"fsdp": -1}, why="fully sharded over the slice, two sequences per pass", microbatch=2
    ),
    # A 7-8B model's weights and optimizer state only fit 16-32 GiB chips when sharded over every chip.
    MeshRule(r"tpu-v.*", {"fsdp": -1}, why="fully sharded data parallel over every chip of the slice"),
)
# Let collectives run asynchronously and fuse FSDP's all-gathers with the matmuls that consume them (MaxText's
# flags for FSDP on v5e; v5p's compiler refuses the all-gather fusion, so other generations keep the defaults).
V5E_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
)


# megablox's grouped matmul tiles: rows, contraction, output columns. XLA's cost model for the compiled kernel puts
# megablox's gmm (tgmm for the weights' gradient) 7-11% under ragged_dot's own TPU kernel for Mixtral's and
# Qwen1.5-MoE's expert products, forward and backward, on v5e and v5p (optimal_seconds, deviceless compile).
GMM_ROWS = 512
GMM_COLUMNS = (1024, 512, 256, 128)


def grouped_matmul_tiles(embed: int, hidden: int) -> dict[str, int] | str:
    """megablox's tiles for experts of one device that map `embed` -> `hidden` -> `embed`: the widest column tile
    both widths are a multiple of (each is the contraction of one product and the output of the other)."""
    columns = next((t for t in GMM_COLUMNS if embed % t == hidden % t == 0), None)
    if columns is None:
        return f"embed={embed} and mlp={hidden} per device are not both multiples of {GMM_COLUMNS[-1]}"
    return {"tm": GMM_ROWS, "tk": columns, "tn": columns}


def topology(generation: str, chips: int) -> str:
    """libtpu's name for a slice of `chips` chips: a 2-D torus for v5e and v6e (`v5e:16x16`), 3-D for v5p
    (`v5p:4x4x8`), the shortest side doubled in turn, as Cloud TPU slices are shaped."""
    if chips & (chips - 1):
        raise SpecError(f"no TPU {generation} slice has {chips} chips (slices have a power of two)")
    if generation != "v5p":
        sides = [1, 1]
    else:
        sides = [2, 2, 1] if chips >= 4 else [chips, 1, 1]  # the smallest v5p slice is 2x2x1
    while math.prod(sides) < chips:
        smallest = min(sides)
        sides[max(i for i, side in enumerate(sides) if side == smallest)] *= 2
    return f"{generation}:{'x'.join(map(str, sides))}"


def topology_wrap(topology: str) -> tuple[bool, bool, bool]:
    """Which dimensions of a slice have wraparound links, as MaxText's accelerator_to_spec_map (and xpk) state them
    for libtpu: a v5p slice (as a v4 one) is a full 3-D torus once every side is at least 4 (it is then made of whole
    4x4x4 cubes, which the optical switches close into rings), a v5e or v6e side wraps at the pod's full 16 chips;
    smaller slices are meshes. Compiled without them, XLA plans collectives for a mesh the chips do not form.
    """
    generation, shape = topology.split(":")
    sides = [int(side) for side in shape.split("x")]
    if generation == "v5p":
        return (min(sides) >= 4,) * 3
    return (sides[0] == 16, sides[1] == 16, False)


def family(generation: str) -> Family:
    return Family(
        name="tpu",
        pattern=rf"tpu-{generation}-(\d+)(?:x(\d+))?",
        display=f"tpu-{generation}-N[xS]",
        chip=CHIPS[generation],
        rules=RULES,
        compute_dtype="bfloat16",
        # Pallas splash attention: blockwise and causal-aware, it skips the masked half of the blocks and never
        # holds a [seq, seq] score matrix.
        attention="splash",
        kernels=("splash", "xla"),
        platform="tpu",
        flags_variable="LIBTPU_INIT_ARGS",
        xla_flags=V5E_FLAGS if generation == "v5e" else (),
        remat=REMAT[generation],
        topology=functools.partial(topology, generation),
        topology_wrap=topology_wrap,
        # megablox.gmm takes no int8 or fp8 operands (runtime/kernels.py); XLA's TPU ragged_dot is a grouped matmul
        # kernel of its own that takes int8 with int32 accumulation (compiled deviceless for tpu-v5p-8; v5p and v5e
        # have no fp8 units, so it converts fp8 operands to bf16 first).
        grouped_matmul=GroupedMatmul("megablox_gmm", grouped_matmul_tiles),
        # Compiled both ways (docs/aot.md), every stack cast before the layers took 1.7 to 10.9 GiB a chip off the MoE
        # rows' per-layer peaks (Qwen3-235B-A22B on v5p-256: 67.22 -> 56.28) and up to 7.59 off the dense rows'
        # (Gemma 3 27B on v5p-128: 34.55 -> 26.96; Llama 3 70B on v5p-512: 48.41 -> 45.05), none rising by more than
        # 0.03, at the same eval peaks. Mixtral's buffer assignment shows one cause (docs/maxtext.md): per layer,
        # the backward scan converts each layer's expert gradients to float32 inside the loop and stacks them
        # there; the dense rows' gain was not traced.
        stack_cast="before_layers",
        # XLA lowers jax.lax.ragged_all_to_all here: each token copy travels to its expert's device alone, with no
        # padding to a per-destination capacity.
        moe_all_to_all="ragged_all_to_all",
    )


FAMILIES = tuple(family(g) for g in CHIPS)
