"""Context parallelism: a `context` mesh axis splits each sequence, each shard holding a front and a back chunk
(runtime/context.py), attention gathering keys and values over the shards. The proof is issue 39's: on the CPU
mesh, context=4 gives context=1's loss and gradients, with and without documents packed into the rows, with GQA
and with sliding windows."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axgen import runtime
from axgen.analysis import plan as planner
from axgen.backends import plan_for
from axgen.build import build
from axgen.cli import main as axgen
from axgen.files import write_atomically
from axgen.interop import hf_to_params, load_program
from axgen.loader import load_spec
from axgen.runtime.attention import causal_attention
from axgen.runtime.context import sequence_index
from axgen.runtime.program import Program
from tests.conftest import ROOT, assert_gradients_close

AXES = ("data", "fsdp", "expert", "context", "model")


def mesh_of(**sizes):
    shape = tuple(sizes.get(axis, 1) for axis in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def spec_file(tmp_path, name, mesh, features="", seq_len=128, base="llama_tiny"):
    """A tiny spec on `mesh` for every CPU target, with `features` added to its own."""
    path = tmp_path / f"{name}.py"
    path.write_text(
        "from axgen.spec import MeshRule\nfrom axgen.spec import features as F\n"
        f"from axgen.specs.{base} import spec as tiny\n"
        f"rule = MeshRule('cpu-8|tpu-v5e-8|gpu-h100-8', {mesh!r}, why='context parallelism under test')\n"
        f"spec = tiny.replace(mesh_rules=[rule], features=[*tiny.features, {features}], "
        f"train=tiny.train.replace(seq_len={seq_len}))\n"
    )
    return path


def test_the_context_order_gives_each_shard_a_front_and_a_back_chunk():
    """Of 8 positions over 2 shards (4 chunks of 2), shard 0 holds chunks 0 and 3, shard 1 chunks 1 and 2; on the
    mesh, to_context_order moves [batch, seq, ...] rows so, and from_context_order moves them back."""
    assert sequence_index(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert sequence_index(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    rules = {"batch": ("data",), "seq": ("context",), "embed": ()}
    x = jnp.arange(4 * 48 * 3, dtype=jnp.float32).reshape(4, 48, 3)
    for context in (2, 4, 8):
        with jax.set_mesh(mesh_of(data=8 // context, context=context)):
            reordered = jax.jit(lambda x: runtime.to_context_order(x, rules))(x)
            back = jax.jit(lambda x: runtime.from_context_order(x, rules))(reordered)
            gradient = jax.jit(jax.grad(lambda x: (runtime.to_context_order(x, rules) * reordered).sum()))(x)
        np.testing.assert_array_equal(reordered, x[:, sequence_index(48, context)])
        np.testing.assert_array_equal(back, x)
        np.testing.assert_array_equal(gradient, x)  # the transpose of a permutation is its inverse
    assert runtime.to_context_order(x, rules) is x  # outside a mesh: the identity


def attention_inputs(seq=64, heads=4, kv_heads=2, head_dim=16, v_head_dim=16, documents=True):
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (2, seq, heads, head_dim))
    k = jax.random.normal(keys[1], (2, seq, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (2, seq, kv_heads, v_head_dim))
    starts = jax.random.uniform(keys[3], (2, seq)) < (0.06 if documents else 0)
    return q, k, v, (jnp.cumsum(starts, axis=1) + 1).astype(jnp.int32)


@pytest.mark.parametrize(
    ("implementation", "options", "v_head_dim"),
    [
        ("xla", {"window": 12}, 8),  # v's head dim padded to q's for jax.nn.dot_product_attention
        ("xla_ops", {"window": 12, "softcap": 3.0, "sinks": True}, 8),  # MLA's value head dim as it is
        ("splash", {"window": None}, 16),
        ("splash", {"window": 100, "softcap": 3.0, "sinks": True}, 8),
    ],
)
def test_attention_over_context_shards_is_attention_over_the_sequence(implementation, options, v_head_dim):
    """Queries of one context shard against keys gathered over the others (4; splash, in its interpreter: 2 of
    2 x 128-long blocks), heads split over model=2 besides: each kernel's output and gradients in context order
    are the whole sequence's by XLA's path, reordered, with document masks, GQA, windows, a soft-cap and sinks.
    """
    seq, context = (512, 2) if implementation == "splash" else (64, 4)
    q, k, v, segment_ids = attention_inputs(seq, v_head_dim=v_head_dim)
    sinks = jnp.linspace(-1.0, 1.0, 4) if options.get("sinks") else None
    options = {"softcap": None, **options, "sinks": sinks, "scale": None}
    rules = {
        "batch": ("data",),
        "seq": ("context",),
        "heads": ("model",),
        "kv_heads": ("model",),
        "head_dim": (),
    }
    by_xla = "xla" if implementation == "xla" else "xla_ops"
    reference = functools.partial(causal_attention, implementation=by_xla, block=None, rules=rules, **options)
    attend = functools.partial(
        causal_attention, implementation=implementation, block=128, rules=rules, interpret=True, **options
    )
    order = sequence_index(seq, context)

    def loss(attention, q, k, v):
        return (attention(q, k, v) * jnp.cos(jnp.arange(v_head_dim))).sum()

    whole = lambda q, k, v: reference(q, k, v, segment_ids)  # noqa: E731
    expected, expected_grads = whole(q, k, v), jax.grad(functools.partial(loss, whole), (0, 1, 2))(q, k, v)
    in_context_order = [x[:, order] for x in (q, k, v, segment_ids)]
    over_context = lambda q, k, v: attend(q, k, v, in_context_order[3], context="all_gather")  # noqa: E731
    with jax.set_mesh(mesh_of(data=4 // context, context=context, model=2)):
        out = jax.jit(over_context)(*in_context_order[:3])
        grads = jax.jit(jax.grad(functools.partial(loss, over_context), (0, 1, 2)))(*in_context_order[:3])
    np.testing.assert_allclose(out, expected[:, order], atol=2e-6 if implementation != "splash" else 2e-5)
    for grad, expected_grad in zip(grads, expected_grads):
        np.testing.assert_allclose(
            grad, expected_grad[:, order], atol=2e-5 if implementation != "splash" else 2e-4
        )


@pytest.fixture(scope="module")
def context_programs(tmp_path_factory):
    """llama_tiny with alternating windowed and global layers (window 24 of 128), on fsdp=4 x model=2 and on
    context=4 x model=2: the same model, one compile of each."""
    tmp_path = tmp_path_factory.mktemp("context")
    programs = {}
    for name, mesh in [("whole", {"fsdp": 4, "model": 2}), ("split", {"context": 4, "model": 2})]:
        spec = spec_file(tmp_path, name, mesh, "F.sliding_window(window=24, global_every=2)")
        out = tmp_path / f"{name}_program.py"
        write_atomically(out, build(spec, "cpu-8").source)
        programs[name] = load_program(out)
    return programs


def packed_batch(documents):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 512, (16, 129)), jnp.int32)
    starts = rng.random((16, 129)) < (0.03 if documents else 0)
    segment_ids = np.cumsum(starts, axis=1) + 1
    segment_ids[:2, -10:] = 0  # padding
    return tokens, jnp.asarray(segment_ids, jnp.int32), jnp.asarray(rng.random((16, 129)) < 0.9, jnp.int32)


def test_context_4_trains_as_context_1_does(context_programs):
    """The loss and every gradient of a step accumulated over 2 passes (runtime.gradients) on context=4 equal those
    on one context shard within float32 noise, with documents packed into the rows and with one a row; so do the
    forward logits. One compile of each program's step serves both batches."""
    batches = {documents: packed_batch(documents) for documents in (True, False)}
    results = {}
    for name, module in context_programs.items():
        program = Program.from_module(module)
        mesh = program.make_mesh()
        step = jax.jit(
            functools.partial(
                runtime.gradients,
                module.loss_fn,
                microbatch=module.MICROBATCH // 2,
                specs=module.PARAMS,
                rules=module.LOGICAL_AXIS_RULES,
            )
        )
        with jax.set_mesh(mesh):
            state = jax.device_put(program.init_state(jax.random.key(0)), program.state_shardings(mesh))
            for documents, batch in batches.items():
                (loss, _), grads = step(state, batch=batch)
                results[name, documents] = float(loss), jax.tree.map(np.asarray, grads)
            tokens, segment_ids, _ = batches[True]
            results[name, "logits"] = np.asarray(
                jax.jit(module.forward)(state["params"], tokens[:, :-1], segment_ids[:, :-1])
            )
    assert module.MESH_SHAPE["context"] == 4
    assert "context_segment_ids" in inspect.getsource(module.hidden_with_aux)
    np.testing.assert_allclose(results["split", "logits"], results["whole", "logits"], atol=1e-5)
    for documents in batches:
        (loss, grads), (split_loss, split_grads) = results["whole", documents], results["split", documents]
        np.testing.assert_allclose(split_loss, loss, rtol=1e-6)
        assert_gradients_close(split_grads, grads, 1e-6, f"documents packed: {documents}")


