"""Target rules: which mesh, kernels and modifiers a target name gets. Backends list their own; a spec may list
rules tried before them (`Model.mesh_rules`)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from axgen.spec.feature_configs import QUANTIZE_DTYPES, Remat
from axgen.spec.validation import SpecNode, suggest

# Outermost first: `model` is innermost so its collectives use the fastest links between neighbouring devices, and
# `context` (each sequence split into shards, runtime/context.py) next to it: every layer gathers keys and values
# over it. `stage` (pipeline stages, runtime/stages.py) is outer, after `data`: a stage hands one microbatch's
# activations to the next, the fewest bytes of any split, so its links may be the slowest (between hosts).
MESH_AXES = ("data", "stage", "fsdp", "expert", "context", "model")
ATTENTION_KERNELS = ("xla", "splash", "cudnn")
# How a dropless MoE with its experts split over devices moves token copies: every token of the expert group to
# every device (all_gather), or each copy only to its expert's device and back (all_to_all: the backend picks the
# collective, ragged where the chip's compiler has one).
MOE_DISPATCHES = ("all_gather", "all_to_all")
# How a pass's microbatches go through pipeline stages (runtime/stages.py): every forward then every backward, once
# round the stages (GPipe) or several times (circular); or each microbatch's backward as soon as its forward has
# left the last stage (1F1B).
PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b")
# When each stacked block's params (stored float32) become the compute dtype, and why that way (MeshRule.stack_cast).
STACK_CASTS = {
    "per_layer": (
        "each layer casts its own params inside the scan, where it runs: no second copy of the stack is held"
    ),
    "before_layers": (
        "each stack is cast whole before the layers: a copy of it is held while they run, and the backward scan "
        "keeps the stack's gradients in the compute dtype until it ends"
    ),
}
COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class MeshRule(SpecNode):
    """A regex over target names -> a mesh over `data, stage, fsdp, expert, context, model` (-1: the devices left
    over) and the modifiers that go with it; a modifier left None keeps the backend's choice. Each backend tries
    its rules in order and the first match wins; a spec's `Model.mesh_rules` are tried before the backend's. On a
    multi-slice target (`tpu-v5e-256x2`) the mesh is one slice's and the slices multiply `data`.

    `microbatch` is the sequences each device runs per forward and backward pass: a step whose per-device batch
    is larger accumulates gradients over `per-device batch / microbatch` passes. With pipeline stages (`stage` >
    1), each pass goes through the stages as `pipeline_microbatches` microbatches in turn (default: `microbatch`,
    one sequence per device each); each stage keeps every microbatch's input until the backward pass.
    `pipeline_repeats` cuts the layers into stages x repeats runs, stage s holding runs s, s + stages, ..., and
    sends each microbatch round the stages that many times (the circular schedule; default 1: GPipe, one run of
    consecutive layers a stage); the stages idle (stages - 1) / (repeats x pipeline_microbatches + stages - 1) of a
    pass (with at least as many microbatches as stages), and a stage keeps repeats times as many inputs, each of a
    run repeats times shorter. `pipeline_schedule` (PIPELINE_SCHEDULES; default circular where pipeline_repeats
    is over 1, else GPipe) "1f1b" runs each microbatch's backward as soon as its forward has left the last stage,
    the output head and the loss being the last stage's: a stage keeps at most 2 stages - 1 microbatches'
    residuals, whatever the pass's microbatches, and no layer's forward runs twice; the bubble is GPipe's.
    `attention_block` is the query and key/value block length of the splash attention
    kernel. `memory_fraction` is the share of each device's memory the program's allocator takes (GPU), and what
    `axgen aot` checks the peak against. `moe_dispatch` is how a dropless MoE whose experts are split over devices
    moves its token copies (MOE_DISPATCHES).
    `moe_receive_capacity` bounds the all_to_all dispatch: each device takes at most that factor of its even share
    of token copies from each device of its expert group (1.0: the share perfectly balanced routing sends), and
    the copies beyond it are dropped, later choices first, and counted (`dropped_fraction`); unset, a device has
    room for every copy of its group (expert x its share), which DeepSeek-V3 at expert=64 cannot hold.
    `shard_residual` splits the residual stream between the layers, [batch, seq, embed], over the `model` axis too
    (MaxText's `activation_embed` over its tensor axis; Megatron's sequence parallelism splits the same tensor by
    position): each layer's input, which full remat keeps, is model times smaller. Inside each layer XLA gathers it
    over the model axis, and reduce-scatters the layer's output where it would otherwise all-reduce it (a host's
    NVLink on an H100 box). Refused on a mesh without a model axis, and where two mesh axes split the batch, which
    XLA miscompiles (backends/common.residual_refused).
    `stack_cast` is when the stacked layers' params become the compute dtype (STACK_CASTS). The default is per
    layer, but before the layers on TPU: compiled both ways, a cast before the layers took 1.7 to 10.9 GiB a chip
    off the TPU MoE rows and up to 7.6 off the dense ones, and left the GPU rows within 0.9 GiB while their eval
    steps held a bf16 copy of the model (docs/aot.md)."""

    pattern: str
    mesh: dict[str, int]
    _: dataclasses.KW_ONLY
    why: str
    compute_dtype: str | None = None
    attention: str | None = None
    attention_block: int | None = None
    microbatch: int | None = None
    pipeline_microbatches: int | None = None
    pipeline_repeats: int | None = None
    pipeline_schedule: str | None = None
    remat: Remat | None = None
    quantize_dtype: str | None = None
    memory_fraction: float | None = None
    moe_dispatch: str | None = None
    moe_receive_capacity: float | None = None
    shard_residual: bool | None = None
    stack_cast: str | None = None
    xla_flags: tuple[str, ...] = ()

    def validate(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as err:
            self.fail("pattern", f"is not a regular expression ({err})")
        for axis, size in self.mesh.items():
            if axis not in MESH_AXES:
                self.fail(
                    "mesh", f"has axis {axis!r}, not one of {', '.join(MESH_AXES)}{suggest(axis, MESH_AXES)}"
                )
            if size < 1 and size != -1:
                self.fail("mesh", f"gives {axis}={size}; sizes are >= 1, or -1 for the devices left over")
        if list(self.mesh.values()).count(-1) > 1:
            self.fail("mesh", "has more than one -1 axis")
        for name, known in (
            ("compute_dtype", COMPUTE_DTYPES),
            ("attention", ATTENTION_KERNELS),
            ("quantize_dtype", QUANTIZE_DTYPES),
            ("moe_dispatch", MOE_DISPATCHES),
            ("pipeline_schedule", PIPELINE_SCHEDULES),
            ("stack_cast", STACK_CASTS),
        ):
            value = getattr(self, name)
            if value is not None and value not in known:
                self.fail(name, f"is not one of {', '.join(known)}{suggest(value, known)}")
        for name in ("attention_block", "microbatch", "pipeline_microbatches", "pipeline_repeats"):
            if getattr(self, name) is not None:
                self.require_positive(name)
        if self.moe_receive_capacity is not None:
            if self.moe_receive_capacity <= 0:
                self.fail(
                    "moe_receive_capacity", "must be > 0 (a factor of a device's even share of token copies)"
                )
            if self.moe_dispatch != "all_to_all":
                self.fail(
                    "moe_receive_capacity",
                    "bounds the all-to-all dispatch; the rule needs moe_dispatch='all_to_all' with it",
                )
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            self.fail("memory_fraction", "is not in (0, 1]")
        if self.attention_block is not None and self.attention_block % 128:
            self.fail("attention_block", "must be a multiple of 128 (the TPU lane width)")

    def matches(self, target: str) -> bool:
        return re.fullmatch(self.pattern, target) is not None

    @property
    def provenance(self) -> str:
        """`backends/gpu.py: mesh rule 'gpu-h100-[1-8]'`: a rule is named by its pattern, which stays when lines
        around it move."""
        return self.origin.provenance(f"mesh rule '{self.pattern}'")
