"""F.moe(first_dense_layers=k, dense_hidden_dim=h): DeepSeek's first_k_dense_replace, the first k layers dense with
an MLP of their own width, scanned apart before the MoE layers. A model with
one trains in tests/test_mla.py, the suite's one training run of a MoE program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axgen.build import build
from axgen.files import write_atomically
from axgen.interop import hf_to_params, load_program, params_to_hf
from axgen.loader import load_spec
from axgen.spec import SpecError

HEAD = dict(every=1, first_dense_layers=1, dense_hidden_dim=256, scoring="sigmoid", balance_bias_rate=1e-3)


def spec_with(tmp_path, name, **moe):
    spec = tmp_path / "specs" / f"{name}.py"
    spec.parent.mkdir(exist_ok=True)
    spec.write_text(
        "from axgen.specs.moe_tiny import spec as tiny\n"
        f"moe = tiny.feature('moe').replace(**{moe!r})\n"
        "spec = tiny.replace(features=[moe if f.pass_name == 'moe' else f for f in tiny.features])\n"
    )
    return spec


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("first_dense")
    spec = spec_with(tmp_path, "head", **HEAD)
    out = tmp_path / "head.py"
    write_atomically(out, build(spec, "cpu-1").source)
    return load_spec(spec), load_program(out)


def test_the_first_layers_are_a_dense_scan_of_their_own_width_before_the_moe_layers(head):
    _, program = head
    dense, moe = program.PARAMS["dense_layers"], program.PARAMS["layers"]
    assert (dense["w_gate"].shape, dense["w_down"].shape) == ((1, 128, 256), (1, 256, 128))
    assert moe["w_gate"].shape == (3, 4, 128, 384) and "router" not in dense
    assert list(program.PARAMS)[:3] == ["embed", "dense_layers", "layers"]
    source = open(program.__file__).read()
    assert "def dense_decoder_layer(x, p, positions, segment_ids):" in source
    assert source.index("dense_layers, _ = jax.lax.scan(") < source.index(
        "layers, layers_aux = jax.lax.scan("
    )


def test_a_dense_layer_computes_what_a_dense_llama_layer_of_that_width_does(head, tmp_path):
    """The head's layer function on a Llama layer's params of width 256 gives what that Llama's layer gives."""
    _, program = head
    spec = tmp_path / "specs" / "dense256.py"
    spec.parent.mkdir()
    spec.write_text(
        "from axgen.specs.llama_tiny import spec as tiny\n"
        "spec = tiny.replace(decoder=tiny.decoder.replace(mlp=tiny.decoder.mlp.replace(hidden_dim=256)))\n"
    )
    write_atomically(tmp_path / "dense256.py", build(spec, "cpu-1").source)
    llama = load_program(tmp_path / "dense256.py")
    layer = jax.tree.map(lambda w: w[0], llama.init_params(jax.random.key(0))["layers"])
    x = jax.random.normal(jax.random.key(1), (2, 16, 128))
    positions, segment_ids = jnp.broadcast_to(jnp.arange(16), (2, 16)), jnp.ones((2, 16), jnp.int32)
    np.testing.assert_array_equal(
        program.dense_decoder_layer(x, layer, positions, segment_ids),
        llama.decoder_layer(x, layer, positions, segment_ids),
    )


def test_hf_names_number_the_dense_layers_first(head):
    spec, program = head
    params = program.init_params(jax.random.key(0))
    tensors = params_to_hf(params, spec)
    assert tensors["model.layers.0.mlp.gate_proj.weight"].shape == (256, 128)
    assert "model.layers.0.mlp.gate.weight" not in tensors
    assert tensors["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 768, 128)
    for layer in (1, 2, 3):
        assert tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"].shape == (4,)
    back = hf_to_params(tensors, spec)
    jax.tree.map(np.testing.assert_array_equal, back, params)


@pytest.mark.parametrize(
    "moe, message",
    [
        (
            dict(first_dense_layers=4, dense_hidden_dim=256, every=1),
            r"MoE.first_dense_layers=4 leaves no MoE layer of Decoder.num_layers=4$",
        ),
        (
            dict(first_dense_layers=1, every=1),
            r"MoE.dense_hidden_dim=None is needed for the first_dense_layers=1$",
        ),
        (
            dict(dense_hidden_dim=256),
            r"MoE.dense_hidden_dim=256 is the width of the first dense layers: set first_dense_layers$",
        ),
        (
            dict(first_dense_layers=1, dense_hidden_dim=256),
            r"MoE.every=2 must be 1 with first_dense_layers \(the dense layers between would differ\)$",
        ),
        (dict(first_dense_layers=-1), r"MoE.first_dense_layers=-1 must be >= 0$"),
        (dict(first_dense_layers=1, dense_hidden_dim=0, every=1), r"MoE.dense_hidden_dim=0 must be > 0$"),
    ],
)
def test_first_dense_values_that_cannot_be_are_one_line(tmp_path, moe, message):
    with pytest.raises(SpecError, match=message):
        load_spec(spec_with(tmp_path, "bad", **moe))
