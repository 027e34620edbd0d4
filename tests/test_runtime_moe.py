"""axgen/runtime/moe.py on tiny shapes, against references written here in numpy loops (float64): each token's
experts and weights by every routing the library takes, the auxiliary losses, the corrected top-k's backward
value (the experts' loads), the dropless path (one device, and split over data, expert and model axes by both
dispatches) and the capacity path against a dense loop over each token's experts."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from axgen import runtime
from axgen.runtime.moe import top_k_corrected

TOKENS, EXPERTS, EMBED, HIDDEN = 10, 8, 6, 4

# The runtime states no defaults (a program prints every option): Mixtral's routing, and a plain expert call's
# options, which each test changes where it means to.
MIXTRAL = dict(
    scoring="softmax",
    renormalize=True,
    routed_scale=None,
    n_group=None,
    topk_group=None,
    group_score=None,
    seq_balance_loss=False,
)
EXPERT_OPTIONS = dict(
    swiglu_limit=None, swiglu_alpha=None, correction_bias=None, biases=None, checkpoint_names=None
)
DROPLESS_OPTIONS = dict(
    EXPERT_OPTIONS,
    kernel="ragged_dot",
    tiles=None,
    quantize=None,
    dispatch="all_gather",
    check_vma=True,
    rules=None,
)


def routing_with(top_k, **fields):
    return runtime.Routing(top_k=top_k, **{**MIXTRAL, **fields})


def dropless(*arrays, **options):
    return runtime.moe_dropless(*arrays, **{**DROPLESS_OPTIONS, **options})


def with_capacity(*arrays, **options):
    return runtime.moe_with_capacity(*arrays, **{**EXPERT_OPTIONS, **options})


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def route_by_hand(logits, routing, bias=None):
    """Each row's experts (ascending) and their weights, one token at a time."""
    scores = sigmoid(logits) if routing.scoring == "sigmoid" else softmax(logits)
    chosen, weights = [], []
    for row in scores:
        choice = row + (0 if bias is None else bias)
        allowed = np.ones(len(row), bool)
        if routing.n_group:
            size = len(row) // routing.n_group
            ranks = []
            for g in range(routing.n_group):
                members = sorted(choice[g * size : (g + 1) * size], reverse=True)
                ranks.append(members[0] + members[1] if routing.group_score == "top2_sum" else members[0])
            best = sorted(range(routing.n_group), key=lambda g: -ranks[g])[: routing.topk_group]
            allowed = np.array([e // size in best for e in range(len(row))])
        candidates = [e for e in range(len(row)) if allowed[e]]
        top = sorted(sorted(candidates, key=lambda e: -choice[e])[: routing.top_k])
        w = np.array([row[e] for e in top])
        if routing.renormalize:
            w = w / (w.sum() + (1e-20 if routing.scoring == "sigmoid" else 0))
        chosen.append(top)
        weights.append(w * (routing.routed_scale or 1))
    return np.array(chosen), np.array(weights)


def ascending(weights, experts):
    order = np.argsort(np.asarray(experts), axis=-1)
    return np.take_along_axis(np.asarray(experts), order, -1), np.take_along_axis(
        np.asarray(weights), order, -1
    )


ROUTINGS = {
    "mixtral": routing_with(top_k=2),
    "qwen_unnormalised": routing_with(top_k=3, renormalize=False),
    "v2_groups_max": routing_with(top_k=3, n_group=4, topk_group=2, group_score="max", routed_scale=1.5),
    "v3_sigmoid_groups": routing_with(
        top_k=3, scoring="sigmoid", n_group=4, topk_group=2, group_score="top2_sum", routed_scale=2.5
    ),
    "sigmoid_unnormalised": routing_with(top_k=2, scoring="sigmoid", renormalize=False),
}


@pytest.mark.parametrize("corrected", [False, True], ids=["plain", "correction_bias"])
@pytest.mark.parametrize("name", ROUTINGS)
def test_route_chooses_the_experts_and_weights_a_loop_does(name, corrected):
    routing = ROUTINGS[name]
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(TOKENS, EXPERTS)).astype(np.float32)
    bias = rng.normal(scale=0.5, size=EXPERTS).astype(np.float32) if corrected else None
    weights, experts, _ = runtime.route(
        jnp.asarray(logits), routing, correction_bias=None if bias is None else jnp.asarray(bias)
    )
    got_experts, got_weights = ascending(weights, experts)
    expected_experts, expected_weights = route_by_hand(logits.astype(np.float64), routing, bias)
    np.testing.assert_array_equal(got_experts, expected_experts)
    np.testing.assert_allclose(got_weights, expected_weights, rtol=1e-5)
    if corrected:  # the bias changes the choice somewhere, so the test sees it
        assert (expected_experts != route_by_hand(logits.astype(np.float64), routing)[0]).any()


def test_the_auxiliary_losses_are_the_formulas_by_hand():
    """Load balance experts * sum_e(f_e * p_e) with p the scores over their sum, z-loss mean(logsumexp^2), and
    DeepSeek-V3's per-sequence balance, experts / (top_k * seq) * sum_e(count_e * mean p_e), over 3 sequences.
    """
    routing = routing_with(top_k=2, scoring="sigmoid", seq_balance_loss=True)
    logits = np.random.default_rng(1).normal(size=(3, 5, EXPERTS))
    _, _, losses = runtime.route(jnp.asarray(logits, jnp.float32), routing)
    p = sigmoid(logits) / sigmoid(logits).sum(-1, keepdims=True)
    chosen, _ = route_by_hand(logits.reshape(-1, EXPERTS), routing)
    counts = np.zeros(EXPERTS)
    for row in chosen:
        counts[row] += 1
    load_balance = EXPERTS * np.sum(counts / 15 * p.reshape(-1, EXPERTS).mean(0))
    z_loss = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    per_sequence = []
    for s in range(3):
        seq_counts = np.zeros(EXPERTS)
        for row in chosen[s * 5 : (s + 1) * 5]:
            seq_counts[row] += 1
        per_sequence.append(EXPERTS / (2 * 5) * np.sum(seq_counts * p[s].mean(0)))
    np.testing.assert_allclose(float(losses["load_balance_loss"]), load_balance, rtol=1e-5)
    np.testing.assert_allclose(float(losses["router_z_loss"]), z_loss, rtol=1e-5)
    np.testing.assert_allclose(float(losses["seq_balance_loss"]), np.mean(per_sequence), rtol=1e-5)
    assert set(runtime.route(jnp.asarray(logits, jnp.float32), ROUTINGS["mixtral"])[2]) == {
        "load_balance_loss",
        "router_z_loss",
    }


def test_the_corrected_top_k_passes_the_weights_gradient_to_the_chosen_scores_and_returns_the_loads():
    """d(scores) is each chosen expert's weight cotangent in its place, zero elsewhere; the correction bias's
    backward value is each expert's load, how many tokens chose it, whatever the cotangent."""
    routing = ROUTINGS["v3_sigmoid_groups"]
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(TOKENS, EXPERTS))
    scores = sigmoid(logits).astype(np.float32)
    bias = rng.normal(scale=0.5, size=EXPERTS).astype(np.float32)
    cotangent = rng.normal(size=(TOKENS, routing.top_k)).astype(np.float32)

    def f(scores, bias):
        weights, _ = top_k_corrected(scores, bias, routing)
        return jnp.sum(weights * cotangent)

    d_scores, d_bias = jax.grad(f, argnums=(0, 1))(jnp.asarray(scores), jnp.asarray(bias))
    _, experts = top_k_corrected(jnp.asarray(scores), jnp.asarray(bias), routing)
    experts = np.asarray(experts)
    np.testing.assert_array_equal(np.sort(experts, -1), route_by_hand(logits, routing, bias)[0])
    expected_scores, expected_load = np.zeros((TOKENS, EXPERTS)), np.zeros(EXPERTS)
    for t in range(TOKENS):
        for k in range(routing.top_k):
            expected_scores[t, experts[t, k]] += cotangent[t, k]
            expected_load[experts[t, k]] += 1
    np.testing.assert_allclose(d_scores, expected_scores, rtol=1e-6)
    np.testing.assert_array_equal(d_bias, expected_load)


