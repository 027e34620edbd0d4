"""`axgen import-hf`: published Hugging Face configs become specs with the HF model's parameter count; every key is
read, known to be irrelevant, or an error; transformers 4.x and 5.x conventions give the same spec."""

import json

import jax
import numpy as np
import pytest
from tests.conftest import ROOT

from axgen.build import lowered
from axgen.cli import main as axgen
from axgen.interop import hf_to_params
from axgen.ir import cost, from_spec
from axgen.loader import load_spec
from axgen.passes import run_passes
from axgen.spec import Model, SpecError

CONFIGS = ROOT / "tests/fixtures/hf_configs/published"  # sources.json says where each was found

# Published configs of the bundled specs' models, each with its parameter count as its Hugging Face model card
# states it (safetensors metadata), not as axgen computes it, and the bundled spec the import must agree with.
PUBLISHED = {
    "llama-2-7b-hf": (6_738_415_616, "llama2_7b"),
    "meta-llama-3-8b-instruct": (8_030_261_248, "llama3_8b"),
    "llama-3.1-8b": (8_030_261_248, None),
    "mistral-7b-v0.1": (7_241_732_096, "mistral_7b"),
    "mixtral-8x7b-v0.1": (46_702_792_704, "mixtral_8x7b"),
    "qwen2-7b-instruct": (7_615_616_512, "qwen2_7b"),
    "qwen3-8b": (8_190_735_360, "qwen3_8b"),
    "qwen1.5-moe-a2.7b": (14_315_784_192, "qwen2_moe_a2_7b"),
    # The card says 30.5B; this is transformers 5.23's count of the config (tests/fixtures/count_hf_params.py).
    "qwen3-30b-a3b": (30_532_122_624, "qwen3_30b_a3b"),
    # The June 2024 revision, whose query_pre_attn_scalar (224) is not head_dim: the bundled spec scales by 256**-0.5.
    "gemma-2-9b-it": (9_241_705_984, None),
    # The card says 15.7B; this is transformers 5.23's count of the config (tests/fixtures/count_hf_params.py).
    "deepseek-v2-lite": (15_706_484_224, "deepseek_v2_lite"),
    # The cards say 685B: 671B and the multi-token-prediction layer, which neither transformers' model nor axgen's
    # has; this is transformers 5.23's count of the config (count_hf_params.py). Their weights are FP8 blocks,
    # which convert-hf dequantizes.
    "deepseek-v3": (671_026_404_352, "deepseek_v3"),
    "deepseek-v3.1": (671_026_404_352, "deepseek_v3"),
    "deepseek-r1": (671_026_404_352, "deepseek_v3"),
}


def num_params(spec: Model) -> int:
    graph = from_spec(spec)
    run_passes(graph, spec.features)
    return cost.num_params(graph)


