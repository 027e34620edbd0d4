"""gpt-oss's experts (F.gpt_oss_experts): the clamped SwiGLU by hand, biases through the dropless path sharded over
data, expert and model axes as on one device, and the capacity path with room for every token as the dropless.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axgen.build import build
from axgen.files import write_atomically
from axgen.interop import load_program
from axgen.runtime.program import Program


def gpt_oss_moe_tiny(tmp_path, target="cpu-8", capacity_factor=None):
    spec = tmp_path / f"oss_{capacity_factor or 'dropless'}.py"
    spec.write_text(
        "from specs.moe_tiny import spec as tiny\nfrom axgen.spec import features as F\n"
        f"moe = tiny.feature('moe').replace(capacity_factor={capacity_factor!r})\n"
        "spec = tiny.replace(features=[tiny.feature('rope'), moe, F.gpt_oss_experts(alpha=1.702, limit=0.05)])\n"
    )
    path = tmp_path / f"{spec.stem}_{target.replace('-', '_')}.py"
    write_atomically(path, build(spec, target).source)
    return load_program(path)


def biased_params(program):
    """init_params, with the biases (zeros at init) drawn too, so that each one changes the output."""
    params = program.init_params(jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(7), 8))
    for name in ("router_bias", "b_gate", "b_up", "b_down"):
        value = params["moe_layers"][name]
        params["moe_layers"][name] = 0.05 * jax.random.normal(next(keys), value.shape, value.dtype)
    return params


def test_clamped_swiglu_by_hand(tmp_path):
    program = gpt_oss_moe_tiny(tmp_path, "cpu-1")
    gate, up = (jnp.linspace(-0.2, 0.2, 9) * s for s in (1.0, -1.5))
    g, u = np.minimum(np.asarray(gate), 0.05), np.clip(np.asarray(up), -0.05, 0.05)
    expected = (u + 1) * g / (1 + np.exp(-1.702 * g))
    np.testing.assert_allclose(program.expert_mlp(None, gate, up), expected, rtol=1e-6)


@pytest.mark.parametrize(
    "mesh_shape", [(2, 1, 2, 2), (1, 2, 2, 2)], ids=["data_expert_model", "fsdp_expert_model"]
)
def test_sharded_biased_experts_equal_one_device(mesh_shape, tmp_path):
    """The expert biases split with their weights' outputs; the down projection's is added once over the model
    axis that splits the hidden units. Loss and every gradient equal the one-device run."""
    program = gpt_oss_moe_tiny(tmp_path)
    params = biased_params(program)
    tokens = jax.random.randint(jax.random.key(2), (8, 17), 0, 256)
    grad_fn = jax.value_and_grad(program.loss_fn, has_aux=True)
    (loss, _), grads = grad_fn(params, tokens)
    mesh = jax.make_mesh(
        mesh_shape, ("data", "fsdp", "expert", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 4
    )
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, Program.from_module(program).param_shardings(mesh))
        assert placed["moe_layers"]["b_up"].sharding.spec[:3] == (None, "expert", "model")
        (sharded_loss, _), sharded_grads = jax.jit(grad_fn)(placed, tokens)
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-5)

    def check(path, grad, expected):
        assert float(jnp.abs(expected).max()) > 0, jax.tree_util.keystr(path)
        atol = 1e-5 * float(jnp.abs(expected).max())
        np.testing.assert_allclose(grad, expected, atol=atol, err_msg=jax.tree_util.keystr(path))

    jax.tree_util.tree_map_with_path(check, sharded_grads["moe_layers"], grads["moe_layers"])


def test_capacity_path_with_room_for_every_token_equals_dropless(tmp_path):
    dropless = gpt_oss_moe_tiny(tmp_path, "cpu-1")
    roomy = gpt_oss_moe_tiny(tmp_path, "cpu-1", capacity_factor=2.0)
    params = biased_params(dropless)
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
    logits, aux = roomy.forward_with_aux(params, tokens)
    assert float(aux["dropped_fraction"]) == 0.0
    np.testing.assert_allclose(logits, dropless.forward(params, tokens), atol=1e-5)
    unbiased = {
        **params,
        "moe_layers": {**params["moe_layers"], "b_down": jnp.zeros_like(params["moe_layers"]["b_down"])},
    }
    assert not np.allclose(dropless.forward(unbiased, tokens), logits, atol=1e-4)
