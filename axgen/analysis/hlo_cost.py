"""What one step of a compiled program costs on each device, read off XLA's optimized HLO text: the FLOPs of its
dots, the bytes its top-level instructions move to and from device memory, and the bytes each kind of collective
moves. Every computation counts as many times as it runs: a while loop's body (a scan over layers or
microbatches) by its known trip count, a fusion's or call's body once per call. XLA's own cost analysis counts a
loop's body once, and gives nothing at all on GPU.

Kernels XLA did not write (Pallas, cuDNN, Mosaic GPU custom calls) and ragged dots (MoE experts) are opaque here:
their FLOPs are not in the dots, and the caller adds them from the model (`axgen/analysis/plan.py`).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import networkx as nx
import numpy as np

COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
)
BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}
BYTES |= {"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# Instructions that move no data of their own: views, tuples, control flow whose bodies are counted themselves.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional"}
_FREE |= {"after-all", "partition-id", "replica-id", "iota", "opt-barrier", "copy-done", "add-dependency"}

_HOST = ":S(5)"  # the memory space of pinned host memory in a layout: `bf16[8,128]{1,0:S(5)}`
_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = (.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_CALLED = re.compile(
    r"\b(calls|body|condition|to_apply|branch_computations)=\{?(%[^,}\s]+(?:, %[^,}\s]+)*)\}?"
)
_CROSS_SLICE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GEMM = re.compile(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)[^"]*"')
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
# The devices each collective's groups hold, in XLA's three spellings: listed (`{{0,8},{1,9}}`), an iota reshaped
# and transposed (`[2,8]<=[8,2]T(1,0)`), or the axes of a mesh whose devices are an iota in its order
# (`mesh['fsdp'=128,'model'=8] {'fsdp'}`); a collective permute's (source, target) pairs.
_LISTED = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


@dataclass(frozen=True)
class Instruction:
    name: str
    root: bool
    shape: str  # the result's type: an array `bf16[8,128]{1,0}` or a tuple `(s32[], f32[8]{0})`
    op: str
    operands: tuple[str, ...]
    arguments: str  # the text between the op's parentheses: operands, or a constant's value
    attributes: str

    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        return [
            (dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(self.shape)
        ]


@dataclass(frozen=True)
class HloCost:
    dot_flops: float  # per device per step
    memory_bytes: float  # read and written by top-level instructions
    host_bytes: float  # written to or read from pinned host memory (offloaded activations)
    collective_bytes: dict[str, float]  # kind -> bytes of the results (all-reduce: twice, as a ring sends it)
    # Between TPU slices (multi-slice programs): transfers per step by kind, and the bytes they send. libtpu
    # compiles each slice's program apart and writes these as host transfers to its DCN runtime ("megascale").
    cross_slice: dict[str, float]
    cross_slice_bytes: float
    # Of collective_bytes, what collectives whose groups span hosts move (given devices_per_host; else empty).
    cross_host_bytes: dict[str, float]


def hlo_cost(text: str, devices_per_host: int | None = None) -> HloCost:
    """The step's cost; with `devices_per_host`, also which collectives cross hosts, device d being on host
    d // devices_per_host (as jax numbers a GPU topology's devices)."""
    computations, entry = _computations(text)
    shapes = {i.name: i for body in computations.values() for i in body}
    runs = _runs(computations, entry)
    fused = {
        c for body in computations.values() for i in body if i.op.startswith("fusion") for c in _callees(i)
    }
    flops = memory = host = cross_slice_bytes = 0.0
    collectives: dict[str, float] = defaultdict(float)
    cross_slice: dict[str, float] = defaultdict(float)
    cross_host: dict[str, float] = defaultdict(float)
    for name, body in computations.items():
        for instruction in body:
            times = runs.get(name, 0)
            if instruction.op == "dot":
                flops += times * _dot_flops(instruction, shapes)
            elif instruction.op == "convolution":  # how TPU programs spell their matmuls
                flops += times * _convolution_flops(instruction, shapes)
            elif instruction.op == "custom-call" and _GEMM.search(instruction.attributes):  # cuBLAS on GPU
                flops += times * _gemm_flops(instruction, shapes)
            kind = _collective(instruction.op)
            between_slices = _CROSS_SLICE.search(instruction.attributes) if instruction.op == "send" else None
            if between_slices:
                cross_slice[between_slices[1]] += times
                cross_slice_bytes += times * _largest(instruction)
            if kind:
                moved = times * _collective_bytes(kind, instruction, shapes)
                collectives[kind] += moved
                if devices_per_host and _spans_hosts(device_groups(instruction.attributes), devices_per_host):
                    cross_host[kind] += moved
            elif name not in fused and instruction.op not in _FREE and not instruction.op.endswith("-done"):
                operands = [shapes[o] for o in instruction.operands if o in shapes]
                moved = _moved(instruction, operands, computations)
                to_host = any(_HOST in i.shape for i in (instruction, *operands))
                host += times * moved if to_host else 0
                memory += 0 if to_host else times * moved
    return HloCost(
        flops,
        memory,
        host,
        dict(sorted(collectives.items())),
        dict(sorted(cross_slice.items())),
        cross_slice_bytes,
        dict(sorted(cross_host.items())) if devices_per_host else {},
    )


