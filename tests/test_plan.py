"""`axgen plan` compiles candidate mesh rules for the target's chips, drops what does not fit what the program's
allocator takes, ranks the rest by estimated step time, and with --write records the winner as the spec's rule.
"""

import dataclasses
import json
import shutil
import types

import pytest

from axgen.analysis import plan as planning
from axgen.analysis.aot import candidate_rule, refused_temporaries
from axgen.backends import plan_for
from axgen.build import build, default_output
from axgen.cli import main as axgen
from axgen.loader import load_spec
from axgen.spec import MeshRule
from tests.conftest import ROOT

# llama_tiny widened until keeping every activation of a 128-sequence pass no longer fits an H100.
WIDE = '''"""llama_tiny, wide enough to need remat or microbatches on one H100."""

from axgen.spec import MLP, Attention
from axgen.specs.llama_tiny import spec as llama_tiny

spec = llama_tiny.replace(
    name="wide-tiny",
    d_model=1024,
    decoder=llama_tiny.decoder.replace(
        num_layers=8,
        attention=Attention(num_heads=8, num_kv_heads=8, head_dim=128),
        mlp=MLP(hidden_dim=4096, activation="swiglu"),
    ),
    train=llama_tiny.train.replace(seq_len=2048, global_batch=128),
    targets=["gpu-h100-1"],
)
'''


# slow tier: four deviceless compiles of a 1024-wide program (80 s on 2 cores)
@pytest.mark.slow
def test_plan_drops_what_does_not_fit_ranks_the_rest_and_writes_the_winner(tmp_path, capsys):
    spec = tmp_path / "specs" / "wide_tiny.py"
    spec.parent.mkdir()
    spec.write_text(WIDE)
    code = axgen(["plan", str(spec), "--target", "gpu-h100-1", "--max-compiles", "4", "--write"])
    out = capsys.readouterr().out
    assert code == 0, out
    # First the target's own rule (the H100 backend's save_dots, 2 sequences a pass). Keeping everything, 128
    # sequences per pass need 154.5 GiB, over the 75.2 GiB the program's allocator takes (95% of 79.1). Half the pass
    # keeps at least half the temporaries, 78.01 GiB, so 64 is pruned without a compile (compiled, it needed
    # more still); 32 fits, and the fourth compile goes to the next policy.
    assert "[1/4] 1 device, microbatch 2, save_dots: fits (3.50 GiB)" in out
    assert "[2/4] 1 device, microbatch 128, none: does not fit (154.50 GiB)" in out
    assert "pruned 1 device, microbatch 64, none: needs at least 78.01 GiB, more than 75.2 usable" in out
    assert "[3/4] 1 device, microbatch 32, none: fits (41.83 GiB)" in out
    assert "3 fit 75.2 GiB usable per device; 1 did not:" in out
    [row] = [line for line in out.splitlines() if line.startswith("   1  ")]
    assert row.split()[1:5] == ["1", "device", "128", "save_dots"]

    written = load_spec(spec)
    assert written.mesh_rules[0].pattern == "gpu-h100-1" and written.mesh_rules[0].why.startswith(
        "axgen plan"
    )
    plan = plan_for(written, "gpu-h100-1")
    assert (plan.microbatch, plan.grad_accum_steps, plan.remat.policy) == (128, 1, "save_dots")
    assert "MICROBATCH = 128" in build(spec, "gpu-h100-1").source


def test_a_second_plan_replaces_the_rule_the_first_wrote_and_derived_specs_keep_their_bases_rules(tmp_path):
    spec = tmp_path / "specs" / "derived.py"
    spec.parent.mkdir()
    spec.write_text(
        "from axgen.specs.llama_tiny import spec as tiny\n\nspec = tiny.replace(name='derived')\n"
    )
    mesh = (("data", 1), ("fsdp", 8), ("expert", 1), ("model", 1))
    first = planning.Candidate(mesh, 2, "save_dots")
    planning.write_rule(spec, "cpu-8", first, "first")
    planning.write_rule(spec, "cpu-8", dataclasses.replace(first, microbatch=1, remat="full"), "second")
    source = spec.read_text()
    assert source.count("MeshRule(") == 1 and "from axgen.spec import MeshRule, Remat" in source
    assert "*tiny.mesh_rules" in source
    plan = plan_for(load_spec(spec), "cpu-8")
    assert (plan.microbatch, plan.remat.policy, plan.rule.why) == (1, "full", "second")


