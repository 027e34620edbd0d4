"""`axgen plan SPEC --target T`: the mesh rule a user would otherwise tune by hand, found by compiling.

Candidates are mesh splits (data x stage x fsdp x expert x context x model within a slice; context from
LONG_CONTEXT tokens on; pipeline stages where the layers split into them) x remat policies x microbatch sizes x
splash block lengths (TPU). Each is compiled for the target's chips without them (`axgen aot`'s deviceless
compile), dropped when its peak exceeds what the program's allocator takes, and ranked by an estimated step time:
the slowest of four resources at the chip's published peak rate, as if the others overlapped with it
(`latency-hiding` schedulers overlap collectives and host copies with compute):

- compute: the FLOPs of XLA's optimized program (its dots, each loop body counted as often as it runs, so
  recomputation, microbatching and the pipeline's bubble are in it) plus the model's FLOPs in kernels XLA does not
  see into (attention kernels, MoE grouped matmuls; in stages, their bubble's too), against peak bf16 FLOP/s;
- memory: bytes its top-level instructions read and write, against HBM bandwidth;
- host: bytes offloaded to host memory and back, against the host link;
- collectives: bytes its collectives move, against the inter-device link; on GPUs, those of collectives whose
  groups span hosts against the network (InfiniBand) instead.

To keep the compiles few, memory decides the order. A mesh on which the params and their optimizer state alone
cannot fit a device is pruned before anything is compiled. The target's own rule (the spec's mesh rule or the
backend's default) is compiled first. Then, for each mesh and policy the largest microbatch that fits is searched
from the top down (a smaller one only adds passes and weight gathers), and a policy is skipped where one that keeps
no more already failed at that size or smaller. Each compile also bounds what smaller passes can need
(`_least_peak`: temporaries shrink at most in proportion to the pass), on its own mesh and on those that shard the
params less finely, so sizes that cannot fit are pruned, and said so, without compiling them. The splash block
length is tried last, on the best few.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import threading
from collections.abc import Callable
from pathlib import Path

import black
import libcst as cst
import libcst.matchers as m

from axgen.analysis.aot import AotError, Report, compile_target
from axgen.backends import Plan, plan_for
from axgen.backends.common import GIB, LOGICAL_AXIS_RULES, residual_refused, runs_refused, stages_refused
from axgen.build import Built, build
from axgen.files import write_atomically
from axgen.ir import cost
from axgen.loader import load_spec
from axgen.analysis.placement import placement
from axgen.spec import MESH_AXES, REMAT_POLICIES, Model

# Least recomputation first: the order in which policies are tried and ties broken.
POLICIES = (
    "none",
    "save_dots",
    "save_dots_except_mlp",
    "offload_dots",
    "save_qkv_proj",
    "save_out_proj",
    "full",
)
# What each policy keeps in device memory, to compare policies by set inclusion. Offloading stages its copies on
# the device (offload_dots needed 18.4 GiB where full remat needs about 12), so it keeps more than full remat.
KEPT_ON_DEVICE = {
    name: frozenset(
        {"everything"} if not p.checkpoint else p.save + (("staged copies",) if p.offload else ())
    )
    for name, p in REMAT_POLICIES.items()
}
MODEL_SPLITS = (1, 2, 4, 8)  # tensor parallelism beyond 8 leaves a host's fast links
DATA_SPLITS = (1, 2, 4, 8)
# Sequences this long or longer are also tried split over context shards: shorter ones fit a device's activations
# without paying for the keys' and values' gathers.
LONG_CONTEXT = 16_384
CONTEXT_SPLITS = (1, 2, 4, 8, 16)
# Pipeline stages, up to this many, where the layers split into them evenly: fewer layers a stage means fewer
# weights its devices gather, at the cost of idle time (the bubble). Tried only for a model whose params and AdamW
# moments do not fit one host's devices: one that fits is sharded over a host's fast links instead.
MAX_STAGES = 16
SPLASH_BLOCKS = (256, 512, 1024)
BLOCKS_TRIED_ON = 3  # the best candidates whose splash block length is varied
# The target's own rule's modifiers that the search does not vary: every candidate keeps the rule's.
KEPT_MODIFIERS = (
    "compute_dtype",
    "attention",
    "quantize_dtype",
    "memory_fraction",
    "moe_dispatch",
    "moe_receive_capacity",
    "stack_cast",
    "xla_flags",
)


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: tuple[tuple[str, int], ...]  # one slice's, every axis
    microbatch: int
    remat: str
    attention_block: int | None = None
    pipeline_repeats: int = 1  # 1: GPipe; more: the circular schedule's rounds
    one_f_one_b: bool = False  # the target's own rule's 1F1B schedule (the search tries GPipe and circular)
    # MeshRule.shard_residual: the target's own rule's, on each mesh of the search it can split (residual_refused)
    shard_residual: bool = False
    kept: tuple[tuple[str, object], ...] = ()  # KEPT_MODIFIERS the target's own rule sets (`kept_modifiers`)

    def fields(self) -> dict:
        """The mesh rule's fields (`aot.candidate_rule`)."""
        fields = {"mesh": {a: n for a, n in self.mesh if n > 1} or {"fsdp": 1}, "microbatch": self.microbatch}
        fields["remat"] = self.remat
        fields |= {"pipeline_repeats": self.pipeline_repeats} if self.pipeline_repeats > 1 else {}
        fields |= {"pipeline_schedule": "1f1b"} if self.one_f_one_b else {}
        fields |= {"shard_residual": True} if self.shard_residual else {}
        fields |= dict(self.kept)
        return fields | ({"attention_block": self.attention_block} if self.attention_block else {})

    def mesh_text(self) -> str:
        circular = f" x{self.pipeline_repeats} rounds" if self.pipeline_repeats > 1 else ""
        circular += " 1F1B" if self.one_f_one_b else ""
        residual = " residual/model" if self.shard_residual else ""
        return " ".join(f"{a}={n}" for a, n in self.mesh if n > 1) + circular + residual or "1 device"


