"""`axgen aot` compiles the emitted train step for chips this machine does not have: TPU through libtpu, H100
through the CUDA plugin, Trainium on fake CPU devices. Exit 1, with the figure, when a program does not fit.
"""

import json

import pytest

from axgen.analysis.aot import Report, markdown
from axgen.build import build
from axgen.cli import main as axgen
from axgen.ir import cost
from tests.conftest import PROGRAM_ENV, ROOT

PROGRAM_ENV_WITHOUT_FRACTION = {k: v for k, v in PROGRAM_ENV.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}

TINY = str(ROOT / "axgen/specs/llama_tiny.py")


def aot(capsys, *args):
    code = axgen(["aot", *args, "--json"])
    captured = capsys.readouterr()
    reports = [json.loads(line) for line in captured.out.splitlines() if line.startswith("{")]
    return code, reports, captured.err


def linear_flops_per_device(target, recomputed_roles=()):
    """From the graph: 6 FLOPs per multiply-add of each projection per token, plus 2 for the forward of those
    whose role the remat policy recomputes; the device's share of one step's tokens."""
    built = build(TINY, target)
    per_token = 0.0
    for node in built.graph.nodes():
        if node.op in ("linear", "lm_head"):
            flops = cost._flops(built.graph, node, built.spec.train.seq_len) * cost._repeat(built.graph, node)
            per_token += flops * (4 / 3 if node.attrs.role in recomputed_roles else 1)
    return per_token * built.spec.train.global_batch * built.spec.train.seq_len / built.plan.num_devices


# slow tier: each needs a chip's compiler (make test-slow installs them) and compiles for 10-25 s on 2 cores
@pytest.mark.slow
def test_tpu_program_compiles_for_a_v5e_slice_with_the_splash_kernel(capsys, tmp_path):
    code, [report], err = aot(capsys, TINY, "--target", "tpu-v5e-8", "--dump-to", str(tmp_path / "dumps"))
    assert code == 0 and report["fits"]
    # --dump-to: XLA's dumps of both steps, under the spec's and the target's names, and nothing else written.
    dumps = tmp_path / "dumps/llama_tiny/tpu_v5e_8"
    for step in ("train", "eval"):
        assert list(dumps.glob(f"*jit_{step}_step*after_optimizations-buffer-assignment.txt")), step
    assert [p.name for p in tmp_path.iterdir()] == ["dumps"] and f"XLA's dumps: {tmp_path / 'dumps'}" in err
    assert report["compiled_for"] == "8 x TPU v5e (libtpu topology v5e:2x4)"
    assert 0 < report["peak_bytes"] < report["hbm_bytes"] == 16 * 1024**3
    assert report["kernels"].get("tpu_custom_call", 0) >= 2, "splash attention forward and backward"
    assert report["collectives"].get("all-gather", 0) > 0, "fsdp gathers weights"
    assert report["xla_flops_per_device"] > 0 and report["flops_per_device"] > 0
    # Its matmuls (TPU spells them as convolutions), each layer and microbatch counted: the weights' 6 FLOPs per
    # multiply-add, and the forward of the MLP's gate and up again (v5e's save_dots_except_mlp recomputes them to
    # rebuild the activation; the down projection's output is not needed for the backward pass).
    assert report["dot_flops"] == linear_flops_per_device("tpu-v5e-8", recomputed_roles=("mlp_in",))


