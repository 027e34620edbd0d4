"""Mixture of experts: HF Mixtral numerics, the auxiliary losses by hand, capacity dropping, mixed stacks, sharding."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axgen import runtime
from axgen.build import build
from axgen.cli import main as axgen
from axgen.files import write_atomically
from axgen.interop import hf_to_params, load_program
from axgen.ir import cost
from axgen.loader import load_spec
from axgen.spec import SpecError
from tests.conftest import ROOT, moe_calls, moe_options
from axgen.runtime import moe
from axgen.runtime.program import Program

FIXTURES = ROOT / "tests/fixtures"
MOE_TINY = ROOT / "axgen/specs/moe_tiny.py"


def program_for(tmp_path, spec_path, target="cpu-1", name="program"):
    out = tmp_path / f"{name}.py"
    write_atomically(out, build(spec_path, target).source)
    return load_program(out)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    fixture = np.load(FIXTURES / "hf_mixtral.npz")
    program = program_for(tmp_path_factory.mktemp("mixtral"), FIXTURES / "hf_mixtral_spec.py", name="mixtral")
    state_dict = {k: fixture[k] for k in fixture.files if k.startswith(("model.", "lm_head."))}
    return fixture, program, hf_to_params(state_dict, load_spec(FIXTURES / "hf_mixtral_spec.py"))


def test_forward_matches_hf_mixtral_logits(mixtral):
    fixture, program, params = mixtral
    config = json.loads(str(fixture["config"]))
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    logits = jax.jit(program.forward)(params, fixture["input_ids"])
    assert logits.dtype == np.float32
    np.testing.assert_allclose(np.asarray(logits), fixture["logits"], atol=1e-4, rtol=1e-4)


def load_balance_by_hand(router_logits, top_k):
    """Switch Transformer's loss for one layer: experts * sum_e(fraction of top-k picks of e * mean prob of e)."""
    probs = np.exp(router_logits - router_logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    num_tokens, num_experts = probs.shape
    picks = np.zeros(num_experts)
    for row in probs:
        picks[np.argsort(-row)[:top_k]] += 1
    return num_experts * np.sum(picks / num_tokens * probs.mean(0))


def test_auxiliary_losses_match_the_formulas_by_hand(mixtral):
    fixture, program, params = mixtral
    router_logits = fixture["router_logits"].astype(np.float64)  # [layers, batch * seq, experts], from HF
    _, aux = jax.jit(program.forward_with_aux)(params, fixture["input_ids"])
    per_layer = [load_balance_by_hand(layer, top_k=2) for layer in router_logits]
    np.testing.assert_allclose(float(aux["load_balance_loss"]), np.mean(per_layer), rtol=1e-5)
    z_loss = np.mean([np.mean(np.log(np.exp(layer).sum(-1)) ** 2) for layer in router_logits])
    np.testing.assert_allclose(float(aux["router_z_loss"]), z_loss, rtol=1e-5)
    # HF pools the layers' rows before the product; for one layer the two definitions agree.
    _, _, one_layer = runtime.route(
        jnp.asarray(router_logits[0], jnp.float32), moe_options(program)["routing"]
    )
    np.testing.assert_allclose(float(one_layer["load_balance_loss"]), per_layer[0], rtol=1e-5)
    assert 1.0 <= per_layer[0] <= 4.0  # top_k when balanced, num_experts when every token picks the same two


def test_loss_adds_the_weighted_auxiliary_losses(mixtral):
    fixture, program, params = mixtral
    tokens = jnp.concatenate([fixture["input_ids"], fixture["input_ids"][:, :1]], axis=1)
    loss, metrics = program.loss_fn(params, tokens)
    expected = (
        metrics["cross_entropy"] + 0.02 * metrics["load_balance_loss"]
    )  # router_z_loss_weight=0 in the spec
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-6)


