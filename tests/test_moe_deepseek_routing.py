"""DeepSeek's routing on F.moe: sigmoid scores, the correction bias that chooses experts and weights none (and the
train step moves toward balance), group-limited top-k, the sequence-wise balance loss; against transformers'
own routers (tests/fixtures/make_deepseek_router_fixture.py) and a numpy reference of them written here."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axgen import runtime
from axgen.build import build
from axgen.files import write_atomically
from axgen.hf.export import hf_config
from axgen.interop import CheckpointError, load_program
from axgen.loader import load_spec
from axgen.runtime.program import Program
from axgen.runtime.training import balanced
from axgen.spec import SpecError
from tests.conftest import ROOT, moe_options

FIXTURE = ROOT / "tests/fixtures/hf_deepseek_router.npz"
V3 = dict(
    num_experts=8, scoring="sigmoid", balance_bias_rate=1e-3, n_group=4, topk_group=2, group_score="top2_sum"
)


def spec_with(tmp_path, name="deepseek", **moe):
    spec = tmp_path / "specs" / f"{name}.py"
    spec.parent.mkdir(exist_ok=True)
    spec.write_text(
        "from axgen.specs.moe_tiny import spec as tiny\n"
        f"moe = tiny.feature('moe').replace(**{moe!r})\n"
        "spec = tiny.replace(features=[moe if f.pass_name == 'moe' else f for f in tiny.features])\n"
    )
    return spec


def program_with(tmp_path, target="cpu-1", name="deepseek", **moe):
    out = tmp_path / f"{name}_{target.replace('-', '_')}.py"
    write_atomically(out, build(spec_with(tmp_path, name, **moe), target).source)
    return load_program(out)


def v3_route_by_hand(logits, bias, top_k, n_group, topk_group, group_score, renormalize, scale, sigmoid=True):
    """transformers' DeepseekV3TopkRouter (group_score top2_sum) and DeepseekV2's group_limited_greedy (max), in
    numpy float64: the experts of each row in ascending order and their weights in the same order."""
    logits = logits.astype(np.float64)
    if sigmoid:
        scores = 1 / (1 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    choice = scores + bias
    rows, experts = choice.shape
    groups = choice.reshape(rows, n_group, experts // n_group)
    ranked = np.sort(groups, axis=-1)[..., -2:].sum(-1) if group_score == "top2_sum" else groups.max(-1)
    best = np.argsort(-ranked, axis=-1)[:, :topk_group]
    kept = np.zeros((rows, n_group), bool)
    np.put_along_axis(kept, best, True, axis=-1)
    choice = np.where(np.repeat(kept, experts // n_group, axis=-1), choice, -np.inf)
    chosen = np.sort(np.argsort(-choice, axis=-1)[:, :top_k], axis=-1)
    weights = np.take_along_axis(scores, chosen, axis=-1)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return chosen, weights * scale


def in_ascending_order(weights, experts):
    order = np.argsort(np.asarray(experts), axis=-1)
    return np.take_along_axis(np.asarray(experts), order, -1), np.take_along_axis(
        np.asarray(weights), order, -1
    )


@pytest.mark.parametrize("case", ["v3", "v3_unnormalised", "v2"])
def test_routing_equals_transformers_routers(tmp_path, case):
    fixture = np.load(FIXTURE)
    config = json.loads(str(fixture[f"{case}/config"]))
    v3 = case.startswith("v3")
    program = program_with(
        tmp_path,
        num_experts=config["n_routed_experts"],
        top_k=config["num_experts_per_tok"],
        renormalize=config["norm_topk_prob"],
        routed_scale=config["routed_scaling_factor"],
        scoring="sigmoid" if v3 else "softmax",
        balance_bias_rate=1e-3 if v3 else None,
        n_group=config["n_group"],
        topk_group=config["topk_group"],
        group_score="top2_sum" if v3 else "max",
    )
    hidden = fixture["hidden"].reshape(-1, fixture["hidden"].shape[-1])
    logits = jnp.asarray(hidden @ fixture[f"{case}/router"].T)
    bias = jnp.asarray(fixture[f"{case}/bias"])
    routing = moe_options(program)["routing"]
    assert routing.top_k == config["num_experts_per_tok"]
    weights, experts, _ = runtime.route(logits, routing, correction_bias=bias if v3 else None)
    experts, weights = in_ascending_order(weights, experts)
    np.testing.assert_array_equal(experts, fixture[f"{case}/experts"])
    np.testing.assert_allclose(weights, fixture[f"{case}/weights"], rtol=1e-5, atol=1e-6)
    by_hand = v3_route_by_hand(
        np.asarray(logits),
        np.asarray(bias),
        config["num_experts_per_tok"],
        config["n_group"],
        config["topk_group"],
        "top2_sum" if v3 else "max",
        config["norm_topk_prob"],
        config["routed_scaling_factor"],
        sigmoid=v3,
    )
    np.testing.assert_array_equal(experts, by_hand[0])
    np.testing.assert_allclose(weights, by_hand[1], rtol=1e-5, atol=1e-6)
    if v3:  # the fixture's bias changes the choice: without it, other experts win
        unbiased, _ = in_ascending_order(*runtime.route(logits, routing, correction_bias=0 * bias)[:2])
        assert (unbiased != experts).any(axis=-1).mean() > 0.3


def skewed(params):
    """Every token's router logit for expert 0 raised by about 1.6: the embeddings' channel 0 is 1 (so it dominates
    each MoE layer's normed input, about 11 there), and the routers read it into expert 0 only."""
    params["embed"] = params["embed"].at[:, 0].set(1.0)
    params["moe_layers"]["router"] = params["moe_layers"]["router"].at[:, 0, :].set(0.0).at[:, 0, 0].set(0.15)
    return params


def test_the_correction_bias_moves_toward_balance_and_the_optimizer_leaves_it_alone(tmp_path):
    """A skewed router sends every token to expert 0. The backward value of the correction bias is each expert's
    load (top_k per token); each step moves the bias by the rate against it, not by AdamW, and the load evens out.
    """
    rate = 0.02
    program = program_with(
        tmp_path, scoring="sigmoid", balance_bias_rate=rate, aux_loss_weight=0.0, router_z_loss_weight=0.0
    )
    spec = program.PARAMS["moe_layers"]["correction_bias"]
    assert (spec.trained, spec.decay, spec.balance_rate) == (False, False, rate)
    state = Program.from_module(program).init_state(jax.random.key(0))
    state["params"] = skewed(state["params"])
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, 256)
    loads = jax.jit(
        lambda p: jax.grad(program.loss_fn, has_aux=True)(p, tokens)[0]["moe_layers"]["correction_bias"]
    )
    step = jax.jit(program.train_step)
    # The loads are read (a forward and backward pass) at the first step and the last five.
    steps, measured = 40, {0, 35, 36, 37, 38, 39}
    imbalance = []
    for i in range(steps):
        bias = np.asarray(state["params"]["moe_layers"]["correction_bias"])
        load = np.asarray(loads(state["params"])) if i in measured else None  # [moe layers, experts]
        state, metrics = step(state, tokens)
        moved = np.asarray(state["params"]["moe_layers"]["correction_bias"]) - bias
        # Each expert's bias moves by the rate, up or down, or stays where its load is the mean.
        np.testing.assert_allclose(np.abs(moved)[np.abs(moved) > rate / 2], rate, rtol=1e-4)
        if load is not None:
            assert load.sum(axis=-1).tolist() == [8 * 32 * 2] * 2  # every token's top_k choices, nothing else
            imbalance.append(float((load.max(-1) / load.mean(-1)).max()))
            np.testing.assert_allclose(moved, rate * np.sign(load.mean(-1, keepdims=True) - load), atol=1e-7)
    # max load / mean load of the worse layer: 2.0 is every token choosing expert 0; it falls to about 1.2
    assert imbalance[0] > 1.9 and np.mean(imbalance[-5:]) < 1.3, imbalance