def test_a_policy_is_not_compiled_where_one_keeping_no_more_already_did_not_fit():
    """Full remat keeps only each layer's input: where it did not fit, save_dots and offload_dots (which stages
    its copies on the device) will not either. The reverse does not hold."""
    fits_at = {"full": 4, "save_dots": 2, "offload_dots": 2}  # the largest microbatch each fits at
    compiled = []

    def compile_candidate(candidate):
        compiled.append((candidate.remat, candidate.microbatch))
        report = types.SimpleNamespace(fits=candidate.microbatch <= fits_at[candidate.remat])
        return types.SimpleNamespace(fits=report.fits, report=report)

    state = types.SimpleNamespace(out_of_memory={}, compile=compile_candidate, outcomes=[], log=print)
    spec = load_spec(ROOT / "axgen/specs/llama_tiny.py")
    plan = plan_for(spec, "cpu-1")  # 16 sequences on one device
    mesh = planning._full({"fsdp": 1}, 1)
    for policy in ("full", "save_dots", "offload_dots"):
        planning._frontier(state, spec, plan, mesh, policy, None)
    full = [("full", 16), ("full", 8), ("full", 4)]
    assert compiled == full + [("save_dots", 4), ("save_dots", 2), ("offload_dots", 4), ("offload_dots", 2)]

    compiled.clear()
    state.out_of_memory.clear()
    for policy in ("offload_dots", "full"):
        planning._frontier(state, spec, plan, mesh, policy, None)
    assert compiled == [("offload_dots", m) for m in (16, 8, 4, 2)] + full


def test_a_staged_pass_that_fits_is_also_tried_going_round_the_stages_more_times_until_one_does_not_fit():
    """Llama 3.1 405B's 126 layers on 896 H100s: over 7 stages, the largest pass that fits (32 sequences a device,
    32 microbatches) is compiled again circular, going round the stages 2 times (7 x 2 runs of 9 layers), then 3
    (of 6 layers), then 6, where it no longer fits (here: more than 3 rounds do not), and no more are tried. Over 14
    stages 2 rounds do not cut 126 layers into equal runs, so 3 come first; nothing goes round without stages, nor
    in a pass of fewer microbatches than stages, whose rounds would leave as many slots empty as the bubble they
    save."""
    spec = load_spec(ROOT / "axgen/specs/llama3_405b.py")
    plan = plan_for(spec, "gpu-h100-896")
    compiled = []

    def compile_candidate(candidate):
        compiled.append((candidate.microbatch, candidate.pipeline_repeats))
        report = types.SimpleNamespace(
            fits=candidate.microbatch <= fits_at and candidate.pipeline_repeats <= 3
        )
        return types.SimpleNamespace(fits=report.fits, report=report)

    state = types.SimpleNamespace(out_of_memory={}, compile=compile_candidate, outcomes=[], log=print)
    runs = {
        (7, 32): [(128, 1), (64, 1), (32, 1), (32, 2), (32, 3), (32, 6)],
        (14, 32): [(256, 1), (128, 1), (64, 1), (32, 1), (32, 3), (32, 9)],
        (7, 4): [(128, 1), (64, 1), (32, 1), (16, 1), (8, 1), (4, 1)],
        (1, 2): [(16, 1), (8, 1), (4, 1), (2, 1)],  # on 1024 devices: fsdp=128
    }
    for (stages, fits_at), expected in runs.items():
        compiled.clear()
        state.out_of_memory.clear()
        mesh = planning._full({"stage": stages, "model": 8, "fsdp": -1}, 896 if stages > 1 else 1024)
        planning._frontier(state, spec, plan, mesh, "full", None)
        assert compiled == expected, (stages, fits_at)
    # The table's mesh column is as wide as a circular candidate's name.
    mesh = planning._full({"stage": 7, "model": 8, "fsdp": -1}, 896)
    report = types.SimpleNamespace(fits=True, peak_bytes=2**36)
    seconds = {"compute": 70.0, "memory": 30.0, "host": 0.0, "collectives": 150.0}
    outcomes = [
        planning.Outcome(planning.Candidate(mesh, 32, "full", None, rounds), report, seconds=seconds)
        for rounds in (2, 1)
    ]
    header, *rows = planning.table(outcomes, plan, 2048 * 8192, 10).splitlines()[:3]
    assert "stage=7 fsdp=16 model=8 x2 rounds    32 full" in rows[0]
    assert {row.index(" 32 full") + 3 for row in rows} == {header.index("micro") + 5}