def capacity_variant(tmp_path, capacity_factor, every=1):
    path = tmp_path / f"capacity_{capacity_factor}_{every}.py"
    path.write_text(
        "from axgen.specs.moe_tiny import spec as moe_tiny\n"
        "from axgen.spec import features as F\n"
        "moe = moe_tiny.feature('moe')\n"
        f"spec = moe_tiny.replace(features=[moe_tiny.feature('rope'), moe.replace(capacity_factor={capacity_factor}, every={every})])\n"
    )
    return program_for(tmp_path, path, name=path.stem)


def test_generous_capacity_drops_nothing_and_equals_dropless(tmp_path):
    dropless = program_for(tmp_path, MOE_TINY, name="dropless")
    roomy = capacity_variant(tmp_path, capacity_factor=2.0, every=2)  # 2 experts * 2 = every token fits
    params = dropless.init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
    logits, aux = jax.jit(roomy.forward_with_aux)(params, tokens)
    assert float(aux["dropped_fraction"]) == 0.0
    np.testing.assert_allclose(
        np.asarray(logits), np.asarray(jax.jit(dropless.forward)(params, tokens)), atol=1e-5
    )


def test_tight_capacity_drops_the_overflow_and_reports_it(tmp_path):
    program = capacity_variant(tmp_path, capacity_factor=0.5)
    x = jax.random.normal(jax.random.key(0), (2, 16, 8))
    router_logits = (
        jnp.zeros((2, 16, 4)).at[:, :, 0].set(5.0).at[:, :, 1].set(4.0)
    )  # all pick experts 0 and 1
    w = jax.random.normal(jax.random.key(1), (4, 8, 12))
    options = moe_options(program)
    mixtral = runtime.Routing(
        top_k=2,
        scoring="softmax",
        renormalize=True,
        routed_scale=None,
        n_group=None,
        topk_group=None,
        group_score=None,
        seq_balance_loss=False,
    )
    assert (options["routing"], options["capacity_factor"]) == (mixtral, 0.5)
    out, aux = runtime.moe_with_capacity(x, router_logits, w, w, w.transpose(0, 2, 1), **options)
    # capacity = ceil(2 * 16 * 0.5 / 4) = 4 slots per expert: 8 of the 32 picks per sequence survive.
    np.testing.assert_allclose(float(aux["dropped_fraction"]), 1 - 8 / 32)
    assert np.all(np.asarray(out[:, 4:]) == 0), "tokens past the first four lose both choices"
    assert np.all(np.abs(np.asarray(out[:, :4])) > 0)


def test_mixed_stack_alternates_dense_and_moe_layers():
    spec = load_spec(MOE_TINY)
    built = build(MOE_TINY, "cpu-1")
    assert {r.name: r.repeat for r in built.graph.blocks()} == {"layers": 2, "moe_layers": 2}
    assert (
        "runtime.moe_dropless(" in built.source
        and "def layers_group(x, p, positions, segment_ids):" in built.source
    )
    # 2 dense + 2 MoE layers: each MoE layer adds a router and 3 more copies of the MLP.
    dense = build(ROOT / "axgen/specs/llama_tiny.py", "cpu-1").graph
    mlp = 3 * spec.d_model * spec.decoder.mlp.hidden_dim
    assert cost.num_params(built.graph) == cost.num_params(dense) + 2 * (3 * mlp + spec.d_model * 4)