def test_a_zero_rate_holds_the_bias_while_the_router_trains(tmp_path):
    program = program_with(tmp_path, name="held", scoring="sigmoid", balance_bias_rate=0.0)
    state = Program.from_module(program).init_state(jax.random.key(0))
    state["params"] = skewed(state["params"])
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)
    router = np.asarray(state["params"]["moe_layers"]["router"])
    for _ in range(2):
        state, _ = jax.jit(program.train_step)(state, tokens)
    np.testing.assert_array_equal(state["params"]["moe_layers"]["correction_bias"], 0.0)
    assert not np.array_equal(state["params"]["moe_layers"]["router"], router)


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_routing_without_groups_by_hand(tmp_path, renormalize):
    program = program_with(
        tmp_path, name=f"sigmoid_{renormalize}", scoring="sigmoid", renormalize=renormalize, routed_scale=1.5
    )
    logits = jax.random.normal(jax.random.key(0), (40, 4))
    weights, experts, _ = runtime.route(logits, moe_options(program)["routing"])
    experts, weights = in_ascending_order(weights, experts)
    by_hand = v3_route_by_hand(np.asarray(logits), np.zeros(4), 2, 1, 1, "top2_sum", renormalize, 1.5)
    np.testing.assert_array_equal(experts, by_hand[0])
    np.testing.assert_allclose(weights, by_hand[1], rtol=1e-5)