def import_spec(capsys, config, out) -> tuple[int, str]:
    code = axgen(["import-hf", str(config), "--out", str(out)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("model", PUBLISHED)
def test_each_published_config_gives_the_hf_models_parameter_count(model, tmp_path, capsys):
    config = CONFIGS / f"{model}.json"
    if not config.exists():
        pytest.fail(f"{config} is missing")
    code, output = import_spec(capsys, config, tmp_path / f"{model}.py")
    assert code == 0, output
    spec = load_spec(tmp_path / f"{model}.py")
    expected, bundled_name = PUBLISHED[model]
    assert num_params(spec) == expected
    assert f"{expected:,} parameters" in output
    text = (tmp_path / f"{model}.py").read_text()
    assert "sha256 " in text and str(config) in text
    if bundled_name:
        bundled = load_spec(ROOT / "axgen/specs" / f"{bundled_name}.py")
        assert (spec.vocab_size, spec.d_model, spec.tie_embeddings) == (
            bundled.vocab_size,
            bundled.d_model,
            bundled.tie_embeddings,
        )
        assert spec.decoder == bundled.decoder
        assert [f.pass_name for f in spec.features] == [f.pass_name for f in bundled.features]
        assert spec.feature("rope") == bundled.feature("rope")
    lowered(spec, "cpu-8")  # builds for its target as written


# Bundled specs whose published config is not in the corpus: transformers 5.23's parameter count of a
# Qwen3MoeConfig made from the numbers of Qwen/Qwen3-235B-A22B's config.json (94 layers, hidden 4096, 64 heads,
# 4 kv heads, head_dim 128, 128 experts of 1536, top-8, vocab 151936, untied), on torch's meta device.
BUNDLED = {"qwen3_235b_a22b": 235_093_634_560}
# DeepSeek-V3: transformers 5.23's count of DeepseekV3Config's defaults (its numbers are the 671B's) with YaRN factor
# 40 over 4096; DeepSeek-V2-Lite: of a DeepseekV2Config of 27 layers, hidden 2048, 16 heads, no q latent, kv latent
# 512, 64 experts of 1408 top-6, 2 shared, the first layer dense at 10944, vocab 102400 (its published config.json,
# now in the corpus, is in PUBLISHED, as are DeepSeek-V3's, V3.1's and R1's, FP8 quantization_config and all). The
# multi-token-prediction layer is not a parameter of transformers' model either.
BUNDLED |= {"deepseek_v3": 671_026_404_352, "deepseek_v2_lite": 15_706_484_224}


@pytest.mark.parametrize("name", BUNDLED)
def test_a_bundled_spec_has_transformers_parameter_count(name):
    assert num_params(load_spec(ROOT / "axgen/specs" / f"{name}.py")) == BUNDLED[name]


def as_transformers_5(config: dict) -> dict:
    """The same model in transformers 5's keys: rope parameters in one dict, `dtype`."""
    config = dict(config)
    scaling = config.pop("rope_scaling", None) or {"rope_type": "default"}
    rope = {"rope_theta": config.pop("rope_theta"), **scaling}
    config["rope_parameters"] = rope
    config["dtype"] = config.pop("torch_dtype")
    return config


@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen2-7b-instruct"])
def test_transformers_5_keys_give_the_same_spec(model, tmp_path, capsys):
    config = json.loads((CONFIGS / f"{model}.json").read_text())
    (tmp_path / "v4.json").write_text(json.dumps(config))
    (tmp_path / "v5.json").write_text(json.dumps(as_transformers_5(config)))
    for version in ("v4", "v5"):
        assert import_spec(capsys, tmp_path / f"{version}.json", tmp_path / f"{version}_model.py")[0] == 0
    v4, v5 = (load_spec(tmp_path / f"{version}_model.py") for version in ("v4", "v5"))
    assert v4.replace(name="x") == v5.replace(name="x")


BAD = [
    ("model_type", "gpt2", "model_type='gpt2' is not one axgen imports (it imports llama, mistral"),
    ("attention_bias", True, "attention_bias=True puts biases on all four attention projections"),
    (
        "rope_scaling",
        {"rope_type": "dynamic", "factor": 4.0},
        'rope_scaling.rope_type="dynamic" is not one axgen implements (default, llama3, linear, yarn)',
    ),
    ("hidden_act", "gelu", "hidden_act='gelu' is an activation axgen's gated MLP does not use"),
    ("attention_dropout", 0.1, "attention_dropout=0.1 is dropout in attention"),
    ("shiny_new_key", 3, "shiny_new_key=3 is a key axgen's llama import does not know, so it stops"),
    # JSON of the wrong kind: none is read as a number, none is replaced by a default.
    ("hidden_size", "64", 'hidden_size="64" is not an integer > 0'),
    ("hidden_size", True, "hidden_size=true is not an integer > 0"),
    ("num_attention_heads", 0, "num_attention_heads=0 is not an integer > 0"),
    ("head_dim", 0, "head_dim=0 is not an integer > 0, or null"),
    ("rope_theta", "abc", 'rope_theta="abc" is not a finite number > 0'),
    ("rms_norm_eps", float("nan"), "rms_norm_eps=nan is not a finite number > 0"),
    ("rope_scaling", [1, 2], "rope_scaling=[1, 2] is not an object of RoPE parameters, or null"),
    (
        "rope_scaling",
        {"rope_type": "llama3", "factor": "8"},
        'rope_scaling.factor="8" is not a finite number',
    ),
    ("tie_word_embeddings", 1, "tie_word_embeddings=1 is not true or false"),
    ("torch_dtype", "int8", "torch_dtype='int8' is not a dtype axgen reads (bfloat16, float16, float32)"),
    ("num_key_value_heads", 3, "gives a spec axgen refuses: Attention.num_kv_heads=3 does not divide"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_a_key_axgen_cannot_honour_stops_the_import_naming_it(key, value, message, tmp_path, capsys):
    config = json.loads((CONFIGS / "llama-2-7b-hf.json").read_text()) | {key: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, output = import_spec(capsys, tmp_path, tmp_path / "specs/out.py")
    assert code == 2
    assert output == f"axgen: error: {tmp_path / 'config.json'}: {message}" + output.split(message, 1)[1]
    assert output.count("\n") == 1
    assert not (tmp_path / "specs").exists(), "nothing is written"


QWEN_MOE_BAD = [
    (
        "mlp_only_layers",
        [0, 4],
        "mlp_only_layers=[0, 4] keeps dense MLPs in chosen layers, which axgen's import does not map",
    ),
    (
        "decoder_sparse_step",
        2,
        "decoder_sparse_step=2 keeps dense layers of intermediate_size=6144, but axgen's dense layers are the "
        "experts' width (moe_intermediate_size=768)",
    ),
    ("norm_topk_prob", "yes", 'norm_topk_prob="yes" is not true or false'),
]


@pytest.mark.parametrize(("key", "value", "message"), QWEN_MOE_BAD, ids=[b[0] for b in QWEN_MOE_BAD])
def test_a_qwen3_moe_layout_axgen_cannot_build_stops_the_import(key, value, message, tmp_path, capsys):
    config = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text()) | {key: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, output = import_spec(capsys, tmp_path / "config.json", tmp_path / "specs/out.py")
    assert (code, output) == (2, f"axgen: error: {tmp_path / 'config.json'}: {message}\n")
    assert not (tmp_path / "specs").exists()


def test_a_config_nested_too_deeply_is_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    code, output = import_spec(capsys, tmp_path / "config.json", tmp_path / "x.py")
    assert (code, output) == (
        2,
        f"axgen: error: {tmp_path / 'config.json'}: not a config: its JSON nests too deeply\n",
    )


def test_an_unknown_target_and_an_existing_out_are_refused(tmp_path, capsys):
    config = CONFIGS / "llama-2-7b-hf.json"
    code = axgen(["import-hf", str(config), "--out", str(tmp_path / "x.py"), "--target", "foo-9"])
    assert code == 2 and "--target 'foo-9' is not a target axgen knows" in capsys.readouterr().err
    assert not (tmp_path / "x.py").exists()
    (tmp_path / "x.py").write_text("mine")
    assert import_spec(capsys, config, tmp_path / "x.py") == (
        2,
        f"axgen: error: {tmp_path / 'x.py'}: already exists (pass --force to replace it)\n",
    )
    assert (tmp_path / "x.py").read_text() == "mine"
    assert axgen(["import-hf", str(config), "--out", str(tmp_path / "x.py"), "--force"]) == 0


def test_a_missing_or_broken_config_is_named(tmp_path, capsys):
    assert import_spec(capsys, tmp_path / "nope.json", tmp_path / "x.py") == (
        2,
        f"axgen: error: {tmp_path / 'nope.json'}: no such file\n",
    )
    (tmp_path / "bad.json").write_text("{")
    code, output = import_spec(capsys, tmp_path / "bad.json", tmp_path / "x.py")
    assert code == 2 and f"{tmp_path / 'bad.json'}: not a readable JSON config" in output


def test_gemma2_layer_types_must_alternate(tmp_path, capsys):
    config = json.loads((CONFIGS / "gemma-2-9b-it.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, output = import_spec(capsys, tmp_path, tmp_path / "g.py")
    assert code == 2 and "is not what axgen's gemma2 import maps" in output


def test_weights_load_without_a_train_block_or_loss_weights(tmp_path):
    """Running a model needs neither a Train block nor MoE loss weights; building a training program does."""
    spec = load_spec(ROOT / "tests/fixtures/hf_mixtral_spec.py")
    moe = spec.feature("moe").replace(aux_loss_weight=None, router_z_loss_weight=None)
    inference = spec.replace(
        train=None, features=[moe if f is spec.feature("moe") else f for f in spec.features]
    )
    fixture = np.load(ROOT / "tests/fixtures/hf_mixtral.npz")
    state_dict = {k: fixture[k] for k in fixture.files if k.startswith(("model.", "lm_head."))}
    jax.tree.map(
        np.testing.assert_array_equal, hf_to_params(state_dict, inference), hf_to_params(state_dict, spec)
    )
    with pytest.raises(SpecError, match="Model.train is needed to build a training program"):
        lowered(inference, "cpu-8")
    with pytest.raises(SpecError, match="MoE.aux_loss_weight=None is needed to train"):
        inference.replace(train=spec.train)