def test_moe_every_must_divide_the_layers(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(
        "from axgen.specs.moe_tiny import spec as moe_tiny\n"
        "spec = moe_tiny.replace(features=[moe_tiny.feature('moe').replace(every=3)])\n"
    )
    with pytest.raises(SpecError, match=r"bad.py:2: MoE.every=3 does not divide Decoder.num_layers=4"):
        load_spec(path)


def test_published_parameter_counts():
    assert cost.num_params(build(ROOT / "axgen/specs/llama2_7b.py", "cpu-8").graph) == 6_738_415_616
    assert cost.num_params(build(ROOT / "axgen/specs/mixtral_8x7b.py", "cpu-8").graph) == 46_702_792_704


def tpu_program(tmp_path):
    """moe_tiny as a TPU program: its experts' shard_map runs unchecked for megablox (check_vma=False); the
    kernel itself gives way to XLA's ragged_dot here on CPU."""
    source = build(MOE_TINY, "tpu-v5e-8").source
    assert "check_vma=False" in source and 'else "megablox_gmm"' in source
    out = tmp_path / "moe_tiny_tpu_v5e_8.py"
    write_atomically(out, source)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AXGEN_XLA_KERNELS", "1")
        program = load_program(out)
    program.COMPUTE_DTYPE = jnp.float32  # as the CPU program computes, so both meet the same tolerance
    return program


def one_device_inputs(program):
    return program.init_params(jax.random.key(1)), jax.random.randint(jax.random.key(2), (8, 17), 0, 256)


@pytest.fixture(scope="module")
def one_device_cpu_8():
    """generated/moe_tiny/cpu_8.py, its params, a batch, and its loss, metrics and gradients on one device: the
    reference every mesh of it is checked against, compiled once."""
    program = load_program(ROOT / "generated/moe_tiny/cpu_8.py")
    params, tokens = one_device_inputs(program)
    return program, params, tokens, jax.jit(jax.value_and_grad(program.loss_fn, has_aux=True))(params, tokens)


@pytest.mark.parametrize(
    "target, mesh_shape",
    [
        # slow tier: the TPU program below runs on the same mesh in the quick one
        pytest.param("cpu-8", (2, 1, 2, 2), id="data_expert_model", marks=pytest.mark.slow),
        pytest.param("cpu-8", (1, 2, 2, 2), id="fsdp_expert_model"),
        pytest.param("cpu-8", (1, 8, 1, 1), id="fsdp"),
        pytest.param("tpu-v5e-8", (2, 1, 2, 2), id="tpu_unchecked_data_expert_model"),
    ],
)
def test_sharded_moe_equals_one_device_in_loss_auxiliary_losses_and_gradients(
    target, mesh_shape, one_device_cpu_8, tmp_path
):
    """Each device routes its own tokens (with expert parallelism, its expert group's): the loss, the auxiliary
    losses (means over the whole batch, not one device's rows) and every gradient equal the one-device run."""
    if target == "cpu-8":
        program, params, tokens, ((loss, metrics), grads) = one_device_cpu_8
    else:
        program = tpu_program(tmp_path)
        params, tokens = one_device_inputs(program)
        (loss, metrics), grads = jax.jit(jax.value_and_grad(program.loss_fn, has_aux=True))(params, tokens)
    grad_fn = jax.value_and_grad(program.loss_fn, has_aux=True)
    axis_types = (jax.sharding.AxisType.Auto,) * 4
    mesh = jax.make_mesh(mesh_shape, ("data", "fsdp", "expert", "model"), axis_types=axis_types)
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, Program.from_module(program).param_shardings(mesh))
        if mesh.shape["expert"] > 1:
            assert placed["moe_layers"]["w_up"].sharding.spec[:2] == (None, "expert")
        (sharded_loss, sharded_metrics), sharded_grads = jax.jit(grad_fn)(placed, tokens)
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-5)
    for name in ("load_balance_loss", "router_z_loss"):
        np.testing.assert_allclose(sharded_metrics[name], metrics[name], rtol=1e-5, err_msg=name)

    def check(path, grad, expected):
        atol = 1e-5 * float(jnp.abs(expected).max())
        np.testing.assert_allclose(grad, expected, atol=atol, err_msg=jax.tree_util.keystr(path))

    jax.tree_util.tree_map_with_path(check, sharded_grads, grads)