def test_the_rule_s_residual_split_goes_only_onto_the_meshes_that_can_take_it():
    """Llama 3.1 405B's rule splits the residual stream over model: the search keeps that choice on each mesh with
    a model axis, and drops it where the mesh has none, or where two axes split the batch (which XLA
    miscompiles: backends/common.residual_refused), rather than compiling a mesh the build refuses."""
    spec = load_spec(ROOT / "axgen/specs/llama3_405b.py")
    plan = plan_for(spec, "gpu-h100-1024")
    assert plan.shard_residual
    compiled = []

    def compile_candidate(candidate):
        compiled.append(candidate.shard_residual)
        return types.SimpleNamespace(fits=True, report=types.SimpleNamespace(fits=True))

    state = types.SimpleNamespace(out_of_memory={}, compile=compile_candidate, outcomes=[], log=print)
    for mesh, split in [
        ({"model": 8, "fsdp": -1}, True),
        ({"fsdp": -1}, False),
        ({"data": 2, "model": 8, "fsdp": -1}, False),
        ({"data": 128, "model": 8}, True),
    ]:
        compiled.clear()
        planning._frontier(state, spec, plan, planning._full(mesh, 1024), "full", None)
        assert compiled == [split], mesh


def test_every_candidate_keeps_the_modifiers_of_the_rule_it_stands_in_for():
    """A candidate's rule goes before the target's own, so the modifiers the search does not vary
    (plan.KEPT_MODIFIERS) come with it, through the JSON the compile process reads: the program each candidate
    compiles, and the rule `axgen plan --write` writes, keep the allocator's share, the stack cast, the flags.
    """
    rule = MeshRule(
        "gpu-h100-8",
        {"fsdp": -1},
        why="x",
        memory_fraction=0.5,
        stack_cast="before_layers",
        xla_flags=("--xla_gpu_enable_command_buffer=",),
    )
    spec = load_spec(ROOT / "axgen/specs/moe_tiny.py")
    spec = spec.replace(mesh_rules=[rule], targets=["gpu-h100-8"])
    plan = plan_for(spec, "gpu-h100-8")
    compiled = [planning.own_candidate(spec, plan)]

    def compile_candidate(candidate):
        compiled.append(candidate)
        return types.SimpleNamespace(fits=True, report=types.SimpleNamespace(fits=True))

    state = types.SimpleNamespace(out_of_memory={}, compile=compile_candidate, outcomes=[], log=print)
    planning._frontier(state, spec, plan, planning._full({"fsdp": 2, "expert": 4}, 8), "full", None)
    for candidate in compiled:
        fields = json.loads(json.dumps(candidate.fields()))
        planned = plan_for(spec.replace(mesh_rules=[candidate_rule("gpu-h100-8", fields)]), "gpu-h100-8")
        assert planned.memory_fraction == 0.5 and planned.stack_cast == "before_layers"
        assert planned.xla_flags[-1] == "--xla_gpu_enable_command_buffer="