@pytest.mark.slow
def test_h100_program_compiles_through_the_cuda_plugin_with_cudnn_attention(capsys):
    code, [report], _ = aot(capsys, TINY, "--target", "gpu-h100-8")
    assert code == 0 and report["fits"]
    assert report["compiled_for"] == "8 x NVIDIA H100 SXM (CUDA plugin topology 1x1x8)"
    # The document mask reaches cuDNN's fused attention as a bias.
    assert {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"} <= set(report["kernels"])
    assert report["xla_flops_per_device"] is None, "XLA counts no FLOPs on GPU; the analytic figure stands"
    assert report["dot_flops"] == linear_flops_per_device("gpu-h100-8"), "save_dots recomputes no matmul"
    # The fit is judged against what the program's allocator takes: 95% of the 79.1 GiB CUDA reports.
    assert report["usable_bytes"] == int(0.95 * 84_942_979_072) < report["hbm_bytes"]


GPU_PROGRAM = ROOT / "generated/llama_tiny/gpu_h100_8.py"
RUNTIME = (
    "import os, sys; sys.path.insert(0, sys.argv[1]); import gpu_h100_8; "
    "from axgen.runtime.program import Program; from axgen.runtime.run import configure_jax, parse_args; "
    "program = Program.from_module(gpu_h100_8); "
    "configure_jax(program, parse_args(program, ['--data', '.', '--run-dir', '.'])); "
    "print(program.memory_fraction, os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])"
)


@pytest.mark.parametrize(("users", "allocator"), [(None, "0.95"), ("0.5", "0.5")])
def test_gpu_program_gives_its_allocator_the_share_aot_checks_unless_the_user_says(
    users, allocator, monkeypatch
):
    from tests.conftest import python_result

    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": users} if users else {}
    monkeypatch.setattr("tests.conftest.PROGRAM_ENV", {**PROGRAM_ENV_WITHOUT_FRACTION, **env})
    result = python_result("-c", RUNTIME, str(GPU_PROGRAM.parent))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["0.95", allocator]


# slow tier: a deviceless compile of an MoE or multi-pass program for the chips (20-30 s on 2 cores)
@pytest.mark.slow
def test_h100_moe_program_compiles_with_the_mosaic_gpu_grouped_matmul_forward_and_backward(capsys):
    code, [report], _ = aot(capsys, str(ROOT / "axgen/specs/moe_tiny.py"), "--target", "gpu-h100-8")
    assert code == 0 and report["fits"]
    # In the MoE layers' scan body: three expert products forward, and for each the rows' and the weights'
    # gradient. None is run again in the backward pass: remat save_dots keeps the products by name.
    assert report["kernels"].get("mosaic_gpu_v2", 0) == 9


# slow tier: a deviceless compile of an MoE or multi-pass program for the chips (20-30 s on 2 cores)
@pytest.mark.slow
@pytest.mark.parametrize("passes", [2, 4])
def test_gradients_cross_between_slices_once_a_step_however_many_passes_it_takes(tmp_path, capsys, passes):
    """The program compiles on a hybrid mesh of 2 slices, whose slices multiply `data`. Each slice sums its passes'
    gradients apart; they meet over the data-centre network once, after the last pass: the cross-slice transfers
    per step are the same for 2 passes as for 4 (summing over slices inside each pass made 71 a step at 4 passes,
    16 per layer scan)."""
    spec = tmp_path / "two_slices.py"
    spec.write_text(
        "from axgen.spec import MeshRule\nfrom axgen.specs.llama_tiny import spec as tiny\n"
        f"spec = tiny.replace(train=tiny.train.replace(global_batch={8 * passes}), mesh_rules=[MeshRule("
        "'tpu-v5e-4x2', {'fsdp': -1}, microbatch=1, why='one sequence per chip per pass')])\n"
    )
    code, [report], _ = aot(capsys, str(spec), "--target", "tpu-v5e-4x2")
    assert code == 0 and report["grad_accum_steps"] == passes
    assert report["compiled_for"] == "8 x TPU v5e (libtpu topology 2 slices of v5e:2x2)"
    assert report["mesh"] == {"data": 2, "stage": 1, "fsdp": 4, "expert": 1, "context": 1, "model": 1}
    # The reduction of the gradients, one transfer per group of arrays XLA combines, and the step's metrics.
    assert report["cross_slice"] == {"ALL_REDUCE": 9}


# slow tier: a deviceless compile of an MoE or multi-pass program for the chips (20-30 s on 2 cores)
@pytest.mark.slow
def test_h100_data_parallel_groups_sum_their_passes_apart_with_cudnn_attention(tmp_path, capsys):
    """data=2 x fsdp=4 over two passes: the step runs its passes inside a shard_map manual over `data`, where cuDNN's
    custom partitioning failed ("'GSPMDSharding' object has no attribute 'spec'": llama3-8b on gpu-h100-64, data=8
    fsdp=8, did not compile); each device now runs the kernel on its own rows and heads."""
    spec = tmp_path / "data_parallel.py"
    spec.write_text(
        "from axgen.spec import MeshRule\nfrom axgen.specs.llama_tiny import spec as tiny\n"
        "spec = tiny.replace(mesh_rules=[MeshRule('gpu-h100-8', {'data': 2, 'fsdp': 4}, microbatch=1, why='dp')])\n"
    )
    code, [report], _ = aot(capsys, str(spec), "--target", "gpu-h100-8")
    assert code == 0 and report["mesh"] == {
        "data": 2,
        "stage": 1,
        "fsdp": 4,
        "expert": 1,
        "context": 1,
        "model": 1,
    }
    assert report["grad_accum_steps"] == 2
    assert {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"} <= set(report["kernels"])


def test_trainium_program_compiles_on_fake_cpu_devices_with_its_mesh(capsys):
    code, [report], _ = aot(capsys, TINY, "--target", "trn2-16")
    assert code == 0 and report["compiled_for"] == "16 x AWS Trainium2 emulated by 16 fake CPU devices"
    assert report["mesh"] == {"data": 1, "stage": 1, "fsdp": 4, "expert": 1, "context": 1, "model": 4}
    assert report["grad_accum_steps"] == 2 and report["microbatch"] == 2


# slow tier: a deviceless compile of an MoE or multi-pass program for the chips (20-30 s on 2 cores)
@pytest.mark.slow
def test_expert_parallel_moe_compiles_for_tpu_with_ragged_matmul_kernels(tmp_path, capsys):
    spec = tmp_path / "specs" / "moe_ep.py"
    spec.parent.mkdir()
    spec.write_text(
        "from axgen.spec import MeshRule\nfrom axgen.specs.moe_tiny import spec as moe\n"
        "spec = moe.replace(mesh_rules=[MeshRule('tpu-.*', {'fsdp': 2, 'expert': 2, 'model': 2}, why='ep')])\n"
    )
    code, [report], _ = aot(capsys, str(spec), "--target", "tpu-v5e-8")
    assert (
        code == 0
        and report["fits"]
        and report["mesh"] == {"data": 1, "stage": 1, "fsdp": 2, "expert": 2, "context": 1, "model": 2}
    )
    dense_kernels = aot(capsys, TINY, "--target", "tpu-v5e-8")[1][0]["kernels"]["tpu_custom_call"]
    assert report["kernels"]["tpu_custom_call"] > dense_kernels, "ragged matmuls lower to Pallas kernels"
    assert report["collectives"].get("reduce-scatter", 0) > 0, "expert outputs summed back to their tokens"


@pytest.mark.slow
def test_a_program_that_does_not_fit_exits_1_with_the_figure(tmp_path, capsys):
    spec = tmp_path / "specs" / "wide_vocab.py"
    spec.parent.mkdir()
    spec.write_text(
        # Embedding and head of 16M x 128: 15.3 GiB in float32 before their gradients and Adam moments, on a 16 GiB
        # chip. (A 4M vocabulary did not fit by its whole logits alone, which the fused loss never holds.)
        "from axgen.specs.llama_tiny import spec as tiny\nspec = tiny.replace(vocab_size=16_000_000, targets=['tpu-v5e-1'])\n"
    )
    code = axgen(["aot", str(spec)])
    out = capsys.readouterr().out
    assert code == 1
    assert "does not fit 16.0 GiB HBM: RESOURCE_EXHAUSTED" in out and "exceeds available HBM" in out


def test_report_table_says_what_fits():
    common = dict(
        spec="m",
        compiled_for="8 x TPU v5e",
        grad_accum_steps=4,
        microbatch=1,
        compile_seconds=3.0,
        hbm_bytes=16 * 1024**3,
        usable_bytes=16 * 1024**3,
    )
    fits = Report(
        **common,
        target="tpu-v5e-8",
        mesh={"data": 1, "fsdp": 8},
        fits=True,
        peak_bytes=9 * 1024**3,
        eval_peak_bytes=3 * 1024**3,
    )
    refused = Report(
        **common,
        target="tpu-v5e-1",
        mesh={"data": 1},
        fits=False,
        peak_bytes=None,
        out_of_memory="RESOURCE_EXHAUSTED: ... (41.98G) exceeds available HBM (15.75G)",
    )
    table = markdown([fits, refused], ["specs/x.py on cpu-8: the compile failed: ValueError: boom"], "cmd")
    assert (
        "| m | tpu-v5e-8 | 8 x TPU v5e | fsdp=8 | 4 x 1 | 9.00 GiB / 16.0 GiB | 3.00 GiB | yes | 3s |"
        in table
    )
    assert (
        "| m | tpu-v5e-1 | 8 x TPU v5e | 1 device | 4 x 1 | over (compiler refused) / 16.0 GiB | - | **no** | 3s |"
        in table
    )
    assert "- specs/x.py on cpu-8: the compile failed: ValueError: boom" in table


def test_a_peak_over_the_usable_share_does_not_fit_though_under_the_hbm():
    hbm = 84_942_979_072
    report = Report(
        spec="m",
        target="gpu-h100-1",
        compiled_for="1 x NVIDIA H100 SXM",
        mesh={"fsdp": 1},
        grad_accum_steps=1,
        microbatch=1,
        compile_seconds=1.0,
        hbm_bytes=hbm,
        usable_bytes=int(0.95 * hbm),
        fits=False,
        peak_bytes=int(0.97 * hbm),
        argument_bytes=0,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=int(0.97 * hbm),
        flops_per_device=1.0,
        eval_peak_bytes=int(0.5 * hbm),
    )
    assert "peak 76.74 GiB of 75.2 GiB usable (95% of 79.1 GiB HBM): DOES NOT FIT" in report.text()
    assert (
        "evaluation (--eval-every), same batch in the same microbatches: peak 39.55 GiB: fits"
        in report.text()
    )


@pytest.mark.parametrize("args", [["--target", "gpu-a100-8"], [], ["--dump-to", "{here}"]])
def test_bad_aot_requests_are_one_line(capsys, args, tmp_path):
    (tmp_path / "notes.txt").write_text("somebody's\n")
    args = [arg.format(here=tmp_path) for arg in args]
    spec = [] if not args else [TINY]
    assert axgen(["aot", *spec, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("axgen: error: ") and len(err.splitlines()) == 1
    if "--dump-to" in args:  # an existing folder is replaced only with --force, and nothing was compiled
        assert err == f"axgen: error: {tmp_path}: already exists (pass --force to replace it)"
        assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


# Slices as MaxText's accelerator_to_spec_map gives them to libtpu (its names count v5p TensorCores: its v5p-128
# is 64 chips): (axgen target, libtpu topology, wraparound per dimension).
WIRING = [
    ("tpu-v5p-32", "v5p:2x4x4", (False, False, False)),
    ("tpu-v5p-64", "v5p:4x4x4", (True, True, True)),
    ("tpu-v5p-256", "v5p:4x8x8", (True, True, True)),
    ("tpu-v5e-64", "v5e:8x8", (False, False, False)),
    ("tpu-v5e-128", "v5e:8x16", (False, True, False)),
    ("tpu-v5e-256", "v5e:16x16", (True, True, False)),
    ("tpu-v6e-256x2", "v6e:16x16", (True, True, False)),
]


@pytest.mark.parametrize(("target", "topology", "wrap"), WIRING, ids=[w[0] for w in WIRING])
def test_a_slice_compiles_with_the_wraparound_links_its_chips_have(target, topology, wrap):
    from axgen.backends import family_for
    from axgen.loader import load_spec

    family = family_for(load_spec(TINY), target)
    per_slice, _ = family.parse(target)
    assert (family.topology(per_slice), family.topology_wrap(family.topology(per_slice))) == (topology, wrap)


# slow tier: a deviceless compile for the chips (12 s on 2 cores) whose topology's links wrap around
@pytest.mark.slow
def test_the_report_names_the_wraparound_links(tmp_path, capsys):
    spec = tmp_path / "wide.py"
    spec.write_text(
        "from axgen.specs.llama_tiny import spec as tiny\n"
        "spec = tiny.replace(train=tiny.train.replace(global_batch=64), targets=['tpu-v5p-64'])\n"
    )
    code, [report], _ = aot(capsys, str(spec), "--target", "tpu-v5p-64")
    assert code == 0 and report["compiled_for"].endswith("(libtpu topology v5p:4x4x4, wraparound in x y z)")


# slow tier: a deviceless compile of an MoE or multi-pass program for the chips (20-30 s on 2 cores)
@pytest.mark.slow
def test_all_to_all_experts_compile_for_tpu_with_ragged_all_to_all(tmp_path, capsys):
    """moe_dispatch='all_to_all' on TPU, bounded by a receive capacity: each token copy goes to its expert's device
    by ragged-all-to-all and comes back by another, in the forward and again in the backward."""
    spec = tmp_path / "specs" / "moe_a2a.py"
    spec.parent.mkdir()
    spec.write_text(
        "from axgen.spec import MeshRule\nfrom axgen.specs.moe_tiny import spec as moe\n"
        "rule = MeshRule('.*', {'fsdp': 2, 'expert': 4}, why='ep', moe_dispatch='all_to_all',"
        " moe_receive_capacity=1.0)\n"
        "spec = moe.replace(mesh_rules=[rule])\n"
    )
    code, [report], _ = aot(capsys, str(spec), "--target", "tpu-v5e-8")
    assert (
        code == 0
        and report["fits"]
        and report["mesh"] == {"data": 1, "stage": 1, "fsdp": 2, "expert": 4, "context": 1, "model": 1}
    )
    assert report["collectives"].get("ragged-all-to-all", 0) >= 4, report["collectives"]
    assert report["collective_bytes"]["ragged-all-to-all"] > 0


# slow tier: a deviceless compile of an MoE or multi-pass program for the chips (20-30 s on 2 cores)
@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
def test_expert_parallel_moe_compiles_for_h100_with_the_mosaic_gpu_kernel_on_either_dispatch(
    tmp_path, capsys, dispatch
):
    """Experts split over H100s: the Mosaic GPU kernel's outputs and gradients name no mesh axes, and its
    custom_vjp once failed shard_map's varying-axes check (weights' gradient bfloat16[1,384,128] against
    bfloat16[1,384,128]{V:expert}); the program types them as varying as its inputs."""
    spec = tmp_path / "specs" / f"moe_ep_{dispatch}.py"
    spec.parent.mkdir()
    spec.write_text(
        "from axgen.spec import MeshRule\nfrom axgen.specs.moe_tiny import spec as moe\n"
        f"rule = MeshRule('.*', {{'fsdp': 2, 'expert': 4}}, why='ep', moe_dispatch={dispatch!r})\n"
        "spec = moe.replace(mesh_rules=[rule])\n"
    )
    code, [report], _ = aot(capsys, str(spec), "--target", "gpu-h100-8")
    assert (
        code == 0
        and report["fits"]
        and report["mesh"] == {"data": 1, "stage": 1, "fsdp": 2, "expert": 4, "context": 1, "model": 1}
    )
    assert report["kernels"].get("mosaic_gpu_v2", 0) == 9, report["kernels"]
    moved = "ragged-all-to-all" if dispatch == "all_to_all" else "reduce-scatter"
    assert report["collectives"].get(moved, 0) > 0, report["collectives"]