@pytest.mark.parametrize("every", [2, 4])
def test_mixed_stack_runs_layers_in_order(tmp_path, every):
    """With every expert a copy of the dense MLP, an MoE layer computes what the dense layer did (the top-k
    weights sum to 1), so the mixed stack must equal the dense model whose layers it took, in order."""
    dense = load_program(ROOT / "generated/llama_tiny/cpu_1.py")
    path = tmp_path / f"every_{every}.py"
    path.write_text(
        "from axgen.specs.moe_tiny import spec as moe_tiny\n"
        f"spec = moe_tiny.replace(features=[moe_tiny.feature('rope'), moe_tiny.feature('moe').replace(every={every})])\n"
    )
    mixed = program_for(tmp_path, path, name=path.stem)
    params = dense.init_params(jax.random.key(0))
    layers = params["layers"]
    is_moe = np.arange(4) % every == every - 1  # the last layer of each group
    take = lambda rows: jax.tree.map(lambda w: w[rows], layers)  # noqa: E731
    moe_layers = take(is_moe)
    for key in ("w_gate", "w_up", "w_down"):
        moe_layers[key] = jnp.repeat(moe_layers[key][:, None], 4, axis=1)  # 4 identical experts
    moe_layers["router"] = jax.random.normal(jax.random.key(1), (int(is_moe.sum()), 128, 4))
    mixed_params = {**params, "layers": take(~is_moe), "moe_layers": moe_layers}
    assert ("regroup(" in Path(mixed.__file__).read_text()) == (every > 2)
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 256)
    np.testing.assert_allclose(
        np.asarray(mixed.forward(mixed_params, tokens)), np.asarray(dense.forward(params, tokens)), atol=2e-5
    )


def test_gemma_block_makes_the_routed_experts_geglu_like_the_dense_mlp():
    program = load_program(ROOT / "generated/features_tiny/cpu_1.py")  # moe, then gemma_block
    assert moe_options(program)["activation"] == "geglu"
    gate, up = jax.random.normal(jax.random.key(0), (2, 8, 16))
    expected = jax.nn.gelu(gate, approximate=True) * up
    np.testing.assert_allclose(runtime.expert_mlp(gate, up, activation="geglu"), expected, rtol=1e-6)


def expert_parallel(tmp_path, dispatch, target="cpu-8", receive_capacity=None, **moe):
    """moe_tiny on a mesh with its experts split 4 ways (data=2, expert=4), token copies moved by `dispatch`
    (bounded by `receive_capacity`); `moe` replaces fields of its F.moe."""
    spec = tmp_path / "specs" / f"moe_{dispatch}.py"
    spec.parent.mkdir(exist_ok=True)
    spec.write_text(
        "from axgen.spec import MeshRule\nfrom axgen.specs.moe_tiny import spec as moe\n"
        f"rule = MeshRule('.*', {{'data': 2, 'expert': 4}}, why='experts one per device', moe_dispatch={dispatch!r},"
        f" moe_receive_capacity={receive_capacity!r})\n"
        f"feature = moe.feature('moe').replace(**{moe!r})\n"
        "features = [feature if f.pass_name == 'moe' else f for f in moe.features]\n"
        "spec = moe.replace(mesh_rules=[rule], features=features)\n"
    )
    return spec


def test_lowering_picks_the_all_to_all_collective_the_target_compiles(tmp_path, capsys):
    """XLA:CPU has no ragged-all-to-all, so CPU programs send fixed blocks; TPU and GPU programs the ragged one.
    The choice is an attr `axgen graph --after lowering` shows, and the all-gather path stays the default."""
    spec = expert_parallel(tmp_path, "all_to_all")
    for target, collective in [
        ("cpu-8", "all_to_all"),
        ("tpu-v5e-8", "ragged_all_to_all"),
        ("gpu-h100-8", "ragged_all_to_all"),
    ]:
        source = build(spec, target).source
        assert [call["dispatch"] for call in moe_calls(source)] == [repr(collective)], target
        assert f"expert tokens by {collective}" in source
    assert axgen(["graph", str(spec), "--target", "tpu-v5e-8", "--after", "lowering"]) == 0
    assert "dispatch=ragged_all_to_all" in capsys.readouterr().out.replace("'", "").replace('"', "")
    default = build(MOE_TINY, "cpu-8").source
    assert [call["dispatch"] for call in moe_calls(default)] == [repr("all_gather")]