def test_a_pass_whose_least_possible_peak_is_over_the_budget_is_pruned_without_compiling():
    """A compile at 16 sequences per pass whose temporaries are twice what the device has: at 8 they are at least
    half of that, which with the rest of the peak is still over, so 8 is pruned and said so; 4 is compiled."""
    spec = load_spec(ROOT / "axgen/specs/llama_tiny.py")
    plan = plan_for(spec, "cpu-1")  # 16 sequences on one device
    mesh, usable = planning._full({"fsdp": 1}, 1), plan.usable_bytes
    compiled, logged = [], []

    def compile_candidate(candidate):
        compiled.append(candidate.microbatch)
        temp = 2 * usable * candidate.microbatch // 16
        report = types.SimpleNamespace(
            peak_bytes=usable // 10 + temp, temp_bytes=temp, fits=usable // 10 + temp <= usable
        )
        outcome = planning.Outcome(candidate, report)
        state.outcomes.append(outcome)
        return outcome

    state = types.SimpleNamespace(out_of_memory={}, compile=compile_candidate, outcomes=[], log=logged.append)
    planning._frontier(state, spec, plan, mesh, "none", None)
    assert compiled == [16, 4]
    assert logged == [
        f"pruned 1 device, microbatch 8, none: needs at least {1.1 * usable / 2**30:.2f} GiB, more "
        f"than {usable / 2**30:.1f} usable"
    ]


def test_a_compile_bounds_the_meshes_that_shard_the_params_less_finely():
    """None at 64 sequences on fsdp=8 needed 4119.56 GiB (llama3-8b on gpu-h100-8, measured): data=2 x fsdp=4
    holds the same activations and more of the params, so it needs at least as much, and is pruned from that one
    compile; a mesh that splits the model differently is not bounded by it, nor is a policy that keeps less.
    """
    fsdp8, data2 = planning._full({"fsdp": 8}, 8), planning._full({"data": 2, "fsdp": 4}, 8)
    model2 = planning._full({"model": 2, "fsdp": 4}, 8)
    report = types.SimpleNamespace(peak_bytes=int(4119.56 * 2**30), temp_bytes=int(4100 * 2**30))
    outcomes = [planning.Outcome(planning.Candidate(fsdp8, 64, "none"), report)]
    least = planning._least_peak(outcomes, data2, "none", 1)
    assert least == int((4119.56 - 4100 * 63 / 64) * 2**30)
    assert planning._least_peak(outcomes, model2, "none", 1) is None
    assert planning._least_peak(outcomes, data2, "save_dots", 1) is None
    assert (
        planning._least_peak(
            [planning.Outcome(planning.Candidate(data2, 64, "none"), report)], fsdp8, "none", 1
        )
        is None
    )
    # The circular schedule keeps more than GPipe at the same pass: its compiles bound no GPipe pass.
    circular = planning.Candidate(fsdp8, 64, "none", pipeline_repeats=2)
    assert planning._least_peak([planning.Outcome(circular, report)], fsdp8, "none", 1) is None


def test_a_tpu_refusal_s_temporaries_bound_the_smaller_passes():
    """libtpu's refusal names the temporaries it needed (this message: qwen3-235b-a22b on tpu-v5p-256, docs/aot.md),
    which alone bound a smaller pass's peak from below."""
    message = (
        "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (147.69G) exceeds available HBM (95.73G). HLO module: jit_train_step."
    )
    temp = int(147.69 * 2**30)
    assert refused_temporaries(message) == temp
    assert refused_temporaries("RESOURCE_EXHAUSTED: out of memory while trying to allocate") is None
    mesh = planning._full({"fsdp": 256}, 256)
    refused = types.SimpleNamespace(peak_bytes=None, temp_bytes=temp)
    outcomes = [planning.Outcome(planning.Candidate(mesh, 4, "none"), refused)]
    assert planning._least_peak(outcomes, mesh, "none", 2) == temp // 2


