"""Remat: every policy keeps the gradients, each saves a different set of residuals, backends set defaults that
the spec overrides, and host offload is refused where the chip has no host memory to offload to."""

import contextlib
import io

import jax
import numpy as np
import pytest

from axgen.build import build
from axgen.files import write_atomically
from axgen.interop import load_program
from axgen.spec import REMAT_POLICIES, SpecError
from tests.conftest import ROOT


def remat_program(tmp_path, policy, target="cpu-1", base="llama_tiny", moe_capacity=None):
    path = tmp_path / f"remat_{policy}_{base}_{moe_capacity}.py"
    features = (
        "*tiny.features"
        if moe_capacity is None
        else (f"*tiny.features[:-1], tiny.feature('moe').replace(capacity_factor={moe_capacity})")
    )
    path.write_text(
        f"from axgen.specs.{base} import spec as tiny\n"
        "from axgen.spec import features as F\n"
        f"spec = tiny.replace(features=[{features}, F.remat(policy={policy!r})])\n"
    )
    out = tmp_path / f"{path.stem}_{target.replace('-', '_')}.py"
    write_atomically(out, build(path, target).source)
    return load_program(out)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remat")
    # The offload policy builds only for a chip with host memory; its program runs here on the XLA kernels.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AXGEN_XLA_KERNELS", "1")
        return {
            p: remat_program(tmp, p, "gpu-h100-1" if p.startswith("offload") else "cpu-1")
            for p in REMAT_POLICIES
        }


@pytest.fixture(scope="module")
def batch():
    program = load_program(ROOT / "generated/llama_tiny/cpu_1.py")
    return program.init_params(jax.random.key(0)), jax.random.randint(jax.random.key(1), (2, 17), 0, 256)


def test_gradients_equal_those_without_remat(programs, batch):
    params, tokens = batch
    expected = jax.jit(jax.grad(programs["none"].loss_fn, has_aux=True))(params, tokens)[0]
    for policy, program in programs.items():
        if program.COMPUTE_DTYPE != jax.numpy.float32:
            program.COMPUTE_DTYPE = jax.numpy.float32  # the gpu program's bf16 would hide a wrong gradient
        # Compiled, as a train step runs it: op by op, each policy's step took 2 s.
        grads = jax.jit(jax.grad(program.loss_fn, has_aux=True))(params, tokens)[0]
        for (path, got), want in zip(
            jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected), strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=f"{policy} {path}")


def residuals(program, params, tokens) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda p, t: program.loss_fn(p, t)[0], params, tokens)
    return out.getvalue()


def test_each_policy_saves_different_residuals(programs, batch):
    params, tokens = batch
    saved = {policy: residuals(program, params, tokens) for policy, program in programs.items()}
    assert len(set(saved.values())) == len(saved), "two policies save the same residuals"
    sizes = {policy: len(text.splitlines()) for policy, text in saved.items()}
    assert (
        sizes["full"]
        < sizes["save_qkv_proj"]
        < sizes["save_dots_except_mlp"]
        < sizes["save_dots"]
        < sizes["none"]
    )
    offloaded = [line for line in saved["offload_dots"].splitlines() if "<host>[" in line]
    assert len(offloaded) == 6, "q, k, v, the attention output and both MLP inputs live in host memory"
    assert not any("<host>[" in text for policy, text in saved.items() if policy != "offload_dots")


def test_backend_default_applies_and_the_spec_overrides_it(tmp_path):
    tpu = build(ROOT / "axgen/specs/llama_tiny.py", "tpu-v5e-8").source
    assert "remat(policy=save_dots_except_mlp) (backends/tpu.py: remat default)" in tpu
    assert 'REMAT_POLICY = jax.checkpoint_policies.save_only_these_names("qkv_proj", "out_proj")' in tpu
    path = tmp_path / "no_remat.py"
    path.write_text(
        "from axgen.specs.llama_tiny import spec as tiny\n"
        "from axgen.spec import features as F\n"
        "spec = tiny.replace(features=[*tiny.features, F.remat(policy='none')])\n"
    )
    overridden = build(path, "tpu-v5e-8").source
    assert "jax.checkpoint" not in overridden and "remat(policy=none)" in overridden
    assert "jax.checkpoint" not in build(ROOT / "axgen/specs/llama_tiny.py", "cpu-8").source


def test_cpu_refuses_host_offload(tmp_path):
    with pytest.raises(
        SpecError,
        match=r"remat_offload_dots_llama_tiny_None.py:3: remat\(policy=offload_dots\) needs host_offload, "
        r"which target cpu-8 \(host CPU core\) does not have \(it has int8\)",
    ):
        remat_program(tmp_path, "offload_dots", "cpu-8")


@pytest.mark.parametrize(
    "capacity_factor",
    [
        pytest.param(None, id="dropless"),
        # slow tier: the capacity path names its products by the same `_named` as the dropless one
        pytest.param(2.0, id="capacity", marks=pytest.mark.slow),
    ],
)
def test_policies_save_or_recompute_the_experts_products_as_they_do_a_dense_mlp(tmp_path, capacity_factor):
    programs = {
        policy: remat_program(tmp_path, policy, base="moe_tiny", moe_capacity=capacity_factor)
        for policy in ("none", "save_dots", "save_dots_except_mlp")
    }
    params = programs["none"].init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    # The MoE layers' expert products, stacked over their 2 layers: [layers, rows, hidden or embed], rows being
    # the batch's tokens x top_k without capacity, [layers, batch, experts, slots, ...] with it.
    rows = "2,64" if capacity_factor is None else "2,2,4,16"
    products = [f"f32[{rows},384]", f"f32[{rows},384]", f"f32[{rows},128]"]
    saved = {policy: residuals(program, params, tokens) for policy, program in programs.items()}
    assert [shape for shape in products if f"{shape} output of scan" in saved["save_dots"]] == products
    assert not any(f"{shape} output of scan" in saved["save_dots_except_mlp"] for shape in products)
    expected = jax.jit(jax.grad(programs["none"].loss_fn, has_aux=True))(params, tokens)[0]
    got = jax.jit(jax.grad(programs["save_dots"].loss_fn, has_aux=True))(params, tokens)[0]
    for (path, g), want in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7, err_msg=str(path))