def test_a_receive_capacity_bounds_the_all_to_all_and_its_drops_are_a_metric(tmp_path, capsys):
    """MeshRule(moe_receive_capacity=...) reaches the program as the moe node's attr and the call's keyword, and
    its dropped fraction joins the metrics the run logs; a capacity <= 0, or one without the all-to-all it bounds,
    is refused at build time naming the rule, the field and the value."""
    spec = expert_parallel(tmp_path, "all_to_all", receive_capacity=1.25)
    source = build(spec, "cpu-8").source
    assert [call["receive_capacity"] for call in moe_calls(source)] == ["1.25"]
    assert "Each device takes 1.25x its even share of copies from each sender" in source
    assert '"dropped_fraction"' in source.split("LOGGED_METRICS = ")[1].splitlines()[0]
    assert axgen(["graph", str(spec), "--target", "tpu-v5e-8", "--after", "lowering"]) == 0
    assert "receive_capacity=1.25" in capsys.readouterr().out
    for dispatch, capacity, message in [
        ("all_to_all", 0.0, "MeshRule.moe_receive_capacity=0.0 must be > 0"),
        ("all_gather", 1.0, "MeshRule.moe_receive_capacity=1.0 bounds the all-to-all dispatch"),
    ]:
        bad = expert_parallel(tmp_path, dispatch, receive_capacity=capacity)
        assert axgen(["build", str(bad), "--target", "cpu-8", "--out", str(tmp_path / "bad.py")]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "bad.py").exists()


@pytest.mark.parametrize(
    "routing",
    [
        {},
        dict(
            num_experts=8,
            scoring="sigmoid",
            balance_bias_rate=1e-3,
            n_group=4,
            topk_group=2,
            group_score="top2_sum",
        ),
    ],
    ids=["mixtral", "deepseek_v3"],
)
def test_all_to_all_experts_equal_the_all_gather_path_in_value_and_gradient(tmp_path, routing):
    """expert=4 on the CPU mesh: the all_to_all path (a block per destination with room for every local copy) gives
    the all-gather path's loss, auxiliary losses and every gradient (x's through the embedding, the router's and
    the experts' weights; with DeepSeek-V3's routing, 2 experts a device, the correction bias's loads too)."""
    programs = {}
    for dispatch in ("all_gather", "all_to_all"):
        out = tmp_path / f"{dispatch}.py"
        write_atomically(out, build(expert_parallel(tmp_path, dispatch, **routing), "cpu-8").source)
        programs[dispatch] = load_program(out)
    params = programs["all_gather"].init_params(jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (8, 17), 0, 256)
    axis_types = (jax.sharding.AxisType.Auto,) * 4
    mesh = jax.make_mesh((2, 1, 4, 1), ("data", "fsdp", "expert", "model"), axis_types=axis_types)
    results = {}
    with jax.set_mesh(mesh):
        for dispatch, program in programs.items():
            placed = jax.device_put(params, Program.from_module(program).param_shardings(mesh))
            results[dispatch] = jax.jit(jax.value_and_grad(program.loss_fn, has_aux=True))(placed, tokens)
    (loss, metrics), grads = results["all_gather"]
    (a2a_loss, a2a_metrics), a2a_grads = results["all_to_all"]
    np.testing.assert_allclose(a2a_loss, loss, rtol=1e-6)
    for name in ("load_balance_loss", "router_z_loss"):
        np.testing.assert_allclose(a2a_metrics[name], metrics[name], rtol=1e-6, err_msg=name)
    assert {"router", "w_up", "w_gate", "w_down"} <= set(grads["moe_layers"])

    def check(path, grad, expected):
        assert float(jnp.abs(expected).max()) > 0, jax.tree_util.keystr(path)
        atol = 1e-5 * float(jnp.abs(expected).max())
        np.testing.assert_allclose(grad, expected, atol=atol, err_msg=jax.tree_util.keystr(path))

    jax.tree_util.tree_map_with_path(check, a2a_grads, grads)