def activation_by_hand(gate, up, activation, limit=None, alpha=None):
    if activation == "swiglu":
        return gate * sigmoid(gate) * up
    g = np.minimum(gate, limit)
    return (np.clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)


def experts_by_hand(
    x, logits, w_gate, w_up, w_down, routing, biases=None, capacity=None, kept=None, **activation
):
    """Each token's output: the sum over its experts of weight x expert MLP, one token and expert at a time. With a
    `capacity`, an expert of a sequence takes the copies of first choices in order, then second choices, up to
    `capacity`; the rest are dropped. `kept(chosen)`, given the experts [batch, seq, top_k] by choice rank, says
    which copies are kept instead. Returns the output and the fraction of copies dropped."""
    batch, seq, _ = x.shape
    chosen, weights = route_by_hand(logits.reshape(-1, logits.shape[-1]), routing)
    chosen, weights = chosen.reshape(batch, seq, -1), weights.reshape(batch, seq, -1)
    # route_by_hand lists a token's experts ascending; capacity goes by choice rank, so rank them by weight again
    rank = np.argsort(-weights, axis=-1, kind="stable")
    chosen, weights = np.take_along_axis(chosen, rank, -1), np.take_along_axis(weights, rank, -1)
    b_gate, b_up, b_down = (
        biases if biases is not None else (0 * w_gate[:, 0], 0 * w_up[:, 0], 0 * w_down[:, 0])
    )
    out, dropped = np.zeros_like(x), 0
    keep = np.ones(chosen.shape, bool) if kept is None else kept(chosen)
    for b in range(batch):
        taken = np.zeros(w_up.shape[0], int)
        for k in range(routing.top_k):
            for s in range(seq):
                e = chosen[b, s, k]
                if not keep[b, s, k]:
                    dropped += 1
                    continue
                if capacity is not None:
                    if taken[e] == capacity:
                        dropped += 1
                        continue
                    taken[e] += 1
                hidden = activation_by_hand(
                    x[b, s] @ w_gate[e] + b_gate[e], x[b, s] @ w_up[e] + b_up[e], **activation
                )
                out[b, s] += weights[b, s, k] * (hidden @ w_down[e] + b_down[e])
    return out, dropped / chosen.size