def device_groups(attributes: str) -> list[list[int]] | None:
    """The devices of each group a collective runs over (a permute: each source with its target); None where its
    attributes name none (every device, one group)."""
    if match := _LISTED.search(attributes):
        groups = [[int(d) for d in group.split(",") if d] for group in re.findall(r"\{([\d,]*)\}", match[1])]
        return groups or None  # `{}`: one group of every device
    if match := _PAIRS.search(attributes):
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", match[1])]
    if match := _IOTA.search(attributes):
        shape, dims = [int(n) for n in match[1].split(",")], [int(n) for n in match[2].split(",")]
        iota = np.arange(math.prod(dims)).reshape(dims)
        if match[3]:
            iota = iota.transpose([int(n) for n in match[3].split(",")])
        return iota.reshape(shape).tolist()
    if match := _MESH.search(attributes):
        axes = re.findall(r"'(\w+)'=(\d+)", match[1])
        names, sizes = [name for name, _ in axes], [int(size) for _, size in axes]
        grouped = [names.index(name) for name in re.findall(r"'(\w+)'", match[2])]
        others = [i for i in range(len(names)) if i not in grouped]
        iota = np.arange(math.prod(sizes)).reshape(sizes).transpose(others + grouped)
        return iota.reshape(-1, math.prod(sizes[i] for i in grouped)).tolist()
    return None


