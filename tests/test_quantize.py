"""Quantization: the quantized dots' errors stay within their documented bounds, gradients pass straight through,
a tiny model trains with each dtype about as well as without, and targets refuse dtypes they lack."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axgen.build import build
from axgen.files import write_atomically
from axgen.interop import load_program
from axgen.passes import PassError
from axgen.spec import SpecError
from tests.conftest import ROOT
from axgen.runtime import dataset, quantize
from axgen.runtime.program import Program

NAMES = itertools.count()


def variant(tmp_path, quantize_args, base="llama_tiny", name=None):
    name = name or f"q_{next(NAMES)}"
    path = tmp_path / f"{name}.py"
    path.write_text(
        f"from axgen.specs.{base} import spec as base\n"
        "from axgen.spec import features as F\n"
        f"spec = base.replace(features=[*base.features, F.quantize({quantize_args})])\n"
    )
    return path


def program(tmp_path, quantize_args, target="cpu-1", base="llama_tiny"):
    path = variant(tmp_path, quantize_args, base)
    out = path.with_name(path.stem + "_program.py")
    write_atomically(out, build(path, target).source)
    return load_program(out)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quantize")
    return {
        "int8": program(tmp, 'dtype="int8"'),
        "fp8": program(tmp, 'dtype="fp8", emulate=True'),
        "fp8_delayed": program(tmp, 'dtype="fp8", scaling="delayed", amax_history=4, emulate=True'),
    }


EINSUMS = [("bse,ef->bsf", (4, 16, 64), (64, 48)), ("bshd,hde->bse", (2, 8, 4, 16), (4, 16, 32))]


@pytest.mark.parametrize("spec, x_shape, w_shape", EINSUMS)
def test_int8_dot_error_is_within_its_documented_bound(spec, x_shape, w_shape):
    x = np.asarray(jax.random.normal(jax.random.key(0), x_shape))
    w = np.asarray(jax.random.normal(jax.random.key(1), w_shape)) * 0.05
    got = np.asarray(quantize.int8_einsum(spec, jnp.asarray(x), jnp.asarray(w)))
    exact = np.einsum(spec, x.astype(np.float64), w.astype(np.float64))
    _, _, _, x_axes, w_axes = quantize.einsum_operands(spec)
    x_scale = np.abs(x).max(axis=x_axes, keepdims=True) / 127
    w_scale = np.abs(w).max(axis=w_axes, keepdims=True) / 127
    products = np.prod([x.shape[a] for a in x_axes])
    bound = (
        np.einsum(spec, np.abs(x), np.broadcast_to(w_scale, w.shape)) / 2
        + np.einsum(spec, np.broadcast_to(x_scale, x.shape), np.abs(w)) / 2
        + np.einsum(spec, x_scale, w_scale) * products / 4
    )
    assert np.all(np.abs(got - exact) <= bound * (1 + 1e-5) + 1e-6)
    assert np.abs(got - exact).max() > 0, "an exact result means nothing was quantized"
    assert np.linalg.norm(got - exact) < 0.02 * np.linalg.norm(exact)


@pytest.mark.parametrize("spec, x_shape, w_shape", EINSUMS)
def test_fp8_dot_error_is_within_its_documented_bound(spec, x_shape, w_shape):
    x = np.asarray(jax.random.normal(jax.random.key(2), x_shape))
    w = np.asarray(jax.random.normal(jax.random.key(3), w_shape)) * 0.05
    got = np.asarray(quantize.fp8_einsum(spec, jnp.asarray(x), jnp.asarray(w)))
    exact = np.einsum(spec, x.astype(np.float64), w.astype(np.float64))
    # Each operand is within 2^-4 relative or 2^-10 * its per-tensor scale (max|.| / 448) absolute.
    rel, x_abs, w_abs = 2.0**-4, 2.0**-10 * np.abs(x).max() / 448, 2.0**-10 * np.abs(w).max() / 448
    x_err, w_err = rel * np.abs(x) + x_abs, rel * np.abs(w) + w_abs
    bound = np.einsum(spec, np.abs(x), w_err) + np.einsum(spec, x_err, np.abs(w) + w_err)
    assert np.all(np.abs(got - exact) <= bound * (1 + 1e-5) + 1e-6)
    assert np.linalg.norm(got - exact) < 0.1 * np.linalg.norm(exact)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_gradients_pass_straight_through(dtype):
    spec = "bse,ef->bsf"
    x = jax.random.normal(jax.random.key(4), (2, 8, 32))
    w = jax.random.normal(jax.random.key(5), (32, 16)) * 0.1
    einsum = getattr(quantize, f"{dtype}_einsum")
    got = jax.grad(lambda x, w: einsum(spec, x, w).sum(), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.einsum(spec, x, w).sum(), argnums=(0, 1))(x, w)
    # int8 differentiates the bf16 einsum; fp8 multiplies e5m2 gradients by the e4m3 operands (as Transformer
    # Engine does), whose sums cancel to within a few percent of the operands' size.
    tolerance = {"int8": 0.01, "fp8": 0.1}[dtype]
    for g, e in zip(got, want):
        assert np.linalg.norm(np.asarray(g) - np.asarray(e)) < tolerance * np.linalg.norm(np.asarray(e))


def train_losses(program, corpus, steps=30, batch=8):
    split = dataset.PackedSplit(corpus, "train", program.CONFIG["seq_len"])
    data = dataset.Batches(split, batch, seed=0, vocab_size=program.CONFIG["vocab_size"])
    state = Program.from_module(program).init_state(jax.random.key(0))
    step = jax.jit(program.train_step)
    losses = []
    for i in range(steps):
        state, metrics = step(state, *data.local_batch(i))
        losses.append(float(metrics["loss"]))
    return np.array(losses)


# slow tier: 30 steps of four programs, each compiled (39 s on 2 cores)
@pytest.mark.slow
def test_each_dtype_trains_within_ten_percent_of_the_unquantized_run(programs, corpus):
    baseline = train_losses(load_program(ROOT / "generated/llama_tiny/cpu_1.py"), corpus)
    assert baseline[-5:].mean() < baseline[0] - 1.5
    for dtype, quantized in programs.items():
        losses = train_losses(quantized, corpus)
        assert losses[-5:].mean() <= 1.1 * baseline[-5:].mean(), (dtype, losses[-5:], baseline[-5:])


def test_delayed_scaling_keeps_a_history_of_amaxes_that_the_optimizer_leaves_alone(programs):
    program = programs["fp8_delayed"]
    assert not program.PARAMS["layers"]["q_amax_history"].trained
    state = Program.from_module(program).init_state(jax.random.key(0))
    wq = np.asarray(state["params"]["layers"]["wq"])
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    step = jax.jit(program.train_step)
    state, _ = step(state, tokens)
    history = np.asarray(state["params"]["layers"]["q_amax_history"])  # [layers, steps, (x, w, gradient)]
    np.testing.assert_array_equal(history[:, 0, 1], np.abs(wq).max(axis=(1, 2, 3)))
    assert np.all(history[:, 0] > 0) and np.all(history[:, 1:] == 0)
    state, _ = step(state, tokens)
    rolled = np.asarray(state["params"]["layers"]["q_amax_history"])
    np.testing.assert_array_equal(rolled[:, 1], history[:, 0])


def test_targets_refuse_dtypes_they_lack_unless_emulated(tmp_path):
    with pytest.raises(
        SpecError, match=r":3: quantize\(dtype=fp8\) needs fp8, which target tpu-v5e-8 \(TPU v5e\)"
    ):
        build(variant(tmp_path, 'dtype="fp8"'), "tpu-v5e-8")
    with pytest.raises(
        SpecError, match=r"quantize\(dtype=int8\) needs int8, which target trn2-16 \(AWS Trainium2\)"
    ):
        build(variant(tmp_path, 'dtype="int8"'), "trn2-16")
    assert "runtime.fp8_einsum(" in build(variant(tmp_path, 'dtype="fp8", emulate=True'), "tpu-v5e-8").source


def test_the_target_picks_the_dtype_when_the_spec_does_not(tmp_path):
    path = variant(tmp_path, "")
    assert (
        "runtime.int8_einsum(" in build(path, "tpu-v5e-8").source
        and "fp8_einsum" not in build(path, "tpu-v5e-8").source
    )
    assert (
        "runtime.fp8_einsum(" in build(path, "gpu-h100-8").source
        and "int8_einsum" not in build(path, "gpu-h100-8").source
    )


def test_router_and_output_head_only_when_asked(tmp_path):
    default = build(variant(tmp_path, 'dtype="int8"', base="moe_tiny"), "cpu-1").graph
    quantized = {str(n) for n in default.nodes() if getattr(n.attrs, "quantize", None)}
    assert "moe_layers/router" not in quantized and "main/logits" not in quantized
    assert {"layers/q", "moe_layers/q", "layers/mlp_out"} <= quantized
    asked = build(
        variant(tmp_path, r'dtype="int8", include=r".*/(router|logits)"', base="moe_tiny"), "cpu-1"
    ).graph
    assert {str(n) for n in asked.nodes() if getattr(n.attrs, "quantize", None)} == {
        "moe_layers/router",
        "main/logits",
    }


def test_a_selection_that_matches_nothing_is_an_error(tmp_path):
    with pytest.raises(PassError, match=r"quantize\(dtype=int8, include=layers/nothing\) selects none"):
        build(variant(tmp_path, 'dtype="int8", include="layers/nothing"'), "cpu-1")


def test_a_quantized_output_head_keeps_its_logits_for_the_loss(tmp_path):
    """The fused loss multiplies by the head's weight itself, so a quantized head leaves the loss its logits; the
    default head fuses (the lowering says which, and the header names the loss)."""
    quantized = build(variant(tmp_path, 'dtype="int8", include="main/logits"'), "cpu-1")
    (head,) = quantized.graph.nodes(op="lm_head")
    assert head.attrs.loss == "logits"
    assert "# Loss: runtime.cross_entropy on the whole logits (a quantized head;" in quantized.source
    assert "losses = runtime.cross_entropy(logits, tokens[:, 1:])" in quantized.source
    assert "hidden_with_aux" not in quantized.source
    default = build(variant(tmp_path, 'dtype="int8"'), "cpu-1")
    (head,) = default.graph.nodes(op="lm_head")
    assert (head.attrs.loss, head.attrs.loss_chunk) == ("fused", 128)
    assert "losses = runtime.lm_head_cross_entropy(" in default.source