def tiny_experts(seed, batch=2, seq=4, experts=4, biased=False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, seq, EMBED))
    logits = rng.normal(size=(batch, seq, experts))
    w_gate, w_up = rng.normal(size=(2, experts, EMBED, HIDDEN)) / 2
    w_down = rng.normal(size=(experts, HIDDEN, EMBED)) / 2
    biases = tuple(
        rng.normal(scale=0.3, size=s) for s in ((experts, HIDDEN), (experts, HIDDEN), (experts, EMBED))
    )
    return x, logits, w_gate, w_up, w_down, biases if biased else None


GPT_OSS = dict(activation="clamped_swiglu", swiglu_limit=0.7, swiglu_alpha=1.702)
RULES = {"batch": ("data", "fsdp", "expert"), "expert": ("expert",), "mlp": ("model",)}


def as_f32(*arrays):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), arrays)


@pytest.mark.parametrize("biased", [False, True], ids=["swiglu", "gpt_oss"])
def test_dropless_equals_a_loop_over_each_tokens_experts(biased):
    x, logits, w_gate, w_up, w_down, biases = tiny_experts(3, biased=biased)
    activation = GPT_OSS if biased else {"activation": "swiglu"}
    routing = routing_with(top_k=2)
    out, aux = dropless(
        *as_f32(x, logits, w_gate, w_up, w_down),
        routing=routing,
        biases=as_f32(*biases) if biased else None,
        **activation,
    )
    hand_activation = (
        {"limit": 0.7, "alpha": 1.702, "activation": "clamped"} if biased else {"activation": "swiglu"}
    )
    expected, _ = experts_by_hand(x, logits, w_gate, w_up, w_down, routing, biases, **hand_activation)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    assert set(aux) == {"load_balance_loss", "router_z_loss"}


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("biased", [False, True], ids=["swiglu", "gpt_oss"])
def test_dropless_split_over_data_expert_and_model_equals_the_loop(dispatch, biased):
    """data=2 splits the batch, expert=2 the experts (two a device), model=2 their hidden units; each device's
    partial outputs summed back give the loop's output, and the losses are the whole batch's."""
    x, logits, w_gate, w_up, w_down, biases = tiny_experts(4, batch=4, biased=biased)
    activation = GPT_OSS if biased else {"activation": "swiglu"}
    routing = routing_with(top_k=2)
    mesh = jax.make_mesh(
        (2, 1, 2, 2), ("data", "fsdp", "expert", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 4
    )

    def moe(x, logits, w_gate, w_up, w_down, biases):
        return dropless(
            x,
            logits,
            w_gate,
            w_up,
            w_down,
            routing=routing,
            biases=biases,
            dispatch=dispatch,
            rules=RULES,
            **activation,
        )

    with jax.set_mesh(mesh):
        out, aux = jax.jit(moe)(*as_f32(x, logits, w_gate, w_up, w_down), as_f32(*biases) if biased else None)
    one_device, one_aux = moe(*as_f32(x, logits, w_gate, w_up, w_down), as_f32(*biases) if biased else None)
    hand_activation = (
        {"limit": 0.7, "alpha": 1.702, "activation": "clamped"} if biased else {"activation": "swiglu"}
    )
    expected, _ = experts_by_hand(x, logits, w_gate, w_up, w_down, routing, biases, **hand_activation)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    for name in one_aux:
        np.testing.assert_allclose(aux[name], one_aux[name], rtol=1e-6, err_msg=name)


def test_the_ragged_all_to_all_backward_sums_over_devices_only_what_the_all_to_all_one_sums():
    """XLA:CPU cannot run ragged-all-to-all, so its backward is read off the traced gradient: with fsdp=2 x
    expert=4, the only sums over mesh axes are the fixed-block all_to_all path's (the auxiliary losses, the
    weights' gradient over fsdp). jax types a ragged_all_to_all's result as its output buffer; a fresh buffer is
    invariant, and the received rows' gradient was summed over the expert group ([rows, embed] psum over
    `expert`: each device's rows given the group's sum, on chips an all-reduce of every receive buffer)."""
    x, logits, w_gate, w_up, w_down, _ = tiny_experts(4, batch=8, seq=16, experts=8)
    mesh = jax.make_mesh(
        (1, 2, 4, 1), ("data", "fsdp", "expert", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 4
    )

    def sums(dispatch):
        def loss(*arrays):
            out, _ = dropless(
                *arrays, routing=routing_with(top_k=2), dispatch=dispatch, rules=RULES, activation="swiglu"
            )
            return out.sum()

        with jax.set_mesh(mesh):
            jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(
                *as_f32(x, logits, w_gate, w_up, w_down)
            )
        found = []

        def visit(jaxpr):
            for equation in jaxpr.eqns:
                if equation.primitive.name.startswith("psum"):
                    found.append((equation.params["axes"], tuple(equation.outvars[0].aval.shape)))
                for sub in jax.extend.core.jaxprs_in_params(equation.params):
                    visit(sub)

        visit(jaxpr.jaxpr)
        return sorted(found)

    ragged, blocks = sums("ragged_all_to_all"), sums("all_to_all")
    assert ragged == blocks, (ragged, blocks)
    assert not [shape for axes, shape in ragged if "expert" in axes and len(shape) == 2 and shape[1] == EMBED]


@pytest.mark.parametrize("receive_capacity, block", [(0.5, 2), (2.0, 8)], ids=["tight", "roomy"])
def test_a_bounded_all_to_all_keeps_each_senders_first_choices_up_to_its_block(receive_capacity, block):
    """data=2 x expert=2 x model=2, one sequence of 4 tokens a device, top-2: 8 copies a device, 4 for each of the
    two devices of its expert group when balanced. A receive capacity of 0.5 gives each sender a block of 2 rows
    on each device: a sender's copies for a device beyond 2 are dropped, its tokens' second choices before their
    first, and counted; 2.0 gives room for all 8, which drops nothing (the dropless result)."""
    x, logits, w_gate, w_up, w_down, _ = tiny_experts(4, batch=4)
    routing = routing_with(top_k=2)
    options = dict(routing=routing, dispatch="all_to_all", rules=RULES, activation="swiglu")
    axis_types = (jax.sharding.AxisType.Auto,) * 4
    with jax.set_mesh(
        jax.make_mesh((2, 1, 2, 2), ("data", "fsdp", "expert", "model"), axis_types=axis_types)
    ):
        moe = functools.partial(dropless, receive_capacity=receive_capacity, **options)
        out, aux = jax.jit(moe)(*as_f32(x, logits, w_gate, w_up, w_down))

    def kept(
        chosen,
    ):  # [sequence = sending device, token, rank]: each destination takes a sender's first `block`
        keep = np.zeros(chosen.shape, bool)
        for b in range(chosen.shape[0]):
            for destination in (0, 1):  # 4 experts, 2 a device
                copies = [(k, s) for k in range(2) for s in range(4) if chosen[b, s, k] // 2 == destination]
                for k, s in copies[:block]:
                    keep[b, s, k] = True
        return keep

    expected, dropped = experts_by_hand(
        x, logits, w_gate, w_up, w_down, routing, kept=kept, activation="swiglu"
    )
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(aux["dropped_fraction"]), dropped, rtol=1e-6)
    assert (dropped > 0.1) == (block == 2), dropped


@pytest.mark.parametrize("capacity_factor, capacity", [(0.5, 2), (2.0, 8)], ids=["tight", "roomy"])
def test_capacity_keeps_first_choices_first_up_to_each_experts_slots(capacity_factor, capacity):
    """capacity = ceil(top_k * seq * factor / experts): 2 x 8 x 0.5 / 4 = 2 slots per expert and sequence, or 8
    (room for every copy)."""
    x, logits, w_gate, w_up, w_down, biases = tiny_experts(5, seq=8, biased=True)
    routing = routing_with(top_k=2)
    out, aux = with_capacity(
        *as_f32(x, logits, w_gate, w_up, w_down),
        routing=routing,
        capacity_factor=capacity_factor,
        biases=as_f32(*biases),
        **GPT_OSS,
    )
    expected, dropped = experts_by_hand(
        x,
        logits,
        w_gate,
        w_up,
        w_down,
        routing,
        biases,
        capacity=capacity,
        activation="clamped",
        limit=0.7,
        alpha=1.702,
    )
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(aux["dropped_fraction"]), dropped)
    assert (dropped > 0.3) == (capacity == 2)


def test_checkpoint_names_name_the_experts_products_for_remat():
    x, logits, w_gate, w_up, w_down, _ = tiny_experts(6)
    args = as_f32(x, logits, w_gate, w_up, w_down)
    options = dict(routing=routing_with(top_k=2), activation="swiglu")
    for moe in (
        dropless,
        lambda *a, **o: with_capacity(*a, capacity_factor=1.0, **o),
    ):
        named = str(
            jax.make_jaxpr(lambda *a: moe(*a, checkpoint_names=("mlp_in", "mlp_out"), **options))(*args)
        )
        assert named.count("name=mlp_in") == 2 and named.count("name=mlp_out") == 1
        assert "name=mlp_" not in str(jax.make_jaxpr(lambda *a: moe(*a, **options))(*args))


def test_a_kernel_or_dispatch_the_library_lacks_is_one_error():
    x, logits, w_gate, w_up, w_down, _ = tiny_experts(7)
    args = as_f32(x, logits, w_gate, w_up, w_down)
    options = dict(routing=routing_with(top_k=2), activation="swiglu")
    with pytest.raises(ValueError, match="no grouped matmul kernel 'cutlass'"):
        dropless(*args, kernel="cutlass", **options)
    with pytest.raises(
        ValueError, match="quantize='int8' runs on XLA's ragged_dot, not the megablox_gmm kernel"
    ):
        dropless(*args, kernel="megablox_gmm", quantize="int8", **options)
    with pytest.raises(ValueError, match="no expert activation 'relu'"):
        dropless(*args, routing=options["routing"], activation="relu")