def test_the_lowering_shows_the_split_and_refuses_what_it_cannot_split(tmp_path, capsys):
    """`axgen graph --after lowering` shows the inputs put into context order, the logits put back, the head whose
    fused loss takes the hidden states in context order, and each attention's gather, splash's as XLA's. A
    context degree that does not cut seq_len into twice as many chunks, or experts with a capacity per sequence, are refused at build
    time naming the rule and the value, with nothing written."""
    spec = spec_file(tmp_path, "split", {"fsdp": 2, "context": 4}, seq_len=1024)
    assert axgen(["graph", str(spec), "--target", "cpu-8", "--after", "lowering"]) == 0
    graph = capsys.readouterr().out
    for node in ("context_tokens", "context_positions", "context_segment_ids"):
        assert f"{node} = context_order(" in graph and "to=context shards=4" in graph
    assert "logits_in_order = context_order(x=logits) to=sequence shards=4" in graph
    assert graph.count("context=all_gather") == 1  # one attention node in the block
    assert "logits = lm_head(x=final_norm)" in graph and "loss=fused context=True" in graph
    source = build(spec, "tpu-v5e-8").source
    assert "implementation=ATTENTION_IMPL" in source and 'context="all_gather"' in source
    assert 'ATTENTION_IMPL = "xla" if os.environ.get("AXGEN_XLA_KERNELS") == "1" else "splash"' in source
    plain = build(spec_file(tmp_path, "plain", {"fsdp": 8}), "cpu-8").source
    assert "context_order" not in plain and "context=" not in plain.split("MESH_SHAPE")[1]
    uneven = spec_file(tmp_path, "uneven", {"context": 8}, seq_len=120)
    capacity = moe_spec(tmp_path, "capacity", {"context": 2, "fsdp": 4}, capacity_factor=1.25)
    for bad, message in [
        (uneven, "context=8 (pattern 'cpu-8|tpu-v5e-8|gpu-h100-8') does not cut Train.seq_len=120 into 16"),
        (capacity, "MoE.capacity_factor=1.25: a capacity per sequence keeps its first tokens"),
    ]:
        out = tmp_path / f"{bad.stem}.py.out"
        assert axgen(["build", str(bad), "--target", "cpu-8", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_the_planner_tries_context_splits_for_long_sequences_only(tmp_path):
    """`axgen plan` searches context shards from LONG_CONTEXT tokens on, and only where they cut the sequence
    evenly."""
    for seq_len, base, expect_context in [(32_768, "llama_tiny", True), (4096, "llama_tiny", False)]:
        path = spec_file(tmp_path, f"long_{seq_len}", {"fsdp": -1}, seq_len=seq_len, base=base)
        spec = load_spec(path)
        meshes = planner._meshes(spec, plan_for(spec, "gpu-h100-8"), build(path, "gpu-h100-8"))
        contexts = {dict(mesh)["context"] for mesh in meshes}
        assert contexts == ({1, 2, 4, 8} if expect_context else {1}), contexts


@pytest.mark.parametrize("name", ["hf_gemma2", "hf_gemma3"])
def test_gemma_over_four_context_shards_gives_transformers_logits(name, tmp_path):
    """The tiny Gemma 2 and Gemma 3 of tests/fixtures (windowed and global layers, soft-capped scores and logits,
    Gemma 3's grouped scan and q/k norms), their 24 tokens over context=4 (8 chunks of 3) x model=2: the forward's
    logits are HF transformers' (the fixtures' own, computed with transformers), as on one device."""
    fixture = np.load(ROOT / f"tests/fixtures/{name}.npz")
    spec = tmp_path / f"{name}_context.py"
    spec.write_text(
        f"from tests.fixtures.{name}_spec import spec as tiny\nfrom axgen.spec import MeshRule\n"
        "spec = tiny.replace(mesh_rules=[MeshRule('cpu-8', {'context': 4, 'model': 2}, why='test')],"
        " targets=['cpu-8'])\n"
    )
    built = build(spec, "cpu-8")
    assert 'context="all_gather"' in built.source
    out = tmp_path / f"{name}.py"
    write_atomically(out, built.source)
    module = load_program(out)
    state_dict = {k: fixture[k] for k in fixture.files if k.startswith(("model.", "lm_head."))}
    params = hf_to_params(state_dict, built.spec)
    with jax.set_mesh(Program.from_module(module).make_mesh()):
        logits = jax.jit(module.forward)(params, jnp.asarray(fixture["input_ids"]))
    np.testing.assert_allclose(np.asarray(logits), fixture["logits"], atol=1e-4, rtol=1e-4)


def moe_spec(tmp_path, name, mesh, **routing):
    """moe_tiny with its experts split 2 ways on `mesh`, its routing's fields replaced by `routing`."""
    path = tmp_path / f"{name}.py"
    path.write_text(
        "from axgen.spec import MeshRule\nfrom axgen.specs.moe_tiny import spec as moe\n"
        f"feature = moe.feature('moe').replace(**{routing!r})\n"
        "spec = moe.replace(features=[feature if f.pass_name == 'moe' else f for f in moe.features],"
        f" mesh_rules=[MeshRule('cpu-8', {mesh!r}, why='test')])\n"
    )
    return path


# Slow tier: about 40 s a case on 2 cores (two MoE programs compiled with their gradients).
@pytest.mark.slow
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
            seq_aux_loss_weight=0.01,
        ),
    ],
    ids=["mixtral", "deepseek_v3"],
)
def test_dropless_experts_over_context_shards_route_as_over_whole_sequences(tmp_path, routing):
    """moe_tiny's dropless experts (split over expert=2, tokens all-gathered in the expert group) with each
    sequence over context=2 give context=1's loss, auxiliary losses (load balance, z-loss; with DeepSeek-V3's
    routing the sequence-wise balance loss, whose per-sequence means span the shards) and gradients, the
    correction bias's loads included."""
    results = {}
    meshes = [
        ("whole", {"data": 2, "fsdp": 2, "expert": 2}),
        ("split", {"data": 2, "context": 2, "expert": 2}),
    ]
    for name, mesh in meshes:
        out = tmp_path / f"moe_{name}.py"
        write_atomically(out, build(moe_spec(tmp_path, name, mesh, **routing), "cpu-8").source)
        module = load_program(out)
        program = Program.from_module(module)
        mesh = program.make_mesh()
        tokens, segment_ids, loss_mask = packed_batch(True)
        with jax.set_mesh(mesh):
            params = jax.device_put(module.init_params(jax.random.key(0)), program.param_shardings(mesh))
            grad = jax.jit(jax.value_and_grad(module.loss_fn, has_aux=True))
            (loss, metrics), grads = grad(params, tokens, segment_ids, loss_mask)
        results[name] = loss, metrics, jax.tree.map(np.asarray, grads)
    (loss, metrics, grads), (split_loss, split_metrics, split_grads) = results["whole"], results["split"]
    assert "seq_balance_loss" in metrics or not routing
    np.testing.assert_allclose(split_loss, loss, rtol=1e-6)
    for name in metrics:
        np.testing.assert_allclose(split_metrics[name], metrics[name], rtol=1e-5, err_msg=name)
    for (path, g), split_g in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(split_grads)):
        np.testing.assert_allclose(
            split_g, g, atol=1e-6 * np.abs(g).max() + 1e-9, err_msg=jax.tree_util.keystr(path)
        )