def test_sequence_wise_balance_loss_by_hand(tmp_path):
    """DeepSeek-V3's L_bal = sum_e f_e * P_e per sequence, f_e = experts / (top_k * T) * (tokens choosing e),
    P_e = mean over the sequence of the scores normalised over the experts; the mean over sequences."""
    program = program_with(tmp_path, name="seq_loss", scoring="sigmoid", seq_aux_loss_weight=0.01)
    assert program.AUX_LOSS_WEIGHTS["seq_balance_loss"] == 0.01
    logits = jax.random.normal(jax.random.key(0), (3, 16, 4))
    _, experts, losses = runtime.route(logits, moe_options(program)["routing"])
    scores = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    normalised = scores / scores.sum(-1, keepdims=True)
    expected = []
    for row, chosen in zip(normalised, np.asarray(experts)):
        counts = np.bincount(chosen.reshape(-1), minlength=4)
        expected.append(np.sum(4 / (2 * 16) * counts * row.mean(0)))
    np.testing.assert_allclose(float(losses["seq_balance_loss"]), np.mean(expected), rtol=1e-5)
    unweighted = program_with(tmp_path, name="no_seq_loss", scoring="sigmoid")
    assert "seq_balance_loss" not in unweighted.AUX_LOSS_WEIGHTS
    assert moe_options(unweighted)["routing"].seq_balance_loss is False


