"""Quantized routed experts: runtime.int8_ragged_dot / fp8_ragged_dot stay within the dense quantized dots' error
bounds with one weight scale per expert, their gradients pass straight through, a tiny MoE trains with quantized
experts about as well as without, and each target's lowering says which products run quantized and how."""

import concurrent.futures
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axgen.build import build, lowered
from axgen.cli import main as axgen
from axgen.files import write_atomically
from axgen.interop import load_program
from axgen.ir import from_spec
from axgen.loader import load_spec
from axgen.passes import run_passes
from axgen.runtime import fp8_ragged_dot, int8_ragged_dot
from axgen.spec import MeshRule
from tests.conftest import ROOT, STEP_LINE, moe_calls
from tests.test_quantize import train_losses
from tests.test_targets_on_cpu import run_main

NAMES = itertools.count()
GROUPS = np.array([70, 0, 81, 20])  # an empty group, and 29 rows after the last group
ROWS, IN, OUT = 200, 64, 48


def operands(seed):
    keys = jax.random.split(jax.random.key(seed), 2)
    x = np.asarray(jax.random.normal(keys[0], (ROWS, IN)))
    # Each expert's weights at its own size, so one scale for them all would lose the small ones.
    w = (
        np.asarray(jax.random.normal(keys[1], (len(GROUPS), IN, OUT)))
        * np.array([0.05, 1, 0.01, 0.2])[:, None, None]
    )
    return x, w


def expert_of_rows():
    """Each row's expert, -1 after the last group."""
    return np.concatenate([np.repeat(np.arange(len(GROUPS)), GROUPS), -np.ones(ROWS - GROUPS.sum(), int)])


def exact(x, w):
    expert = expert_of_rows()
    out = np.zeros((ROWS, OUT))
    for e in range(len(GROUPS)):
        out[expert == e] = x[expert == e].astype(np.float64) @ w[e].astype(np.float64)
    return out


def per_row(w_of_expert):
    """An expert's [experts, ...] array as each row's, zero after the last group."""
    expert = expert_of_rows()
    return np.where((expert >= 0)[:, None], w_of_expert[np.maximum(expert, 0)], 0)


def test_int8_error_is_within_the_dense_bound_with_one_scale_per_expert_channel():
    x, w = operands(0)
    got = np.asarray(int8_ragged_dot(jnp.asarray(x), jnp.asarray(w), jnp.asarray(GROUPS, jnp.int32)))
    want = exact(x, w)
    x_scale = np.abs(x).max(axis=1, keepdims=True) / 127  # [rows, 1]
    w_scale = per_row(np.abs(w).max(axis=1) / 127)  # [rows, out]: each row's expert's channel scales
    w_abs = np.stack([np.abs(w[max(e, 0)]) * (e >= 0) for e in expert_of_rows()])  # [rows, in, out]
    bound = (
        np.abs(x) @ np.ones((IN, 1)) * w_scale / 2
        + np.einsum("ri,rio->ro", np.broadcast_to(x_scale, x.shape), w_abs) / 2
        + x_scale * w_scale * IN / 4
    )
    assert np.all(np.abs(got - want) <= bound * (1 + 1e-5) + 1e-6)
    assert np.abs(got - want).max() > 0, "an exact result means nothing was quantized"
    assert np.all(got[GROUPS.sum() :] == 0)
    # The smallest expert keeps its precision: its own scales, not the largest expert's.
    small = expert_of_rows() == 2
    assert np.linalg.norm(got[small] - want[small]) < 0.02 * np.linalg.norm(want[small])


def test_fp8_error_is_within_the_dense_bound_with_one_scale_per_expert():
    x, w = operands(1)
    got = np.asarray(fp8_ragged_dot(jnp.asarray(x), jnp.asarray(w), jnp.asarray(GROUPS, jnp.int32)))
    want = exact(x, w)
    # Each operand is within 2^-4 relative or 2^-10 * its scale (max|.| / 448: the rows', each expert's) absolute.
    rel = 2.0**-4
    x_err = rel * np.abs(x) + 2.0**-10 * np.abs(x).max() / 448
    w_err = rel * np.abs(w) + 2.0**-10 * np.abs(w).max(axis=(1, 2), keepdims=True) / 448
    bound = exact(np.abs(x), w_err) + exact(x_err, np.abs(w) + w_err)
    assert np.all(np.abs(got - want) <= bound * (1 + 1e-5) + 1e-6)
    assert np.linalg.norm(got - want) < 0.1 * np.linalg.norm(want)
    small = expert_of_rows() == 2
    assert np.linalg.norm(got[small] - want[small]) < 0.1 * np.linalg.norm(want[small])


