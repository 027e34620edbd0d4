"""gpt-oss's experts (F.gpt_oss_experts): the clamped SwiGLU by hand, biases through the dropless path sharded over
data, expert and model axes as on one device, and the capacity path with room for every token as the dropless.
"""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from tests.conftest import ROOT, moe_options

from axgen import runtime
from axgen.build import build
from axgen.cli import main as axgen
from axgen.files import write_atomically
from axgen.hf.export import hf_config, load_params
from axgen.hf.storage import dequantize_mxfp4
from axgen.hf.import_config import import_config
from axgen.interop import load_program
from axgen.loader import load_spec
from axgen.runtime.program import Program


def gpt_oss_moe_tiny(tmp_path, target="cpu-8", capacity_factor=None):
    spec = tmp_path / f"oss_{capacity_factor or 'dropless'}.py"
    spec.write_text(
        "from axgen.specs.moe_tiny import spec as tiny\nfrom axgen.spec import features as F\n"
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
    options = moe_options(program)
    clamped = {k: options[k] for k in ("activation", "swiglu_limit", "swiglu_alpha")}
    assert clamped == {"activation": "clamped_swiglu", "swiglu_limit": 0.05, "swiglu_alpha": 1.702}
    np.testing.assert_allclose(runtime.expert_mlp(gate, up, **clamped), expected, rtol=1e-6)


@pytest.mark.parametrize(
    "mesh_shape",
    [
        # slow tier: 22 s on 2 cores; the fsdp x expert x model mesh stays in the quick one
        pytest.param((2, 1, 2, 2), id="data_expert_model", marks=pytest.mark.slow),
        pytest.param((1, 2, 2, 2), id="fsdp_expert_model"),
    ],
)
def test_sharded_biased_experts_equal_one_device(mesh_shape, tmp_path):
    """The expert biases split with their weights' outputs; the down projection's is added once over the model
    axis that splits the hidden units. Loss and every gradient equal the one-device run."""
    program = gpt_oss_moe_tiny(tmp_path)
    params = biased_params(program)
    tokens = jax.random.randint(jax.random.key(2), (8, 17), 0, 256)
    grad_fn = jax.value_and_grad(program.loss_fn, has_aux=True)
    (loss, _), grads = jax.jit(grad_fn)(params, tokens)
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
    logits, aux = jax.jit(roomy.forward_with_aux)(params, tokens)
    assert float(aux["dropped_fraction"]) == 0.0
    dropless_forward = jax.jit(dropless.forward)  # one compile for both sets of params
    np.testing.assert_allclose(logits, dropless_forward(params, tokens), atol=1e-5)
    unbiased = {
        **params,
        "moe_layers": {**params["moe_layers"], "b_down": jnp.zeros_like(params["moe_layers"]["b_down"])},
    }
    assert not np.allclose(dropless_forward(unbiased, tokens), logits, atol=1e-4)


# --- import, MXFP4 experts, convert-hf ----------------------------------------------------------------------------

FIXTURES = ROOT / "tests/fixtures"


def test_mxfp4_dequantization_equals_transformers():
    """hf_mxfp4.npz: random blocks (every code in both nibbles) and scales across the e8m0 range, and what
    transformers' convert_moe_packed_tensors makes of them, in bfloat16 (bit for bit) and float32."""
    fixture = np.load(FIXTURES / "hf_mxfp4.npz")
    bf16 = dequantize_mxfp4(fixture["blocks"], fixture["scales"], ml_dtypes.bfloat16, "w")
    assert bf16.shape == fixture["float32"].shape == (3, 64, 10)
    np.testing.assert_array_equal(bf16.view(np.int16), fixture["bfloat16_bits"])
    np.testing.assert_array_equal(
        dequantize_mxfp4(fixture["blocks"], fixture["scales"], np.float32, "w"), fixture["float32"]
    )


def hub_folder(tmp_path, **changes) -> Path:
    """hf_gpt_oss_hub.npz as a checkpoint folder: the experts as the Hub stores gpt-oss's, MXFP4."""
    tensors = dict(np.load(FIXTURES / "hf_gpt_oss_hub.npz")) | changes
    tensors = {k: v for k, v in tensors.items() if v is not None}
    (tmp_path / "hub").mkdir()
    save_file(tensors, str(tmp_path / "hub/model.safetensors"))
    return tmp_path / "hub"


def convert(capsys, folder, out) -> tuple[int, str]:
    code = axgen(["convert-hf", str(FIXTURES / "hf_gpt_oss_spec.py"), "--hf", str(folder), "--out", str(out)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_hubs_mxfp4_experts_convert_to_hfs_logits(tmp_path, capsys):
    code, output = convert(capsys, hub_folder(tmp_path), tmp_path / "ckpt")
    assert code == 0, output
    built = build(FIXTURES / "hf_gpt_oss_spec.py", "cpu-1")
    write_atomically(tmp_path / "program.py", built.source)
    program = load_program(tmp_path / "program.py")
    fixture = np.load(FIXTURES / "hf_gpt_oss.npz")
    logits = program.forward(load_params(tmp_path / "ckpt"), fixture["input_ids"])
    np.testing.assert_allclose(np.asarray(logits), fixture["logits"], atol=1e-4, rtol=1e-4)


BAD_MXFP4 = [
    (
        {"model.layers.0.mlp.experts.down_proj_blocks": np.zeros((4, 64, 1, 8), np.uint8)},
        "model.layers.0.mlp.experts.down_proj_blocks uint8[4, 64, 1, 8] with model.layers.0.mlp.experts."
        "down_proj_scales uint8[4, 64, 1] are not MXFP4 experts",
    ),
    (
        {"model.layers.1.mlp.experts.gate_up_proj_scales": None},
        "holds 'model.layers.1.mlp.experts.gate_up_proj_blocks' without 'model.layers.1.mlp.experts."
        "gate_up_proj_scales', its MXFP4 other half",
    ),
    (
        {
            "model.layers.0.mlp.experts.down_proj_blocks": np.zeros((4, 32, 2, 16), np.uint8),
            "model.layers.0.mlp.experts.down_proj_scales": np.zeros((4, 32, 2), np.uint8),
        },
        "tensor 'model.layers.0.mlp.experts.down_proj' has shape [4, 64, 32]; param w_down needs [4, 32, 64]",
    ),
    (
        {"model.layers.2.mlp.experts.down_proj_scales": np.full((4, 64, 1), 255, np.uint8)},
        "model.layers.2.mlp.experts.down_proj_scales make",
    ),
]


@pytest.mark.parametrize(("changes", "message"), BAD_MXFP4, ids=["blocks", "no_scales", "transposed", "nan"])
def test_bad_mxfp4_blocks_or_scales_stop_in_one_line(changes, message, tmp_path, capsys):
    code, output = convert(capsys, hub_folder(tmp_path, **changes), tmp_path / "ckpt")
    assert code == 2 and message in output and output.count("\n") == 1, output
    assert not (tmp_path / "ckpt").exists()


def fixture_config() -> dict:
    return json.loads(str(np.load(FIXTURES / "hf_gpt_oss.npz")["config"]))


BAD_CONFIGS = [
    ({"attention_bias": False}, "attention_bias=False leaves out gpt-oss's attention biases"),
    (
        {"quantization_config": {"quant_method": "gptq"}},
        'quantization_config.quant_method="gptq" is not a storage',
    ),
    (
        {"quantization_config": {"quant_method": "mxfp4", "group_size": 64}},
        "quantization_config.group_size=64 is not a key axgen's mxfp4 reading knows",
    ),
    ({"experts_per_token": 3}, "experts_per_token=3 differs from num_experts_per_tok=2"),
    ({"sliding_window": None}, "sliding_window=null leaves gpt-oss's sliding layers without a window"),
    (
        {"layer_types": ["full_attention"] * 4},
        "layer_types=['full_attention', 'full_attention', 'full_attention'",
    ),
    ({"swiglu_limit": 0}, "swiglu_limit=0 is not a finite number > 0"),
    (
        {"rope_parameters": None, "rope_scaling": None, "rope_theta": 10_000.0},
        "rope_scaling=null: transformers' gpt-oss then takes a built-in YaRN",
    ),
]


@pytest.mark.parametrize(("changes", "message"), BAD_CONFIGS, ids=[next(iter(c)) for c, _ in BAD_CONFIGS])
def test_a_gpt_oss_key_axgen_cannot_honour_stops_the_import(changes, message, tmp_path, capsys):
    config = {
        k: v for k, v in (fixture_config() | changes).items() if k != "rope_parameters" or v is not None
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = axgen(["import-hf", str(tmp_path / "config.json"), "--out", str(tmp_path / "specs/out.py")])
    output = capsys.readouterr().err
    assert code == 2 and message in output and output.count("\n") == 1, output
    assert not (tmp_path / "specs").exists()


def test_the_written_config_imports_back_and_transformers_keys_are_all_read():
    config = hf_config(load_spec(FIXTURES / "hf_gpt_oss_spec.py"), "float32")
    assert config["rope_parameters"] == {
        "rope_theta": 10_000.0,
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 8,
        "attention_factor": 0.1 * math.log(4.0) + 1,
        "truncate": False,
    }
    assert "rope_theta" not in config and "rope_scaling" not in config
    source, read = import_config(config, "exported/config.json")
    assert not read.unaccounted()
    assert [f.split("(")[0] for f in source.features] == [
        "F.rope",
        "F.qkv_bias",
        "F.out_bias",
        "F.attention_sinks",
        "F.sliding_window",
        "F.moe",
        "F.gpt_oss_experts",
    ]
