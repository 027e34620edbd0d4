"""Every target's program of the tiny spec runs on CPU (chip-only kernels swapped by the one marked switch): its
forward matches the fp32 reference, and its training loop on its own mesh, emulated by fake devices, gives the
losses of the same program on one device. Model variants the spec allows (tied embeddings, LayerNorm, GELU) emit
programs that run."""

import concurrent.futures
import re

import jax
import numpy as np
import pytest

from axgen.build import build
from axgen.files import write_atomically
from axgen.interop import load_program
from tests.conftest import ROOT, STEP_LINE, program_args, run_python

TINY = ROOT / "axgen/specs/llama_tiny.py"
TARGETS = ["tpu-v5e-8", "tpu-v5e-4x2", "gpu-h100-8", "trn2-16", "cpu-8"]


@pytest.fixture(scope="module")
def reference():
    program = load_program(ROOT / "generated/llama_tiny/cpu_1.py")
    params = program.init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    return params, tokens, np.asarray(jax.jit(program.forward)(params, tokens))


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_program_matches_the_cpu_reference(target, reference, monkeypatch):
    monkeypatch.setenv("AXGEN_XLA_KERNELS", "1")
    program = load_program(ROOT / "generated/llama_tiny" / f"{target.replace('-', '_')}.py")
    params, tokens, expected = reference
    logits = np.asarray(jax.jit(program.forward)(params, tokens), dtype=np.float32)
    tolerance = 0.05 if program.COMPUTE_DTYPE == jax.numpy.bfloat16 else 1e-5
    np.testing.assert_allclose(logits, expected, atol=tolerance * np.abs(expected).max())


def run_main(program, devices, single_device, corpus, ckpt_dir, steps=3):
    mode = ["--single-device"] if single_device else []
    runner = str(ROOT / "tests/run_program.py")
    return run_python(runner, str(program), str(devices), *mode, "--", *program_args(corpus, ckpt_dir, steps))


# Two processes a target (its mesh, one device), each compiling: 15-20 s a target on 2 cores. The CPU and one TPU
# target are in the quick tier; the slice pair, the H100 and Trainium in the slow one.
@pytest.mark.parametrize(
    "target",
    [
        target if target in ("tpu-v5e-8", "cpu-8") else pytest.param(target, marks=pytest.mark.slow)
        for target in TARGETS
    ],
)
def test_every_target_trains_on_its_mesh_as_on_one_device(target, corpus, tmp_path):
    program = ROOT / "generated/llama_tiny" / f"{target.replace('-', '_')}.py"
    mesh = dict(
        re.findall(r'"(\w+)": (\d+)', re.search(r"^MESH_SHAPE = (.*)$", program.read_text(), re.M)[1])
    )
    devices = int(np.prod([int(n) for n in mesh.values()]))
    # The two runs are separate processes: side by side, they take the time of one on two cores.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sharded_log, single_log = pool.map(
            lambda single: run_main(program, devices, single, corpus, tmp_path / f"single_{single}"),
            (False, True),
        )

    assert f"on {devices} devices" in sharded_log and "on 1 devices" in single_log
    sharded = [float(loss) for _, loss in STEP_LINE.findall(sharded_log)]
    single = [float(loss) for _, loss in STEP_LINE.findall(single_log)]
    assert len(sharded) == len(single) == 3
    # bf16 matmuls reduce in a different order when sharded; fp32 programs agree far more closely.
    tolerance = 1e-5 if "COMPUTE_DTYPE = jnp.float32" in program.read_text() else 2e-3
    np.testing.assert_allclose(sharded, single, rtol=tolerance)


def variant(tmp_path, **changes):
    path = tmp_path / "variant.py"
    args = ", ".join(f"{k}={v}" for k, v in changes.items())
    path.write_text(
        f"from axgen.specs.llama_tiny import spec as tiny\nfrom axgen.spec import *\nspec = tiny.replace({args})\n"
    )
    out = tmp_path / "program.py"
    write_atomically(out, build(path, "cpu-1").source)
    return load_program(out)


def test_tied_embeddings_reuse_the_input_table(tmp_path):
    program = variant(tmp_path, tie_embeddings=True)
    assert "lm_head" not in program.PARAMS
    params = program.init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 256)
    logits = program.forward(params, tokens)
    params["embed"] = params["embed"] * 2.0
    assert not np.allclose(np.asarray(program.forward(params, tokens)), np.asarray(logits))


def test_layer_norm_and_gelu_variant_runs(tmp_path):
    decoder = "tiny.decoder.replace(norm=LayerNorm(eps=1e-6), mlp=MLP(hidden_dim=256, activation='gelu'))"
    program = variant(tmp_path, decoder=decoder)
    assert {"attn_norm_scale", "attn_norm_bias", "w_up", "w_down"} <= set(program.PARAMS["layers"])
    assert "w_gate" not in program.PARAMS["layers"]
    x = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)
    scale, bias = np.full(64, 1.5, np.float32), np.full(64, 0.25, np.float32)
    expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6) * scale + bias
    np.testing.assert_allclose(
        np.asarray(program.layer_norm(x, scale, bias, eps=1e-6)), expected, rtol=1e-5, atol=1e-5
    )
    logits = program.forward(program.init_params(jax.random.key(0)), np.zeros((1, 8), np.int32))
    assert logits.shape == (1, 8, program.CONFIG["vocab_size"]) and np.isfinite(np.asarray(logits)).all()