@pytest.mark.parametrize("matmul, tolerance", [(int8_ragged_dot, 0.01), (fp8_ragged_dot, 0.1)])
def test_gradients_pass_straight_through(matmul, tolerance):
    x, w = (jnp.asarray(a) for a in operands(2))
    groups = jnp.asarray(GROUPS, jnp.int32)
    cotangent = jax.random.normal(jax.random.key(3), (ROWS, OUT))
    got = jax.grad(lambda x, w: jnp.sum(matmul(x, w, groups) * cotangent), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(jax.lax.ragged_dot(x, w, groups) * cotangent), argnums=(0, 1))(x, w)
    # int8 differentiates the bf16 ragged_dot; fp8 multiplies e5m2 gradients by the e4m3 operands.
    for g, e in zip(got, want):
        assert np.linalg.norm(np.asarray(g) - np.asarray(e)) < tolerance * np.linalg.norm(np.asarray(e))
    assert np.all(np.asarray(got[0])[GROUPS.sum() :] == 0), "rows in no group take no gradient"


def variant(tmp_path, quantize_args, moe_args=""):
    path = tmp_path / f"qe_{next(NAMES)}.py"
    path.write_text(
        "from axgen.specs.moe_tiny import spec as base\n"
        "from axgen.spec import features as F\n"
        "rope, moe = base.features\n"
        f"spec = base.replace(features=[rope, moe.replace({moe_args}), F.quantize({quantize_args})])\n"
    )
    return path


EXPERTS = 'include=r"moe_layers/moe"'


@pytest.fixture(scope="module")
def unquantized_losses(corpus):
    return train_losses(load_program(ROOT / "generated/moe_tiny/cpu_1.py"), corpus)


# slow tier: 30 steps of two MoE programs, each compiled (30 s on 2 cores)
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_a_tiny_moe_with_quantized_experts_trains_about_as_well_as_without(
    tmp_path, corpus, dtype, unquantized_losses
):
    path = variant(tmp_path, f'dtype="{dtype}", emulate=True, {EXPERTS}')
    out = tmp_path / "program.py"
    write_atomically(out, build(path, "cpu-1").source)
    quantized = load_program(out)
    assert f'quantize="{dtype}"' in out.read_text()
    baseline = unquantized_losses
    losses = train_losses(quantized, corpus)
    assert losses[-5:].mean() < losses[0] - 1.5
    assert losses[-5:].mean() <= 1.1 * baseline[-5:].mean(), (losses[-5:], baseline[-5:])


def test_experts_are_quantized_only_when_include_names_them(tmp_path):
    default = build(variant(tmp_path, 'dtype="int8"'), "cpu-1")
    (experts,) = default.graph.nodes(op="moe")
    assert experts.attrs.quantize is None and [call["quantize"] for call in moe_calls(default.source)] == [
        "None"
    ]
    assert (
        "int8 dots: layers/{q,k,v,attn_out,gate,up,mlp_out} moe_layers/{q,k,v,attn_out}; routed experts unquantized"
        in default.source.splitlines()[4]
    )
    named = build(variant(tmp_path, f'dtype="int8", {EXPERTS}'), "cpu-1")
    assert (
        named.source.splitlines()[4]
        == "# Lowering: attention xla · int8 dots: moe_layers/moe; routed experts quantized (backends/cpu.py)"
    )


def test_each_target_lowers_quantized_experts_to_what_its_kernels_take(tmp_path):
    path = variant(tmp_path, EXPERTS)
    # TPU: megablox takes no int8, XLA's ragged_dot does.
    tpu = build(path, "tpu-v5e-8")
    (experts,) = tpu.graph.nodes(op="moe")
    assert (experts.attrs.quantize, experts.attrs.grouped_matmul) == ("int8", "ragged_dot")
    assert (
        "# XLA's ragged_dot: megablox_gmm: megablox.gmm takes bfloat16 or float32 operands only, and these experts are int8.\n"
        in tpu.source
    )
    assert 'quantize="int8"' in tpu.source and "GROUPED_MATMUL" not in tpu.source
    # H100, every expert on every device: XLA's ragged_dot would multiply each row by all 4; bf16 on the kernel.
    gpu = build(path, "gpu-h100-8")
    (experts,) = gpu.graph.nodes(op="moe")
    assert (experts.attrs.quantize, experts.attrs.grouped_matmul) == (None, "mosaic_gpu")
    why = "ragged_dot_mgpu takes no int8 or fp8 operands, and XLA's ragged_dot here multiplies each row by all 4 experts a device holds"
    assert experts.attrs.quantize_why == why and f"# Experts unquantized: {why}.\n" in gpu.source
    assert f"no quantized dots; routed experts unquantized ({why})" in gpu.source.splitlines()[4]
    # One expert per device: fp8 by XLA's ragged_dot (1.51 ms against the kernel's 2.45 on an H200).
    rule = MeshRule("gpu-h100-8", {"expert": 4, "fsdp": 2}, why="one expert per device")
    graph, _, _ = lowered(load_spec(path).replace(mesh_rules=[rule]), "gpu-h100-8")
    (experts,) = graph.nodes(op="moe")
    assert (experts.attrs.quantize, experts.attrs.grouped_matmul) == ("fp8", "ragged_dot")
    assert (
        experts.attrs.grouped_matmul_why
        == "mosaic_gpu: ragged_dot_mgpu takes no int8 or fp8 operands, and these experts are fp8"
    )


