"""The MoE experts' grouped matmul per target: H100 programs multiply by jax's Mosaic GPU kernels (a custom_vjp whose
backward runs the transposed kernel for the weights' gradient), with tiles the backend chose for the experts'
widths; other chips, and widths the kernel cannot tile, keep XLA's ragged_dot, and the emitted code says why.

The kernels (runtime.grouped_matmul) run here under Pallas's GPU interpreter on CPU, and must give ragged_dot's
values and gradients.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import config as jax_config
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

from axgen import runtime
from axgen.backends import gpu
from axgen.build import build, lowered
from axgen.interop import load_program
from axgen.loader import load_spec
from axgen.runtime import moe
from axgen.spec import MeshRule
from tests.conftest import ROOT, moe_calls, moe_options

MIXTRAL, QWEN_MOE = ROOT / "axgen/specs/mixtral_8x7b.py", ROOT / "axgen/specs/qwen2_moe_a2_7b.py"
PROGRAM = ROOT / "generated/features_tiny/gpu_h100_8.py"  # embed 128 -> mlp 384 experts, gated shared expert
TPU_PROGRAM = ROOT / "generated/features_tiny/tpu_v5e_8.py"


def test_tiles_are_the_measured_ones_where_the_widths_take_them_and_smaller_ones_elsewhere():
    assert gpu.grouped_matmul_tiles(4096, 14336) == {
        "block_m": 128,
        "block_n": 128,
        "block_k": 64,
        "max_concurrent_steps": 4,
        "grid_block_n": 4,
    }
    assert gpu.grouped_matmul_tiles(2048, 1408)["grid_block_n"] == 1  # 1408 = 11 x 128
    assert gpu.grouped_matmul_tiles(192, 320)["block_m"] == 64
    assert (
        gpu.grouped_matmul_tiles(128, 200) == "embed=128 and mlp=200 per device are not both multiples of 64"
    )


def test_h100_programs_use_mosaic_gpu_tpu_programs_megablox_and_cpu_programs_ragged_dot():
    mixtral = build(MIXTRAL, "gpu-h100-64").source
    assert "experts by mosaic_gpu" in mixtral.splitlines()[4]
    assert (
        'GROUPED_MATMUL_IMPL = "ragged_dot" if os.environ.get("AXGEN_XLA_KERNELS") == "1" else "mosaic_gpu"'
        in mixtral
    )
    # Each MoE layer passes the kernel its node was lowered to, with its tiles, and the remat names of its products.
    (call,) = moe_calls(mixtral)
    assert (call["kernel"], call["tiles"]) == ("GROUPED_MATMUL_IMPL", "GROUPED_MATMUL_TILES")
    assert call["checkpoint_names"] == "('mlp_in', 'mlp_out')"
    tpu = build(MIXTRAL, "tpu-v5p-256").source
    assert "experts by megablox_gmm" in tpu.splitlines()[4] and 'else "megablox_gmm"' in tpu
    assert '"tm": 512, "tk": 1024, "tn": 1024' in tpu
    assert moe_calls(tpu)[0]["kernel"] == "GROUPED_MATMUL_IMPL"
    cpu = build(MIXTRAL, "cpu-8").source
    assert "GROUPED_MATMUL" not in cpu and "megablox" not in cpu
    assert [(call["kernel"], call["tiles"], call["quantize"]) for call in moe_calls(cpu)] == [
        (repr("ragged_dot"), "None", "None")
    ]


def test_experts_the_kernel_cannot_tile_keep_ragged_dot_and_the_program_says_why(tmp_path):
    spec = tmp_path / "odd_experts.py"
    spec.write_text(
        "from axgen.specs.moe_tiny import spec as moe_tiny\n"
        "from axgen.spec import MLP\n"
        "spec = moe_tiny.replace(name='odd-experts', targets=['gpu-h100-8'],\n"
        "    decoder=moe_tiny.decoder.replace(mlp=MLP(hidden_dim=200, activation='swiglu')))\n"
    )
    source = build(spec, "gpu-h100-8").source
    assert (
        "    # XLA's ragged_dot: mosaic_gpu: embed=128 and mlp=200 per device are not both multiples of 64.\n"
        in source
    )
    assert (
        "GROUPED_MATMUL" not in source
        and moe_calls(source)[0]["kernel"] == repr("ragged_dot")
        and "experts by" not in source
    )


def test_tiles_are_chosen_for_the_widths_one_device_holds():
    rule = MeshRule("gpu-h100-8", {"model": 8}, why="experts' hidden units split eight ways")
    graph, _, _ = lowered(load_spec(MIXTRAL).replace(mesh_rules=[rule]), "gpu-h100-8")
    (experts,) = graph.nodes(op="moe")
    # 14336 / 8 = 1792 = 14 x 128 wide: a multiple of 2 x 128 columns, not of 4 x 128.
    assert dict(experts.attrs.tiles)["grid_block_n"] == 2


@pytest.fixture
def kernels_interpreted(monkeypatch):
    """Pallas's GPU interpreter for every Mosaic GPU kernel; the transposed kernel asks the first device for its
    SM count, which a CPU device does not have."""
    devices = jax.devices()
    monkeypatch.setattr(jax, "devices", lambda *args: [types.SimpleNamespace(core_count=132)] + devices[1:])
    jax_config.pallas_tpu_interpret_mode_context_manager.set_global(InterpretGPUParams())
    yield
    jax_config.pallas_tpu_interpret_mode_context_manager.set_global(None)


@pytest.fixture(scope="module")
def program():
    return load_program(PROGRAM)


def _grads(kernel, f, *args):
    """f's value and gradients with the experts' products by `kernel`, f taking the kernel as its last argument."""
    value, grads = jax.value_and_grad(
        functools.partial(f, kernel=kernel), argnums=tuple(range(len(args) - 1))
    )(*args)
    return jax.tree.map(lambda x: np.asarray(x, np.float32), (value, grads))


def _assert_close(kernel, xla):
    # bf16 inputs and outputs: the kernel accumulates in f32 and rounds once, XLA on CPU may round differently.
    for a, b in zip(jax.tree.leaves(kernel), jax.tree.leaves(xla)):
        np.testing.assert_allclose(a, b, atol=2**-7 * max(np.abs(b).max(), 1e-6))


def test_kernel_and_its_gradients_equal_ragged_dot_with_empty_groups_and_rows_after_the_last(
    program, kernels_interpreted
):
    keys = jax.random.split(jax.random.key(0), 3)
    rows = jax.random.normal(keys[0], (200, 128), jnp.bfloat16)
    weights = jax.random.normal(keys[1], (4, 128, 384), jnp.bfloat16) / 8
    cotangent = jax.random.normal(keys[2], (200, 384), jnp.float32)
    group_sizes = jnp.array([70, 0, 81, 20], jnp.int32)  # 171 rows in groups: the last 29 are in none

    def loss(rows, weights, group_sizes, kernel):
        out = runtime.grouped_matmul(
            rows, weights, group_sizes, kernel=kernel, tiles=program.GROUPED_MATMUL_TILES
        )
        assert out.shape == (200, 384)
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    kernel = _grads("mosaic_gpu", loss, rows, weights, group_sizes)
    xla = _grads("ragged_dot", loss, rows, weights, group_sizes)
    _assert_close(kernel, xla)
    assert np.abs(kernel[1][0][171:]).max() == 0 and np.abs(kernel[1][1][1]).max() == 0


# slow tier: the kernels interpreted on CPU inside a whole program's step (15-20 s on 2 cores)
@pytest.mark.slow
@pytest.mark.parametrize(
    "path, kernel, interpreted",
    [
        (PROGRAM, "mosaic_gpu", "kernels_interpreted"),
        (TPU_PROGRAM, "megablox_gmm", "tpu_kernels_interpreted"),
    ],
    ids=["h100", "tpu"],
)
def test_the_programs_experts_give_ragged_dots_loss_and_gradients_through_the_kernel(
    path, kernel, interpreted, request
):
    request.getfixturevalue(interpreted)
    program = load_program(path)
    params = jax.tree.map(
        lambda w: w.astype(jnp.bfloat16), program.init_params(jax.random.key(0))["moe_layers"]
    )
    layer = jax.tree.map(lambda w: w[0], params)
    x = jax.random.normal(jax.random.key(1), (2, 16, 128), jnp.bfloat16)
    logits = jax.random.normal(jax.random.key(2), (2, 16, 4), jnp.float32)
    # The program's own options for its MoE layer (routing, activation, tiles), the kernel swapped in below.
    options = moe_options(program)
    assert options.pop("kernel") == kernel
    calls = []
    grouped_matmul = moe.grouped_matmul

    def counted(*args, **kwargs):
        calls.append(kwargs["kernel"])
        return grouped_matmul(*args, **kwargs)

    def loss(x, w_gate, w_up, w_down, logits, kernel):
        out, aux = runtime.moe_dropless(x, logits, w_gate, w_up, w_down, **options, kernel=kernel)
        return jnp.sum(out.astype(jnp.float32) ** 2) + aux["load_balance_loss"]

    args = (x, layer["w_gate"], layer["w_up"], layer["w_down"], logits)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "grouped_matmul", counted)
        through_kernel = _grads(kernel, loss, *args)
    assert calls == [kernel] * 3, "each of the experts' three products goes through the grouped matmul"
    _assert_close(through_kernel, _grads("ragged_dot", loss, *args))


@pytest.fixture
def tpu_kernels_interpreted():
    jax_config.pallas_tpu_interpret_mode_context_manager.set_global(True)
    yield
    jax_config.pallas_tpu_interpret_mode_context_manager.set_global(None)


def test_megablox_and_its_gradients_equal_ragged_dot_with_rows_after_the_last_group(tpu_kernels_interpreted):
    program = load_program(TPU_PROGRAM)
    assert program.GROUPED_MATMUL_TILES == {"tm": 512, "tk": 128, "tn": 128}
    keys = jax.random.split(jax.random.key(0), 3)
    rows = jax.random.normal(keys[0], (256, 128), jnp.bfloat16)
    weights = jax.random.normal(keys[1], (4, 128, 384), jnp.bfloat16) / 8
    cotangent = jax.random.normal(keys[2], (256, 384), jnp.float32)
    group_sizes = jnp.array([70, 0, 81, 20], jnp.int32)  # the last 85 rows are in no group

    def loss(rows, weights, group_sizes, kernel):
        out = runtime.grouped_matmul(
            rows, weights, group_sizes, kernel=kernel, tiles=program.GROUPED_MATMUL_TILES
        )
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    kernel = _grads("megablox_gmm", loss, rows, weights, group_sizes)
    xla = _grads("ragged_dot", loss, rows, weights, group_sizes)
    _assert_close(kernel, xla)
    assert np.abs(kernel[1][0][171:]).max() == 0
