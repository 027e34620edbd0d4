"""Ahead-of-time compilation of an emitted program's `train_step` for its target, without the target's chips.

TPU programs compile for libtpu's description of the slice (`jax.experimental.topologies`), H100 programs for
the CUDA plugin's, described by the published facts in backends/gpu.py; Trainium and CPU programs compile on fake
CPU devices with the target's mesh. Each compile runs in a process of its own (`python -m axgen.analysis.aot`), because
the platform, the flags and the number of fake devices are fixed once jax starts.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from axgen.backends import Plan, plan_for
from axgen.backends.common import GIB
from axgen.build import build, output_name
from axgen.analysis.hlo_cost import COLLECTIVES, hlo_cost
from axgen.loader import load_spec
from axgen.runtime.kernels import ATTENTION_KERNELS, GROUPED_MATMUL_KERNELS
from axgen.runtime.stages import bubble
from axgen.spec import MeshRule, Remat, display_path

_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception): .*)$", re.MULTILINE)
# Whole op names: all-to-all( inside ragged-all-to-all( is not one.
_COLLECTIVE = re.compile(r"(?<![\w-])(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
# Kernels the compiler did not write itself: those of runtime/kernels.py's table (Pallas: tpu_custom_call,
# mosaic_gpu; cuDNN), and cuBLAS, which XLA's GPU dots call.
_CUSTOM_CALL = re.compile(
    'custom_call_target="('
    + "|".join(
        sorted(
            {
                k.custom_call
                for k in (*ATTENTION_KERNELS.values(), *GROUPED_MATMUL_KERNELS.values())
                if k.custom_call
            }
            | {'__cublas[^"]*'}
        )
    )
    + ')"'
)


class AotError(RuntimeError):
    """A compile that failed for a reason other than memory: one line, naming the target."""


@dataclasses.dataclass(frozen=True)
class Report:
    spec: str
    target: str
    compiled_for: str  # what stood in for the chips
    mesh: dict[str, int]
    grad_accum_steps: int
    microbatch: int
    compile_seconds: float
    hbm_bytes: int  # per device
    usable_bytes: int  # per device: what the program's allocator takes, which the peak must fit
    fits: bool
    peak_bytes: int | None  # per device; None when the compiler stopped at its own out-of-memory check
    argument_bytes: int | None = None
    output_bytes: int | None = None
    alias_bytes: int | None = None
    temp_bytes: int | None = None
    host_bytes: int | None = None  # offloaded to pinned host memory
    flops_per_device: float | None = None  # per step, analytic
    xla_flops_per_device: float | None = None  # as XLA reports them: each scan body counted once
    # Per device per step from the optimized HLO, every loop body counted as often as it runs (hlo_cost.py).
    dot_flops: float | None = None
    memory_bytes: float | None = None
    host_transfer_bytes: float | None = None
    collective_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    cross_slice: dict[str, float] = dataclasses.field(
        default_factory=dict
    )  # transfers per step over DCN, by kind
    cross_slice_bytes: float | None = None
    # Of collective_bytes, what collectives spanning hosts move, where the chip's fast links end at the host.
    cross_host_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    kernels: dict[str, int] = dataclasses.field(default_factory=dict)  # custom calls: Pallas, cuDNN, ...
    out_of_memory: str | None = None  # the compiler's own message when it refused
    # The eval step's (--eval-every) at the same batch, which the program checks before training as it does the
    # train step's; None where the train step did not compile.
    eval_peak_bytes: int | None = None
    pipeline_microbatches: int | None = None  # each pass's, through the pipeline stages; None without stages
    pipeline_repeats: int = 1  # rounds of the stages each microbatch takes (circular schedule)
    pipeline_schedule: str | None = None  # PIPELINE_SCHEDULES; None without stages

    @property
    def bubble(self) -> float | None:
        """The share of a step each pipeline stage idles; None without stages."""
        stages = self.mesh.get("stage", 1)
        return bubble(stages, self.pipeline_microbatches, self.pipeline_repeats) if stages > 1 else None

    def text(self) -> str:
        mesh = " ".join(f"{axis}={size}" for axis, size in self.mesh.items())
        lines = [
            f"{self.spec} on {self.target}: compiled for {self.compiled_for} in {self.compile_seconds:.1f}s",
            f"  mesh {mesh}; per device, {self.grad_accum_steps} x {self.microbatch} sequences (microbatches x size)",
        ]
        if self.bubble is not None:
            schedule = {
                "gpipe": "GPipe",
                "1f1b": "1F1B",
                "circular": f"circular ({self.pipeline_repeats} rounds)",
            }[self.pipeline_schedule or ("circular" if self.pipeline_repeats > 1 else "gpipe")]
            lines.append(
                f"  pipeline: {self.mesh['stage']} stages, {schedule} over each pass's {self.pipeline_microbatches} "
                f"microbatches: each stage idles {self.bubble:.1%} of the step (the bubble); every device runs one "
                "stage, so the peak below is each stage's"
            )
        hbm = (
            f"{self.usable_bytes / GIB:.1f} GiB usable ({self.usable_bytes / self.hbm_bytes:.0%} of "
            f"{self.hbm_bytes / GIB:.1f} GiB HBM)"
            if self.usable_bytes != self.hbm_bytes
            else f"{self.hbm_bytes / GIB:.1f} GiB HBM"
        )
        if self.peak_bytes is None:
            lines.append(f"  does not fit {hbm}: {self.out_of_memory}")
            return "\n".join(lines)
        lines.append(
            f"  per device: arguments {_gib(self.argument_bytes)}, outputs {_gib(self.output_bytes)} "
            f"(aliased {_gib(self.alias_bytes)}), temporaries {_gib(self.temp_bytes)}; peak {_gib(self.peak_bytes)} "
            f"of {hbm}: {'fits' if self.fits else 'DOES NOT FIT'}"
        )
        lines.append(
            f"  evaluation (--eval-every), same batch in the same microbatches: peak {_gib(self.eval_peak_bytes)}: "
            f"{'fits' if self.eval_peak_bytes <= self.usable_bytes else 'DOES NOT FIT'}"
        )
        if self.host_bytes:
            lines.append(f"  offloaded to host memory: {_gib(self.host_bytes)}")
        xla = (
            f"; XLA reports {self.xla_flops_per_device:.3g}, counting each scan body (layers, microbatches) once"
            if self.xla_flops_per_device
            else "; XLA gives no FLOP count for this platform"
        )
        lines.append(
            f"  FLOPs per device per step: {self.flops_per_device:.3g} analytic (6 x weights + attention){xla}"
        )
        if self.cross_slice:
            transfers = ", ".join(f"{kind.lower()} {count:g}" for kind, count in self.cross_slice.items())
            lines.append(
                f"  between slices (DCN), per step: {transfers}; {self.cross_slice_bytes / 2**20:.1f} MiB sent"
            )
        if self.cross_host_bytes:
            moved = ", ".join(f"{kind} {n / 1e9:.3g} GB" for kind, n in self.cross_host_bytes.items())
            lines.append(f"  collectives across hosts, per device per step: {moved}")
        for what, counts in (("collectives", self.collectives), ("custom-call kernels", self.kernels)):
            found = ", ".join(f"{name} {count}" for name, count in counts.items()) or "none"
            lines.append(f"  {what} in the optimized HLO: {found}")
        return "\n".join(lines)


def _gib(n: int | None) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 1024**2:.1f} MiB"


def compile_target(
    spec_path: str | Path,
    target: str,
    timeout: float | None = None,
    rule: dict | None = None,
    phase: Callable[[str], None] = lambda name: None,
    dump_to: Path | None = None,
) -> Report:
    """Builds the program, then compiles its train_step in a fresh process set up for the target. A `rule`
    (`candidate_rule`'s fields) goes before the spec's own mesh rules. `phase` hears which step is under way
    (a progress bar's caption). With `dump_to`, XLA writes its dumps of the train and eval steps there
    (`_dump_flags`)."""
    phase("building")
    built = build(spec_path, target, candidate_rule(target, rule) if rule else None)
    phase("compiling")
    with tempfile.TemporaryDirectory(prefix="axgen-aot-") as tmp:
        program = Path(tmp) / output_name(target)
        program.write_text(built.source)
        command = [
            sys.executable,
            "-m",
            "axgen.analysis.aot",
            str(program),
            str(spec_path),
            target,
            json.dumps(rule),
        ]
        try:
            result = subprocess.run(
                command,
                env=_environment(built.plan, dump_to),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise AotError(f"{target}: the compile took longer than {timeout:.0f}s") from None
    if result.returncode != 0:
        exit = (
            f"killed by {signal.Signals(-result.returncode).name}" if result.returncode < 0 else "no message"
        )
        errors = _ERROR_LINE.findall(result.stderr) or [
            f"the compiler process exited {result.returncode} ({exit})"
        ]
        raise AotError(f"{display_path(str(spec_path))} on {target}: the compile failed: {errors[-1]}")
    return Report(**json.loads(result.stdout.splitlines()[-1]))


def candidate_rule(target: str, fields: dict) -> MeshRule:
    """A mesh rule for exactly `target` from plain fields: mesh, microbatch, remat (a policy name),
    attention_block, and the modifiers of the rule it stands in for (plan.KEPT_MODIFIERS); what `axgen plan`
    tries, and writes into the spec."""
    modifiers = {k: v for k, v in fields.items() if k not in ("mesh", "why")}
    if modifiers.get("remat"):
        modifiers["remat"] = Remat(policy=modifiers["remat"])
    return MeshRule(target, fields["mesh"], why=fields.get("why", "a candidate of axgen plan"), **modifiers)


def _dump_flags(directory: Path) -> list[str]:
    """XLA's dumps of the train and eval steps into `directory`, as text: each step's HLO before and after
    optimization, its buffer assignment, live ranges and memory-usage report (`bench/maxtext/buffers.py` reads
    them)."""
    return [
        f"--xla_dump_to={directory}",
        "--xla_dump_hlo_as_text",
        "--xla_dump_hlo_module_re=jit_(train|eval)_step",
    ]


def _environment(plan: Plan, dump_to: Path | None = None) -> dict[str, str]:
    """The compile process's environment: jax on CPU (the plugins then describe chips without probing for them,
    and compiles may share libtpu), the program's own flags, as many fake CPU devices as the mesh needs where
    there is no topology, and the dump flags where dumps are asked for. The caller's XLA_FLAGS are not passed on:
    the compile is the program's, with its own flags."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("AXGEN_XLA_KERNELS", "XLA_FLAGS", "LIBTPU_INIT_ARGS")
    }
    env.update(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    flags = {plan.flags_variable: list(plan.xla_flags)}
    if plan.topology is None:
        flags.setdefault("XLA_FLAGS", []).append(f"--xla_force_host_platform_device_count={plan.num_devices}")
    if dump_to is not None:
        flags.setdefault("XLA_FLAGS", []).extend(_dump_flags(dump_to))
    env.update({name: " ".join(values) for name, values in flags.items()})
    return env


def _compile_here(program_path: str, spec_path: str, target: str, rule: str) -> Report:
    """Runs in the compile process: imports the program, builds its mesh on the stand-in devices, compiles."""
    import jax

    from axgen.interop import load_program
    from axgen.runtime.memory import host_bytes, step_peak_bytes
    from axgen.runtime.program import Program

    spec = load_spec(spec_path)
    if json.loads(rule):
        spec = spec.replace(mesh_rules=[candidate_rule(target, json.loads(rule)), *spec.mesh_rules])
    plan = plan_for(spec, target)
    program = Program.from_module(load_program(program_path))
    devices, compiled_for = _devices(plan)
    mesh = program.make_mesh(devices)
    batch, seq_len = program.config["global_batch"], program.config["seq_len"]
    common = dict(
        spec=program.config["model"],
        target=target,
        compiled_for=compiled_for,
        mesh=dict(program.mesh_shape),
        grad_accum_steps=plan.grad_accum_steps,
        microbatch=plan.microbatch,
        pipeline_microbatches=plan.pipeline_microbatches if plan.stages > 1 else None,
        pipeline_repeats=plan.pipeline_repeats,
        pipeline_schedule=plan.pipeline_schedule if plan.stages > 1 else None,
        hbm_bytes=plan.chip.hbm_bytes,
        usable_bytes=plan.usable_bytes,
    )
    # Shardings first, outside the mesh: optax builds them from a small eager init on the host.
    step, eval_step = program.jit_train_step(mesh, batch), program.jit_eval_step(mesh, batch)
    state = program.abstract_state(mesh)
    # Token windows, their segment ids and loss masks: packed documents, as the program trains on them.
    tokens = program.batch_shape(mesh, batch)
    with jax.set_mesh(mesh), _as_the_chip(plan):
        began = time.perf_counter()
        try:
            compiled = step.lower(state, tokens, tokens, tokens).compile()
        except Exception as err:  # the TPU compiler's own out-of-memory check; anything else is a failure
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            message = next(line for line in str(err).splitlines() if "RESOURCE_EXHAUSTED" in line)
            return Report(
                **common,
                compile_seconds=time.perf_counter() - began,
                fits=False,
                peak_bytes=None,
                temp_bytes=refused_temporaries(message),
                out_of_memory=message.strip(),
            )
        seconds = time.perf_counter() - began
        evaluation = eval_step.lower(program.model_params(state), tokens, tokens, tokens).compile()
    hlo = compiled.as_text()
    memory = compiled.memory_analysis()
    peak = step_peak_bytes(memory)  # the formula the program's own check before it allocates uses
    eval_peak = step_peak_bytes(evaluation.memory_analysis())
    return Report(
        **common,
        compile_seconds=seconds,
        fits=peak <= plan.usable_bytes and eval_peak <= plan.usable_bytes,
        peak_bytes=peak,
        eval_peak_bytes=eval_peak,
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        host_bytes=host_bytes(memory),
        flops_per_device=program.config["flops_per_token"] * batch * seq_len / plan.num_devices,
        xla_flops_per_device=_xla_flops(compiled),
        **_hlo_cost_fields(hlo, plan),
        collectives=_count(_COLLECTIVE, hlo),
        kernels=_count(_CUSTOM_CALL, hlo),
    )


def _devices(plan: Plan) -> tuple[list, str]:
    """The devices to compile for, and what they stand for, in words."""
    import jax
    from jax.experimental import topologies

    from axgen.backends import gpu

    count = f"{plan.num_devices} x {plan.chip.name}"
    if plan.platform == "tpu":
        slices = {"num_slices": plan.num_slices} if plan.num_slices > 1 else {}
        topology = topologies.get_topology_desc(
            topology_name=plan.topology, platform="tpu", wrap=plan.topology_wrap, **slices
        )
        where = f"{plan.num_slices} slices of " if plan.num_slices > 1 else ""
        rings = [axis for axis, wraps in zip("xyz", plan.topology_wrap) if wraps]
        wired = f", wraparound in {' '.join(rings)}" if rings else ""
        return topology.devices, f"{count} (libtpu topology {where}{plan.topology}{wired})"
    if plan.platform == "cuda":
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=gpu.target_config(), topology=plan.topology
        )
        return topology.devices, f"{count} (CUDA plugin topology {plan.topology})"
    devices = jax.devices("cpu")
    if len(devices) < plan.num_devices:
        raise AotError(
            f"{plan.target} needs {plan.num_devices} fake CPU devices; jax started with {len(devices)}"
        )
    return devices[: plan.num_devices], f"{count} emulated by {plan.num_devices} fake CPU devices"