def test_the_search_compiles_the_target_s_own_rule_first(monkeypatch):
    """Whatever else the budget buys, the spec's own rule for the target is compiled first, once."""
    compiled = []

    def compile_target(spec_path, target, rule):
        compiled.append(rule)
        return types.SimpleNamespace(fits=False, peak_bytes=None, temp_bytes=None)

    monkeypatch.setattr(planning, "compile_target", compile_target)
    spec = load_spec(ROOT / "axgen/specs/llama_tiny.py")
    plan = plan_for(spec, "tpu-v5e-8")
    planning.search(ROOT / "axgen/specs/llama_tiny.py", "tpu-v5e-8", max_compiles=3, jobs=1)
    assert compiled[0] == {
        "mesh": {a: n for a, n in plan.mesh if n > 1},
        "microbatch": plan.microbatch,
        "remat": plan.remat.policy,
        "attention_block": plan.attention_block,
    }
    assert len(compiled) == 3 and compiled[0] not in compiled[1:]


def test_plan_inputs_are_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit:
        axgen(["plan", str(ROOT / "axgen/specs/llama_tiny.py"), "--target", "cpu-8", "--mesh", "fsdb=8"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert (
        "names fsdb, not one of data, stage, fsdp, expert, context, model" in err
        and len(err.strip().splitlines()) == 1
    )
    shutil.copy(ROOT / "axgen/specs/llama_tiny.py", tmp_path / "tiny.py")
    (tmp_path / "tiny.py").write_text((tmp_path / "tiny.py").read_text().replace("spec = ", "spec = [] or "))
    with pytest.raises(planning.PlanError, match="tiny.py: has no `spec = Model"):
        planning.write_rule(
            tmp_path / "tiny.py", "cpu-8", planning.Candidate(planning._full({}, 8), 1, "full"), "x"
        )


def test_meshes_that_cannot_hold_the_params_and_optimizer_state_are_pruned_before_any_compile(monkeypatch):
    """cpu-8's devices are one 24 GiB host's cores, 3 GiB each. Llama 2 7B's 6,738,415,616 params (its published
    count) take 12 bytes each with AdamW's two float32 moments: at least 9.41 GiB a device even split 8 ways (a
    little more: the norms' scales stay whole), so no mesh, pass or policy fits and nothing is compiled: not the
    10 splits without pipeline stages, nor the 10 with 2, 4 or 8 stages (tried since the model does not fit the
    host), whose stages split the layers 8 ways at most and copy the embedding and head."""

    def compile_target(spec_path, target, rule):
        raise AssertionError(f"compiled {rule}")

    monkeypatch.setattr(planning, "compile_target", compile_target)
    assert plan_for(load_spec(ROOT / "axgen/specs/llama2_7b.py"), "cpu-8").usable_bytes == 3 * 2**30
    assert plan_for(load_spec(ROOT / "axgen/specs/llama_tiny.py"), "cpu-1").usable_bytes == 24 * 2**30
    logged = []
    assert (
        planning.search(ROOT / "axgen/specs/llama2_7b.py", "cpu-8", max_compiles=6, log=logged.append) == []
    )
    needs = {
        line.split(",")[0].removeprefix("pruned "): float(line.split("need ")[1].split(" GiB")[0])
        for line in logged
    }
    split_8_ways = 12 * 6_738_415_616 / 8 / 2**30  # the log's figures have two decimals
    assert len(needs) == len(logged) == 20 and all("more than 3.0 usable" in line for line in logged)
    assert sum("stage=" in mesh for mesh in needs) == 10 and needs["stage=8"] > split_8_ways
    assert round(split_8_ways, 2) <= needs["fsdp=8"] <= round(1.001 * split_8_ways, 2)
    assert round(2 * split_8_ways, 2) <= needs["data=2 fsdp=2 model=2"] <= round(2.002 * split_8_ways, 2)


def test_a_mesh_whose_axes_divide_no_dim_of_the_experts_is_pruned_for_what_it_leaves_whole():
    """gpt-oss-120b on tpu-v5p-256: fsdp=256 divides none of the experts' dims (2880 wide, 128 experts), so each
    chip would hold their 114.6B params whole (libtpu: 1.74T of temporaries); fsdp=64 x expert=4, the spec's rule,
    holds an even share."""
    built = build(ROOT / "axgen/specs/gpt_oss_120b.py", "tpu-v5p-256")
    fsdp_only, spec_rule = planning._full({"fsdp": 256}, 256), planning._full({"fsdp": 64, "expert": 4}, 256)
    logged = []
    assert not planning._holds_the_state(fsdp_only, built, built.plan, logged.append)
    [line] = logged
    assert float(line.split("need ")[1].split(" GiB")[0]) > 12 * 114e9 / 2**30
    assert planning._holds_the_state(spec_rule, built, built.plan, logged.append)


def test_a_candidate_s_program_names_its_spec_file_and_shows_jax_the_target_s_devices():
    """A candidate (as `--write` records it) is a rule without flags: its CPU program still asks for its 8 fake
    devices, as the backend's own cpu-8 rule's does."""
    rule = candidate_rule("cpu-8", {"mesh": {"fsdp": 8}, "microbatch": 1, "remat": "full"})
    source = build(ROOT / "axgen/specs/llama_tiny.py", "cpu-8", rule).source
    assert "# Generated by axgen" in source and " from specs/llama_tiny.py for target cpu-8." in source
    assert '"spec": "specs/llama_tiny.py"' in source
    assert 'COMPILER_FLAGS = {"XLA_FLAGS": ("--xla_force_host_platform_device_count=8",)}' in source
    assert plan_for(load_spec(ROOT / "axgen/specs/llama_tiny.py"), "cpu-16").xla_flags == (
        "--xla_force_host_platform_device_count=16",
    )
    assert plan_for(load_spec(ROOT / "axgen/specs/llama_tiny.py"), "cpu-1").xla_flags == ()


def _code(source: str) -> list[str]:
    """A program's lines without comments: a candidate's names `axgen plan` where the spec's names its rule."""
    return [
        line.split("  #")[0].rstrip() for line in source.splitlines() if not line.lstrip().startswith("#")
    ]


def test_every_row_of_docs_aot_md_is_planned_in_one_compile_or_shown_to_have_no_fit_in_none():
    """Issue 27, part 8, on every spec x target docs/aot.md compiles. Where the row fits, the plan's first compile
    is that row's program (the target's own rule, the same code as generated/), so it finds a fit within 1 of 6
    compiles. Where it does not, no mesh of the search can hold the params and their AdamW moments, so none exists
    and the plan compiles nothing."""
    lines = (ROOT / "docs/aot.md").read_text().split("\n## ")[0].splitlines()
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    rows = {
        (cells["spec"], cells["target"]): cells for cells in (dict(zip(table[0], row)) for row in table[1:])
    }
    for spec_file in sorted(p for p in (ROOT / "axgen/specs").glob("*.py") if p.name != "__init__.py"):
        spec = load_spec(spec_file)
        for target in spec.targets:
            assert (spec.name, target) in rows, f"docs/aot.md has no row for {spec.name} on {target}"
            plan = plan_for(spec, target)
            if rows.pop((spec.name, target))["fits"] == "yes":
                own = planning.own_candidate(spec, plan)
                candidate = build(spec_file, target, candidate_rule(target, own.fields())).source
                assert _code(candidate) == _code(
                    default_output(spec_file, target, ROOT / "generated").read_text()
                )
            else:
                built = build(spec_file, target)
                meshes = planning._meshes(spec, plan, built)
                assert not any(planning._holds_the_state(m, built, plan, print) for m in meshes), target
    assert not rows, f"docs/aot.md has rows of no spec's target: {sorted(rows)}"