class UncheckedKernels:
    """Stand-ins for the Mosaic GPU grouped-matmul kernels on CPU, their outputs naming no mesh axes as the kernels'
    do (`plgpu.kernel` runs with shard_map's varying-axes check off). They do not reproduce the kernels' compile
    failure under expert parallelism (test_aot compiles the real ones); they check the values."""

    @staticmethod
    def ragged_dot(lhs, rhs, group_sizes, transpose_rhs=False, **tiles):
        with jax._src.config._check_vma(False):
            return jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, group_sizes)

    @staticmethod
    def transposed_ragged_dot(lhs, rhs, group_sizes, **tiles):
        with jax._src.config._check_vma(False):
            group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(lhs.shape[0]), side="right")
            in_group = jax.nn.one_hot(
                group, group_sizes.shape[0], dtype=lhs.dtype
            )  # rows after the last: none
            return jnp.einsum("mg,mk,mn->gkn", in_group, lhs, rhs)


@pytest.mark.parametrize(
    "rule, mesh_shape",
    [
        # slow tier: with expert parallelism (quick tier) the kernels' gradients meet the same batch sum and more
        pytest.param(None, (1, 8, 1, 1), id="fsdp", marks=pytest.mark.slow),
        pytest.param("all_gather", (2, 1, 4, 1), id="data_expert"),
    ],
)
def test_mosaic_gpu_kernel_gradients_sum_over_the_batch_like_ragged_dot(
    tmp_path, monkeypatch, rule, mesh_shape
):
    """The H100 program's kernel path (its custom_vjp, and the casts that type its inputs, outputs and gradients
    as varying over the mesh axes its rows vary over) gives ragged_dot's loss and gradients on a CPU mesh: the
    expert weights' gradient is summed over the devices that split the batch once, not more."""
    monkeypatch.setenv("AXGEN_XLA_KERNELS", "1")  # the attention's XLA path; the grouped matmul is set below
    spec = MOE_TINY if rule is None else expert_parallel(tmp_path, rule)
    out = tmp_path / "h100.py"
    write_atomically(out, build(spec, "gpu-h100-8").source)
    program = load_program(out)
    assert program.GROUPED_MATMUL_IMPL == "ragged_dot"
    params = program.init_params(jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (8, 17), 0, 256)
    axis_types = (jax.sharding.AxisType.Auto,) * 4
    mesh = jax.make_mesh(mesh_shape, ("data", "fsdp", "expert", "model"), axis_types=axis_types)
    results = {}
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, Program.from_module(program).param_shardings(mesh))
        for impl in ("ragged_dot", "mosaic_gpu"):
            monkeypatch.setattr(program, "GROUPED_MATMUL_IMPL", impl)
            monkeypatch.setattr(moe, "ragged_dot_mgpu", UncheckedKernels)
            monkeypatch.setattr(moe, "transposed_ragged_dot_mgpu", UncheckedKernels)
            results[impl] = jax.jit(jax.value_and_grad(program.loss_fn, has_aux=True))(placed, tokens)
    (loss, _), grads = results["ragged_dot"]
    (kernel_loss, _), kernel_grads = results["mosaic_gpu"]
    np.testing.assert_allclose(kernel_loss, loss, rtol=1e-6)

    def check(path, grad, expected):
        atol = 1e-5 * float(jnp.abs(expected).max())
        np.testing.assert_allclose(grad, expected, atol=atol, err_msg=jax.tree_util.keystr(path))

    jax.tree_util.tree_map_with_path(check, kernel_grads, grads)