def _spans_hosts(groups: list[list[int]] | None, devices_per_host: int) -> bool:
    """Whether a collective's groups hold devices of more than one host (None: every device, which does when
    there is more than one host; a caller with one host passes no devices_per_host)."""
    if groups is None:
        return True
    return any(len({device // devices_per_host for device in group}) > 1 for group in groups)


def _computations(text: str) -> tuple[dict[str, list[Instruction]], str]:
    computations: dict[str, list[Instruction]] = {}
    entry = current = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header[2]
            computations[current] = []
            entry = current if header[1] else entry
        elif current is not None and (match := _INSTRUCTION.match(line)):
            computations[current].append(_instruction(match[2], match[3], root=bool(match[1])))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _instruction(name: str, rest: str, root: bool) -> Instruction:
    """`bf16[8,128]{1,0} dot(%a, %b), lhs_contracting_dims={1}, ...` -> its parts."""
    if rest.startswith("("):
        depth = 0
        for end, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op, _, rest = rest.partition("(")
    depth, end = 1, 0
    for end, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            break
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[:end]))
    return Instruction(name, root, shape, op, operands, rest[:end], rest[end + 1 :])


def _moved(instruction: Instruction, operands: list[Instruction], computations: dict) -> float:
    """Bytes read and written. An update of a slice in place (a scan writing one layer's slice of a stacked
    buffer) reads and writes the slice, not the buffer; a fusion that slices its operands (a scan reading one
    layer's slice) reads no more of each than it writes; an async start's result repeats its operands."""
    body = computations.get(next(iter(_callees(instruction)), ""), [])
    root = next((i.op for i in body if i.root), None)
    if "dynamic-update-slice" in (instruction.op, root):
        buffer = max((_bytes(o) for o in operands), default=0)
        return 2 * (sum(_bytes(o) for o in operands) - buffer)
    result = _largest(instruction) if instruction.op.endswith("-start") else _bytes(instruction)
    if any(i.op == "dynamic-slice" for i in body):
        return result + sum(min(_bytes(o), _largest(instruction)) for o in operands)
    return result + sum(_bytes(o) for o in operands)


def _callees(instruction: Instruction) -> list[str]:
    return [c.lstrip("%") for _, names in _CALLED.findall(instruction.attributes) for c in names.split(", ")]


def _runs(computations: dict[str, list[Instruction]], entry: str) -> dict[str, float]:
    """How many times each computation runs per call of the entry: the sum over its callers of the caller's runs
    times the loop's trip count (1 for anything but a while body or condition)."""
    calls = nx.MultiDiGraph()
    calls.add_nodes_from(computations)
    for name, body in computations.items():
        for instruction in body:
            trips = _trip_count(instruction, computations) if instruction.op == "while" else 1
            for kind, names in _CALLED.findall(instruction.attributes):
                times = trips if kind in ("body", "condition") else 1
                for callee in names.split(", "):
                    calls.add_edge(name, callee.lstrip("%"), times=times)
    runs = {entry: 1.0}
    for name in nx.topological_sort(calls):
        for _, callee, edge in calls.out_edges(name, data=True):
            runs[callee] = runs.get(callee, 0.0) + runs.get(name, 0.0) * edge["times"]
    return runs


def _trip_count(loop: Instruction, computations: dict[str, list[Instruction]]) -> int:
    """XLA's known trip count where it wrote one (CPU, GPU); else the bound of the condition's `i < N` (TPU), as
    jax's scans count from 0 by 1; else 1."""
    known = _TRIP_COUNT.search(loop.attributes)
    if known:
        return int(known[1])
    condition = re.search(r"condition=%([^,\s]+)", loop.attributes)[1]
    bounds = [
        int(i.arguments)
        for i in computations.get(condition, [])
        if i.op == "constant" and i.shape.startswith("s32[]") and i.arguments.isdigit()
    ]
    return bounds[0] if len(bounds) == 1 else 1


def _dot_flops(dot: Instruction, shapes: dict[str, Instruction]) -> float:
    """2 x every output element x the length of the contraction."""
    [(_, out)] = dot.arrays()
    lhs = shapes[dot.operands[0]].arrays()[0][1]
    contracting = _CONTRACTING.search(dot.attributes)
    contracted = [lhs[int(d)] for d in contracting[1].split(",") if d] if contracting else []
    return 2.0 * math.prod(out) * math.prod(contracted)


def _gemm_flops(gemm: Instruction, shapes: dict[str, Instruction]) -> float:
    """A cuBLAS gemm's result (the first of its outputs; the second is scratch) x its contraction."""
    out = gemm.arrays()[0][1]
    lhs = shapes[gemm.operands[0]].arrays()[0][1]
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', gemm.attributes)
    return 2.0 * math.prod(out) * math.prod(lhs[int(d.strip('"'))] for d in contracting[1].split(",") if d)


def _convolution_flops(convolution: Instruction, shapes: dict[str, Instruction]) -> float:
    """2 x every output element x the input features and window taps it sums over. TPU programs spell matmuls
    as convolutions, some with heads as a padded window of which only the taps inside the input count."""
    [(_, out)] = convolution.arrays()
    lhs, kernel = (shapes[name].arrays()[0][1] for name in convolution.operands[:2])
    lhs_labels, kernel_labels, out_labels = _DIM_LABELS.search(convolution.attributes).groups()
    window = _window(convolution.attributes)
    taps = 1.0
    for d, label in enumerate(sorted(c for c in kernel_labels if c.isdigit())):
        size, pad, stride, lhs_dilation, rhs_dilation = (w[d] for w in window) if window else (1, 0, 1, 1, 1)
        n_in, n_out = lhs[lhs_labels.index(label)], out[out_labels.index(label)]
        taps *= _mean_taps(
            n_in, n_out, kernel[kernel_labels.index(label)], pad, stride, lhs_dilation, rhs_dilation
        )
    return 2.0 * math.prod(out) * kernel[kernel_labels.index("i")] * taps


def _window(attributes: str) -> list[list[int]] | None:
    """Per spatial dimension: size, low padding, stride, lhs and rhs dilation."""
    window = re.search(r"window=\{([^}]*)\}", attributes)
    if window is None:
        return None
    fields = dict(part.split("=") for part in window[1].split())
    n = len(fields["size"].split("x"))

    def per_dim(name: str, default: int, first=lambda v: v) -> list[int]:
        return [int(first(v)) for v in fields[name].split("x")] if name in fields else [default] * n

    return [
        per_dim("size", 1),
        per_dim("pad", 0, lambda v: v.split("_")[0]),
        per_dim("stride", 1),
        per_dim("lhs_dilate", 1),
        per_dim("rhs_dilate", 1),
    ]


def _mean_taps(n_in: int, n_out: int, size: int, pad: int, stride: int, lhs_dilation: int, rhs_dilation: int):
    """The mean number of window taps per output position that land on the input, not on padding or holes."""
    if n_out * size > 1_000_000:
        return float(size)
    last = (n_in - 1) * lhs_dilation
    valid = sum(
        1
        for p in range(n_out)
        for k in range(size)
        if 0 <= (x := p * stride + k * rhs_dilation - pad) <= last and x % lhs_dilation == 0
    )
    return valid / n_out


def _collective(op: str) -> str | None:
    base = op.removesuffix("-start")
    return base if base in COLLECTIVES else None


def _collective_bytes(kind: str, instruction: Instruction, shapes: dict[str, Instruction]) -> float:
    """The bytes a collective moves per device: its result (all-reduce: twice, as a ring sends it). A
    ragged-all-to-all's result is its receive buffer, sized for the worst case (every device sending it all its
    rows), and how much of it is filled depends on the routing: count what the device can send at most, its
    first operand."""
    if kind == "ragged-all-to-all" and instruction.operands and instruction.operands[0] in shapes:
        return _bytes(shapes[instruction.operands[0]])
    return _largest(instruction) * (2 if kind == "all-reduce" else 1)


def _largest(instruction: Instruction) -> float:
    """An async collective's start returns (operands, results, ...): the largest array is what moved."""
    return max((_array_bytes(dtype, dims) for dtype, dims in instruction.arrays()), default=0)


def _bytes(instruction: Instruction) -> float:
    return sum(_array_bytes(dtype, dims) for dtype, dims in instruction.arrays())


def _array_bytes(dtype: str, dims: tuple[int, ...]) -> float:
    return BYTES.get(dtype, 4) * math.prod(dims)