@dataclasses.dataclass(frozen=True)
class Outcome:
    candidate: Candidate
    report: Report | None
    failure: str | None = None  # why it did not compile
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # compute, memory, host, collectives

    @property
    def fits(self) -> bool:
        return self.report is not None and self.report.fits

    @property
    def step_seconds(self) -> float:
        return max(self.seconds.values())

    @property
    def bound_by(self) -> str:
        return max(self.seconds, key=self.seconds.get)


@dataclasses.dataclass
class Search:
    """The compiles so far, shared by the workers that search one mesh each."""

    spec_path: Path
    target: str
    max_compiles: int
    log: Callable[[str], None]
    estimate: Callable[[Report], dict[str, float]]
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    # mesh -> the (policy, microbatch) compiles that did not fit
    out_of_memory: dict[tuple, list[tuple[str, int]]] = dataclasses.field(default_factory=dict)
    finished: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def compile(self, candidate: Candidate) -> Outcome | None:
        """The candidate's outcome; None once the compile budget is spent."""
        with self.lock:
            done = next((o for o in self.outcomes if o.candidate == candidate), None)
            if done is not None:  # the target's own rule, compiled first, comes up again in its policy's turn
                return done
            if len(self.outcomes) >= self.max_compiles:
                return None
            self.outcomes.append(placeholder := Outcome(candidate, None, "compiling"))
        try:
            report = compile_target(self.spec_path, self.target, rule=candidate.fields())
            outcome = Outcome(candidate, report, seconds=self.estimate(report) if report.fits else {})
        except (AotError, ValueError) as err:
            outcome = Outcome(candidate, None, str(err).splitlines()[0])
        with self.lock:
            self.outcomes[self.outcomes.index(placeholder)] = outcome
            self.finished += 1
            self.log(_progress(outcome, self.finished, self.max_compiles))
        return outcome