# libtpu's refusal: "... the total memory required for HLO temporaries (147.69G) exceeds available HBM (95.73G)",
# sizes as XLA writes them (HumanReadableNumBytes: powers of 1024).
_REFUSED_TEMPORARIES = re.compile(r"\(([\d.]+)([KMGT]?)i?B?\) exceeds available HBM")


def refused_temporaries(message: str) -> int | None:
    """The temporaries a refused compile needed, where the compiler's message says (the TPU compiler's does)."""
    found = _REFUSED_TEMPORARIES.search(message)
    if found is None:
        return None
    number, unit = found.groups()
    return int(float(number) * 1024 ** " KMGT".index(unit or " "))


@contextlib.contextmanager
def _as_the_chip(plan: Plan):
    """What jax asks the first device while tracing for an H100, answered by the chip's published facts: on the CPU
    host that compiles for it, the first device is a CPU one. jax's transposed grouped matmul kernel reads its SM
    count (`core_count`), and cuDNN attention's checks read its compute capability (Hopper takes head dims up to 256,
    e.g. MLA's 192; anything older only 128)."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    from axgen.backends import gpu

    if plan.platform != "cuda":
        yield
        return
    devices = jax.devices
    checks = cudnn_attention.check_compute_capability, cudnn_attention.is_cuda_compute_capability_equal
    chip = type("CompiledForDevice", (), {"core_count": gpu.H100_SXM["core_count"], "platform": "gpu"})

    def capability(version: str) -> tuple[int, ...]:
        return tuple(int(x) for x in version.split("."))

    jax.devices = lambda *backend: [chip(), *devices(*backend)[1:]]
    cudnn_attention.check_compute_capability = lambda version: gpu.COMPUTE_CAPABILITY >= capability(version)
    cudnn_attention.is_cuda_compute_capability_equal = lambda version: gpu.COMPUTE_CAPABILITY == capability(
        version
    )
    try:
        yield
    finally:
        jax.devices = devices
        cudnn_attention.check_compute_capability, cudnn_attention.is_cuda_compute_capability_equal = checks


def _xla_flops(compiled) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and cost.get("flops") else None


def _hlo_cost_fields(hlo: str, plan: Plan) -> dict:
    per_host = plan.chip.devices_per_host
    spans_hosts = plan.chip.network_bandwidth is not None and plan.num_devices > per_host
    cost = hlo_cost(hlo, per_host if spans_hosts else None)
    return dict(
        dot_flops=cost.dot_flops,
        memory_bytes=cost.memory_bytes,
        host_transfer_bytes=cost.host_bytes,
        collective_bytes=cost.collective_bytes,
        cross_slice=cost.cross_slice,
        cross_slice_bytes=cost.cross_slice_bytes,
        cross_host_bytes=cost.cross_host_bytes,
    )


def _count(pattern: re.Pattern, hlo: str) -> dict[str, int]:
    return dict(sorted(collections.Counter(pattern.findall(hlo)).items()))


# The markdown report's first line: `axgen aot --report` replaces a file that begins with it without --force.
REPORT_TITLE = "# Ahead-of-time compilation: every spec on every target"


def markdown(reports: list[Report], failures: list[str], command: str) -> str:
    """docs/aot.md: every spec x target, HBM per device and whether it fits."""
    lines = [
        REPORT_TITLE,
        "",
        f"Regenerate with `{command}`. Each row compiles the program in `generated/` for its target's chips",
        "without them: TPU through libtpu's topology, H100 through the CUDA plugin, Trainium and CPU on fake CPU",
        "devices with the target's mesh (their memory figures are XLA's CPU layout, an estimate). Peak is per device:",
        "arguments, outputs not aliased to them, and temporaries; bytes offloaded to host memory are not counted.",
        "Eval peak is the eval step's (`--eval-every`) at the same batch, in the same microbatches; a row fits when",
        "both peaks do.",
        "Usable is what the program's allocator takes: on H100, the 95% of HBM the emitted program sets",
        "(XLA_PYTHON_CLIENT_MEM_FRACTION; jax's own default is 75%); elsewhere, all of it.",
        "cpu-N's devices are one host's cores and share its memory (24 GiB here: 3 GiB each on cpu-8). A CPU program of",
        "a 7B+ model is there to be read and run with a small `--batch`; its params and AdamW moments alone exceed that.",
        "",
        "| spec | target | compiled for | mesh | microbatches | peak / usable per device | eval peak | fits | compile |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        mesh = " ".join(f"{axis}={size}" for axis, size in r.mesh.items() if size > 1) or "1 device"
        peak = _gib(r.peak_bytes) if r.peak_bytes is not None else "over (compiler refused)"
        eval_peak = _gib(r.eval_peak_bytes) if r.eval_peak_bytes is not None else "-"
        lines.append(
            f"| {r.spec} | {r.target} | {r.compiled_for} | {mesh} | {r.grad_accum_steps} x {r.microbatch} "
            f"| {peak} / {r.usable_bytes / GIB:.1f} GiB | {eval_peak} | {'yes' if r.fits else '**no**'} "
            f"| {r.compile_seconds:.0f}s |"
        )
    if failures:
        lines += ["", "Compiles that failed for another reason:", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(json.dumps(dataclasses.asdict(_compile_here(*sys.argv[1:5]))))