def test_loads_add_up_over_microbatches_and_over_devices(tmp_path):
    """The bias's backward value is the load over the whole step: summed over gradient-accumulation passes (the
    runtime adds a balance_rate statistic's passes, where an fp8 amax takes their maximum), and over the devices
    whose rows each routes (psum in backward); loss, auxiliary losses and gradients equal one device's."""
    program = program_with(tmp_path, target="cpu-8", name="sharded", seq_aux_loss_weight=0.01, **V3)
    params = skewed(program.init_params(jax.random.key(1)))
    tokens = jax.random.randint(jax.random.key(2), (8, 17), 0, 256)
    grad_fn = jax.value_and_grad(program.loss_fn, has_aux=True)
    (loss, metrics), grads = jax.jit(grad_fn)(params, tokens)
    load = np.asarray(grads["moe_layers"]["correction_bias"])
    assert load.sum(-1).tolist() == [8 * 16 * 2] * 2 and load.max() > 2 * load.min()
    batch = (tokens, jnp.ones_like(tokens), jnp.ones_like(tokens))
    rules = program.LOGICAL_AXIS_RULES
    (_, _), accumulated = jax.jit(
        lambda p: program.runtime.gradients(program.loss_fn, {"params": p}, batch, 2, program.PARAMS, rules)
    )(params)
    np.testing.assert_array_equal(accumulated["moe_layers"]["correction_bias"], load)
    mesh = jax.make_mesh(
        (2, 1, 2, 2), ("data", "fsdp", "expert", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 4
    )
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, Program.from_module(program).param_shardings(mesh))
        (sharded_loss, sharded_metrics), sharded_grads = jax.jit(grad_fn)(placed, tokens)
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-5)
    for name in ("load_balance_loss", "router_z_loss", "seq_balance_loss"):
        np.testing.assert_allclose(sharded_metrics[name], metrics[name], rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(sharded_grads["moe_layers"]["correction_bias"], load)
    for key in ("router", "w_up", "w_down"):
        atol = 1e-5 * float(jnp.abs(grads["moe_layers"][key]).max())
        np.testing.assert_allclose(
            sharded_grads["moe_layers"][key], grads["moe_layers"][key], atol=atol, err_msg=key
        )


@pytest.mark.parametrize(
    "moe, message",
    [
        (
            dict(scoring="sigmod"),
            r"MoE.scoring='sigmod' is not one of softmax, sigmoid; did you mean 'sigmoid'\?$",
        ),
        (
            dict(balance_bias_rate=-0.001),
            r"MoE.balance_bias_rate=-0.001 must be >= 0 \(0.0 holds the correction bias fixed\)$",
        ),
        (
            dict(seq_aux_loss_weight=-1.0),
            r"MoE.seq_aux_loss_weight=-1.0 must be >= 0 \(0.0 turns the loss off\)$",
        ),
        (dict(topk_group=1), r"MoE.topk_group=1 applies to group-limited routing: set n_group$"),
        (dict(n_group=3, topk_group=1, group_score="max"), r"MoE.n_group=3 does not divide num_experts=4$"),
        (dict(n_group=2, topk_group=3, group_score="max"), r"MoE.topk_group=3 must be in \[1, n_group=2\]$"),
        (dict(n_group=2, topk_group=1), r"MoE.group_score=None is not one of top2_sum, max$"),
        (
            dict(n_group=4, topk_group=2, group_score="top2_sum"),
            r"MoE.n_group=4 leaves 1 expert per group; top2_sum ranks a group by two$",
        ),
        (
            dict(n_group=4, topk_group=1, group_score="max"),
            r"MoE.top_k=2 is more than the 1 experts of topk_group groups$",
        ),
    ],
)
def test_deepseek_routing_values_that_cannot_be_are_one_line(tmp_path, moe, message):
    with pytest.raises(SpecError, match=message):
        load_spec(spec_with(tmp_path, **moe))


@pytest.mark.parametrize(
    "moe, message",
    [
        (dict(scoring="sigmoid"), r"MoE.scoring='sigmoid': no family axgen exports routes as DeepSeek does$"),
        (
            dict(balance_bias_rate=0.0),
            r"MoE.balance_bias_rate=0.0: no family axgen exports routes as DeepSeek does$",
        ),
        (dict(n_group=2, topk_group=1, group_score="max"), r"MoE.n_group=2: no family axgen exports routes"),
        (
            dict(every=1, first_dense_layers=1, dense_hidden_dim=64),
            r"MoE.first_dense_layers=1: no family axgen",
        ),
    ],
)
def test_export_refuses_deepseek_routing_no_exported_family_states(tmp_path, moe, message):
    with pytest.raises(CheckpointError, match=message):
        hf_config(load_spec(spec_with(tmp_path, **moe)), "float32")