def test_the_lowered_graph_shows_the_choice(tmp_path, capsys):
    path = variant(tmp_path, EXPERTS)
    assert axgen(["graph", str(path), "--target", "tpu-v5e-8", "--after", "lowering"]) == 0
    (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("  moe = moe(")]
    assert "grouped_matmul_why=megablox_gmm: megablox.gmm takes bfloat16 or float32 operands only" in line
    assert "quantize=int8" in line


@pytest.mark.parametrize(
    "moe_args, quantize_args, message",
    [
        (
            "",
            f'dtype="fp8", scaling="delayed", emulate=True, {EXPERTS}',
            "include selects moe_layers/moe, and the routed experts' products keep no amax history: use scaling='current'",
        ),
        (
            "capacity_factor=1.25",
            f'dtype="int8", {EXPERTS}',
            "include selects moe_layers/moe, whose capacity-factor experts have no quantized form (the dropless ones do)",
        ),
    ],
    ids=["delayed", "capacity"],
)
def test_experts_quantize_cannot_honour_exit_2_in_one_line(
    tmp_path, capsys, moe_args, quantize_args, message
):
    path = variant(tmp_path, quantize_args, moe_args)
    out = tmp_path / "out.py"
    assert axgen(["build", str(path), "--target", "cpu-8", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(message) and len(err.splitlines()) == 1
    assert not out.exists()


def test_the_experts_node_after_the_pass_and_after_each_targets_lowering(tmp_path, snapshot):
    spec = load_spec(variant(tmp_path, EXPERTS))
    graph = from_spec(spec)
    run_passes(graph, spec.features)
    stages = {"after quantize": graph}
    for target in ("cpu-1", "tpu-v5e-8", "gpu-h100-8"):
        stages[f"{target} after lowering"] = lowered(spec, target)[0]
    # Without the provenance comment, which names the spec's temporary file.
    lines = {
        stage: [line.split("  # ")[0] for line in g.dump().splitlines() if line.startswith("  moe = moe(")]
        for stage, g in stages.items()
    }
    assert lines == snapshot


# slow tier: two processes, one of 8 devices and one of 1, each compiling (34 s on 2 cores)
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantized_experts_split_over_devices_train_as_on_one_device(tmp_path, corpus, dtype):
    """Each device computes the rows of its own experts (the others sort after its last group) under the MoE's
    shard_map, which checks the mesh axes values vary over: with the experts split four ways and the batch two, the
    program's losses are the one-device program's."""
    path = tmp_path / "split_experts.py"
    path.write_text(
        "from axgen.specs.moe_tiny import spec as base\n"
        "from axgen.spec import MeshRule, features as F\n"
        f"spec = base.replace(features=[*base.features, F.quantize(dtype='{dtype}', emulate=True,"
        " include=r'moe_layers/moe')],\n"
        "    mesh_rules=[MeshRule('cpu-8', {'data': 2, 'expert': 4}, why='one expert per device')])\n"
    )
    program = tmp_path / "program.py"
    write_atomically(program, build(path, "cpu-8").source)
    assert f'quantize="{dtype}"' in program.read_text()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sharded_log, single_log = pool.map(
            lambda single: run_main(program, 8, single, corpus, tmp_path / f"single_{single}"), (False, True)
        )
    assert "on 8 devices" in sharded_log and "on 1 devices" in single_log
    sharded = [float(loss) for _, loss in STEP_LINE.findall(sharded_log)]
    single = [float(loss) for _, loss in STEP_LINE.findall(single_log)]
    assert len(sharded) == len(single) == 3
    # Sharded matmuls add in another order, and fp8 scales each device's rows by their own max: values move across
    # rounding steps (1/127 of a scale for int8, 2^-4 relative for e4m3). Within 1e-3, where an expert's rows lost
    # or a weight gradient not summed over the data axis would move the loss by far more.
    np.testing.assert_allclose(sharded, single, rtol=1e-3)