def search(
    spec_path: str | Path,
    target: str,
    *,
    max_compiles: int = 40,
    jobs: int = 2,
    meshes: list[dict[str, int]] | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> list[Outcome]:
    """Every candidate compiled, best first: those that fit by estimated step time, then the others."""
    spec_path = Path(spec_path)
    spec = load_spec(spec_path)
    plan = plan_for(spec, target)
    built = build(spec_path, target)
    kernel_flops = _kernel_flops(built)

    def estimated(report: Report) -> dict[str, float]:
        if report.pipeline_schedule == "1f1b":
            busiest = _one_f_one_b_flops(built, report.mesh["stage"], report.bubble)
            return estimate(plan, dataclasses.replace(report, dot_flops=busiest), 0)
        # In pipeline stages the kernels run in the bubble's iterations too.
        return estimate(plan, report, kernel_flops / (1 - (report.bubble or 0)))

    state = Search(spec_path, target, max_compiles, log, estimated)
    per_slice = plan.num_devices // plan.num_slices
    mesh_splits = [_full(m, per_slice) for m in meshes] if meshes else _meshes(spec, plan, built)
    own = None if meshes else own_candidate(spec, plan)
    mesh_splits = [m for m in mesh_splits if _holds_the_state(m, built, plan, log)]
    policies = [p for p in POLICIES if p != "offload_dots" or "host_offload" in plan.chip.capabilities]
    block = plan.attention_block
    if own is not None and own.mesh in mesh_splits:
        # The target's own rule first: what the spec's author sized, and where a search that finds nothing better
        # still has an answer. Its figures bound the smaller passes of the policies that keep no more.
        state.compile(own)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        # Policy by policy, so a spent budget leaves every mesh tried under the cheaper ones.
        for policy in policies:
            list(pool.map(lambda mesh: _frontier(state, spec, plan, mesh, policy, block), mesh_splits))
        if plan.attention == "splash":
            best = [o.candidate for o in ranked(state.outcomes)[:BLOCKS_TRIED_ON] if o.fits]
            others = [
                dataclasses.replace(c, attention_block=b)
                for c in best
                for b in SPLASH_BLOCKS
                if b != c.attention_block and spec.train.seq_len % b == 0
            ]
            list(pool.map(state.compile, others))
    return ranked(state.outcomes)


def own_candidate(spec: Model, plan: Plan) -> Candidate:
    """The target's own rule (the spec's mesh rule for it, or the backend's) as a candidate: one slice's mesh."""
    remat = spec.feature("remat") or plan.remat
    mesh = tuple((a, n // (plan.num_slices if a == "data" else 1)) for a, n in plan.mesh)
    return Candidate(
        mesh,
        plan.microbatch,
        remat.policy if remat else "none",
        plan.attention_block,
        plan.pipeline_repeats,
        plan.pipeline_schedule == "1f1b",
        plan.shard_residual,
        kept_modifiers(plan),
    )


def kept_modifiers(plan: Plan) -> tuple[tuple[str, object], ...]:
    """The KEPT_MODIFIERS the target's own rule sets, which every candidate of the search keeps."""
    return tuple((name, getattr(plan.rule, name)) for name in KEPT_MODIFIERS if getattr(plan.rule, name))


def ranked(outcomes: list[Outcome]) -> list[Outcome]:
    # Ties (the slowest resource the same) go to the candidate that asks least of the others, then recomputes least.
    fitting = sorted(
        (o for o in outcomes if o.fits),
        key=lambda o: (o.step_seconds, sum(o.seconds.values()), POLICIES.index(o.candidate.remat)),
    )
    return fitting + [o for o in outcomes if not o.fits and o.failure != "compiling"]


def estimate(plan: Plan, report: Report, kernel_flops: float) -> dict[str, float]:
    """Seconds per step each resource needs at its peak rate."""
    chip, across = plan.chip, sum(report.cross_host_bytes.values())
    return {
        "compute": (report.dot_flops + kernel_flops) / chip.peak_bf16_flops,
        "memory": report.memory_bytes / chip.hbm_bandwidth,
        "host": report.host_transfer_bytes / chip.host_bandwidth,
        "collectives": (
            (sum(report.collective_bytes.values()) - across) / chip.link_bandwidth
            + across / (chip.network_bandwidth or chip.link_bandwidth)
        ),
    }


def _frontier(state: Search, spec: Model, plan: Plan, mesh: tuple, policy: str, block: int | None) -> None:
    """The largest microbatch that fits on this mesh under this policy, largest first, skipping sizes that cannot
    fit without compiling them: those at or above one where a policy keeping no more already did not, and those
    whose least possible peak, learnt from the compiles so far, exceeds what the device has. A staged pass that
    fits is also compiled circular, going round its stages 2 times, then more (`_rounds`), until one does not fit:
    each more round cuts the bubble and the weights' gathers a pass, and keeps more in memory."""
    failed = state.out_of_memory.setdefault(mesh, [])
    # The spec author's choice of splitting the residual stream, on each mesh where it can be (`mesh` is one
    # slice's; the slices add to data).
    whole = {**dict(mesh), "data": dict(mesh)["data"] * plan.num_slices}
    residual = plan.shard_residual and residual_refused(whole) is None
    for microbatch in _microbatches(spec, plan, mesh):
        if any(KEPT_ON_DEVICE[p] <= KEPT_ON_DEVICE[policy] and m <= microbatch for p, m in failed):
            continue
        least = _least_peak(state.outcomes, mesh, policy, microbatch)
        if least is not None and least > plan.usable_bytes:
            state.log(
                f"pruned {Candidate(mesh, microbatch, policy).mesh_text()}, microbatch {microbatch}, {policy}: "
                f"needs at least {least / GIB:.2f} GiB, more than {plan.usable_bytes / GIB:.1f} usable"
            )
            continue
        candidate = Candidate(
            mesh, microbatch, policy, block, shard_residual=residual, kept=kept_modifiers(plan)
        )
        outcome = state.compile(candidate)
        if outcome is not None and outcome.fits:
            for rounds in _rounds(spec, mesh, microbatch):
                circular = state.compile(dataclasses.replace(candidate, pipeline_repeats=rounds))
                if circular is None or not circular.fits:
                    break
        if outcome is None or outcome.fits:
            return
        if outcome.report is not None:  # out of memory, not a failure of another kind
            failed.append((policy, microbatch))


def _rounds(spec: Model, mesh: tuple, microbatch: int) -> list[int]:
    """The rounds a staged pass of `microbatch` sequences a device can go round its stages (the circular schedule),
    fewest first: each count of 2 or more that cuts the layers into stages x rounds equal runs, where the pass has
    at least as many microbatches (of one sequence) as stages, without which a round's slots stand empty as long as
    the bubble it saves."""
    stages = dict(mesh)["stage"]
    if stages == 1 or microbatch < stages:
        return []
    return [
        r for r in range(2, spec.decoder.num_layers // stages + 1) if runs_refused(spec, stages, r) is None
    ]


def _least_peak(outcomes: list[Outcome], mesh: tuple, policy: str, microbatch: int) -> int | None:
    """The least peak bytes `microbatch` sequences per pass can need on this mesh under this policy, from compiles
    of passes as large or larger, under policies that keep no more on the device, on this mesh or on one that
    shards the params at least as finely (`_needs_no_more`). A pass's temporaries are a part that does not depend
    on its size (gradients, gathered weights) plus activations in proportion to it, so at m' < m they are at least
    temp(m) * m' / m; the rest of the peak (params, optimizer state) does not change. A compile the TPU compiler
    refused says only its temporaries, which bound the peak from below alone. The circular schedule's compiles
    bound nothing: they keep more than GPipe's at the same pass (their queue, more stage inputs)."""
    bounds = [
        (o.report.peak_bytes or o.report.temp_bytes)
        - o.report.temp_bytes * (1 - microbatch / o.candidate.microbatch)
        for o in outcomes
        if o.report is not None
        and o.report.temp_bytes is not None
        and _needs_no_more(o.candidate.mesh, mesh)
        and o.candidate.microbatch >= microbatch
        and o.candidate.pipeline_repeats == 1
        and KEPT_ON_DEVICE[o.candidate.remat] <= KEPT_ON_DEVICE[policy]
    ]
    return int(max(bounds)) if bounds else None


def _holds_the_state(mesh: tuple, built: Built, plan: Plan, log: Callable[[str], None]) -> bool:
    """Whether a device of this mesh can hold its share of the params and their AdamW moments, split as the rules
    table splits them on it (`data` holds copies; a dim no axis divides stays whole); else the mesh is pruned with
    every pass and policy, since no remat or microbatch makes them smaller."""
    state = placement(built.graph, dict(plan.logical_axis_rules), dict(mesh)).state_bytes
    if state > plan.usable_bytes:
        log(
            f"pruned {Candidate(mesh, 1, 'full').mesh_text()}, every pass and policy: the params and optimizer "
            f"state alone need {state / GIB:.2f} GiB a device, more than {plan.usable_bytes / GIB:.1f} usable"
        )
    return state <= plan.usable_bytes


def _needs_no_more(compiled: tuple, mesh: tuple) -> bool:
    """Whether `compiled` needs no more memory than `mesh` at the same pass and policy: the same model and expert
    splits and as many batch shards (so each device holds the same activations), the params sharded over at least
    as many fsdp devices (so each holds no more of them, their gradients and optimizer state)."""
    compiled, mesh = dict(compiled), dict(mesh)
    return (
        all(compiled[a] == mesh[a] for a in ("stage", "model", "expert", "context"))
        and compiled["data"] * compiled["fsdp"] == mesh["data"] * mesh["fsdp"]
        and compiled["fsdp"] >= mesh["fsdp"]
    )


def _meshes(spec: Model, plan: Plan, built: Built) -> list[tuple[tuple[str, int], ...]]:
    """Splits of one slice's devices: model and expert parallelism where the model's widths divide, data
    parallelism over a few groups, context parallelism for long sequences (not with experts of a capacity per
    sequence), pipeline stages where the layers split into them, fsdp over the rest; the target's own rule
    first."""
    per_slice, seq_len = plan.num_devices // plan.num_slices, spec.train.seq_len
    attention, moe = spec.decoder.attention, spec.feature("moe")
    widths = (attention.num_heads, attention.num_kv_heads, spec.decoder.mlp.hidden_dim, spec.vocab_size)
    experts = (1, 2, 4, 8) if moe else (1,)
    capacity = moe is not None and moe.capacity_factor is not None
    contexts = [c for c in CONTEXT_SPLITS if c == 1 or (seq_len >= LONG_CONTEXT and not capacity)]
    host = _full({"fsdp": -1}, min(plan.chip.devices_per_host, per_slice))
    beyond_a_host = (
        placement(built.graph, dict(plan.logical_axis_rules), dict(host)).state_bytes > plan.usable_bytes
    )
    stages = [
        s for s in range(1, MAX_STAGES + 1) if s == 1 or (beyond_a_host and stages_refused(spec, s) is None)
    ]
    found = [own_candidate(spec, plan).mesh]
    for stage, model, expert, data, context in itertools.product(
        stages, MODEL_SPLITS, experts, DATA_SPLITS, contexts
    ):
        if per_slice % (stage * model * expert * data * context) or any(w % model for w in widths):
            continue
        if (moe and moe.num_experts % expert) or seq_len % (2 * context):
            continue
        split = {
            "data": data,
            "stage": stage,
            "expert": expert,
            "context": context,
            "model": model,
            "fsdp": -1,
        }
        mesh = _full(split, per_slice)
        batch_shards = math.prod(n for a, n in mesh if a in dict(LOGICAL_AXIS_RULES)["batch"])
        if mesh not in found and spec.train.global_batch % (batch_shards * plan.num_slices) == 0:
            found.append(mesh)
    return found


def _full(mesh: dict[str, int], devices: int) -> tuple[tuple[str, int], ...]:
    fixed = math.prod(n for n in mesh.values() if n != -1)
    return tuple((a, devices // fixed if mesh.get(a) == -1 else mesh.get(a, 1)) for a in MESH_AXES)


def _microbatches(spec: Model, plan: Plan, mesh: tuple) -> list[int]:
    """Sequences per device per pass, largest first: the divisors of the per-device batch."""
    batch_shards = math.prod(n for a, n in mesh if a in dict(LOGICAL_AXIS_RULES)["batch"]) * plan.num_slices
    per_device = spec.train.global_batch // batch_shards
    return [m for m in range(per_device, 0, -1) if per_device % m == 0]


def _kernel_flops(built: Built) -> float:
    """Per device per step: the model's FLOPs in attention kernels and MoE grouped matmuls, which the HLO's dots
    leave out (their recomputation under remat is not counted)."""
    train = built.spec.train

    def in_kernel(node) -> bool:
        return node.op == "moe" or (node.op == "attention" and node.attrs.kernel != "xla")

    per_token = cost.flops_per_token(built.graph, train.seq_len, in_kernel)
    return per_token * train.global_batch * train.seq_len / built.plan.num_devices


def _one_f_one_b_flops(built: Built, stages: int, bubble: float) -> float:
    """Per device per step on the busiest 1F1B stage, every tick of the pass: a full stage's layers (ceil(layers /
    stages), attention included) and the last stage's output head and fused loss (8 FLOPs a weight and token: the
    forward, its recomputation and the backward's two), the two added where the last stage holds layers and the
    larger where it holds none, over all the step's tokens and one stage's devices. Counted from the graph: the
    head and the empty stages' skipped layers run under a lax.cond, whose dots XLA's count of the HLO leaves out.
    """
    spec, train = built.spec, built.spec.train
    layers = spec.decoder.num_layers
    per_stage = -(-layers // stages)
    per_layer = cost.flops_per_token(built.graph, train.seq_len, lambda node: node.region != "main") / layers
    head = cost.flops_per_token(built.graph, train.seq_len, lambda node: node.op == "lm_head") * 8 / 6
    last_holds_layers = layers // per_stage == stages
    busiest = per_stage * per_layer + head if last_holds_layers else max(per_stage * per_layer, head)
    return busiest * train.global_batch * train.seq_len / (built.plan.num_devices / stages) / (1 - bubble)


def _progress(outcome: Outcome, done: int, budget: int) -> str:
    c = outcome.candidate
    what = f"{c.mesh_text()}, microbatch {c.microbatch}, {c.remat}" + (
        f", block {c.attention_block}" if c.attention_block else ""
    )
    if outcome.report is None:
        result = f"failed: {outcome.failure}"
    elif not outcome.fits:
        peak = outcome.report.peak_bytes
        result = "does not fit" + (f" ({peak / GIB:.2f} GiB)" if peak else " (the compiler refused)")
    else:
        result = (
            f"fits ({outcome.report.peak_bytes / GIB:.2f} GiB), about {outcome.step_seconds:.3g} s a step"
        )
    return f"[{done}/{budget}] {what}: {result}"


def table(outcomes: list[Outcome], plan: Plan, tokens_per_step: int, top: int) -> str:
    """The ranked candidates that fit, then how many did not and why, as text."""
    fitting = [o for o in outcomes if o.fits]
    width = max([26, *(len(o.candidate.mesh_text()) for o in fitting[:top])])
    lines = [
        f"{'rank':>4}  {'mesh':<{width}} {'micro':>5} {'remat':<21} {'block':>5} {'peak GiB':>9} "
        f"{'step s':>8} {'tokens/s':>10}  bound by (compute / memory / host / collectives s)"
    ]
    for rank, o in enumerate(fitting[:top], 1):
        c, s = o.candidate, o.seconds
        terms = " / ".join(f"{s[k]:.3g}" for k in ("compute", "memory", "host", "collectives"))
        lines.append(
            f"{rank:>4}  {c.mesh_text():<{width}} {c.microbatch:>5} {c.remat:<21} {c.attention_block or '-':>5} "
            f"{o.report.peak_bytes / GIB:>9.2f} {o.step_seconds:>8.3g} {tokens_per_step / o.step_seconds:>10.4g}  "
            f"{o.bound_by} ({terms})"
        )
    dropped = [o for o in outcomes if not o.fits]
    usable = f"{plan.usable_bytes / GIB:.1f} GiB usable per device"
    lines.append(f"{len(fitting)} fit {usable}; {len(dropped)} did not:")
    lines += [f"  {_progress(o, 0, 0).split('] ', 1)[1]}" for o in dropped]
    return "\n".join(lines)


def write_rule(spec_path: Path, target: str, candidate: Candidate, why: str) -> str:
    """Puts the candidate first among the spec's mesh rules, as a rule for exactly `target` (replacing one an
    earlier plan wrote for it), checks the spec now plans to it, and returns the rule's source."""
    fields = candidate.fields()
    rule = (
        f"MeshRule({target!r}, {fields.pop('mesh')!r}, why={why!r}, "
        + ", ".join(f"{k}=Remat(policy={v!r})" if k == "remat" else f"{k}={v!r}" for k, v in fields.items())
        + ")"
    )
    source = spec_path.read_text()
    try:
        edited = black.format_str(_with_rule(source, target, rule), mode=black.Mode(line_length=110))
    except PlanError as err:
        raise PlanError(f"{spec_path}: {err}") from None
    write_atomically(spec_path, edited)
    plan = plan_for(load_spec(spec_path), target)
    if (plan.microbatch, plan.remat.policy if plan.remat else None) != (
        candidate.microbatch,
        candidate.remat,
    ):
        write_atomically(spec_path, source)
        raise PlanError(f"{spec_path}: the written rule does not decide target {target}; left unchanged")
    return rule


class PlanError(ValueError):
    """A plan that cannot be written: one line."""


def _with_rule(source: str, target: str, rule: str) -> str:
    adding = _AddRule(target, cst.parse_expression(rule))
    module = cst.parse_module(source).visit(adding)
    if not adding.done:
        raise PlanError("has no `spec = Model(...)` or `spec = <spec>.replace(...)` to add a mesh rule to")
    names = {
        alias.name.value
        for statement in module.body
        for small in getattr(statement, "body", [])
        if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar)
        for alias in small.names
    }
    missing = [name for name in ("MeshRule", "Remat") if name not in names]
    if missing:
        last_import = max(
            (
                i
                for i, s in enumerate(module.body)
                if m.matches(s, m.SimpleStatementLine([m.ImportFrom() | m.Import()]))
            ),
            default=-1,
        )
        line = cst.parse_statement(f"from axgen.spec import {', '.join(missing)}\n")
        module = module.with_changes(
            body=[*module.body[: last_import + 1], line, *module.body[last_import + 1 :]]
        )
    return module.code


class _AddRule(cst.CSTTransformer):
    """In `spec = Model(...)` or `spec = base.replace(...)`: the rule first in `mesh_rules`."""

    def __init__(self, target: str, rule: cst.BaseExpression):
        self.target, self.rule, self.done = target, rule, False

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign) -> cst.Assign:
        is_spec = any(m.matches(t.target, m.Name("spec")) for t in updated.targets)
        if not is_spec or not isinstance(updated.value, cst.Call):
            return updated
        call = updated.value
        keyword = next((a for a in call.args if a.keyword and a.keyword.value == "mesh_rules"), None)
        if keyword is not None and isinstance(keyword.value, cst.List):
            kept = [e for e in keyword.value.elements if not self._for_target(e.value)]
            value = keyword.value.with_changes(elements=[cst.Element(self.rule), *kept])
            args = [a.with_changes(value=value) if a is keyword else a for a in call.args]
        elif keyword is None:
            receiver = call.func.value if m.matches(call.func, m.Attribute(attr=m.Name("replace"))) else None
            rest = f", *{cst.Module([]).code_for_node(receiver)}.mesh_rules" if receiver is not None else ""
            value = cst.parse_expression(f"[{cst.Module([]).code_for_node(self.rule)}{rest}]")
            args = [*call.args, cst.Arg(value, keyword=cst.Name("mesh_rules"))]
        else:
            raise PlanError("Model.mesh_rules is not a list literal, so axgen plan cannot add a rule to it")
        self.done = True
        return updated.with_changes(value=call.with_changes(args=args))

    def _for_target(self, element: cst.BaseExpression) -> bool:
        return (
            m.matches(element, m.Call(func=m.Name("MeshRule")))
            and m.matches(element.args[0].value, m.SimpleString())
            and element.args[0].value.evaluated_value == self.target
        )
