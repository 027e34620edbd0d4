"""DeepSeek-V3 (`model_type="deepseek_v3"`: F.mla with rope_interleave, and DeepSeek-MoE's sigmoid routing with a
correction bias, noaux_tc groups and leading dense layers): logits equal transformers' DeepseekV3ForCausalLM
(tests/fixtures/hf_deepseek_v3*.npz, made by tests/fixtures/make_hf_fixtures.py) through import-hf, build and
convert-hf, from either expert layout, with the multi-token-prediction layer's tensors left out; export-hf gives the
tensors back bit for bit and its config imports back; a config or spec axgen cannot honour stops in one line.
"""

import json

import ml_dtypes
import numpy as np
import pytest
from tests.conftest import ROOT
from tests.test_deepseek_v2 import converted
from tests.test_hf_export import assert_same_tensors, hf_tensors, round_trip, run

from axgen.build import build
from axgen.files import write_atomically
from axgen.hf.export import hf_config
from axgen.hf.import_config import TrainChoices, import_config, import_hf
from axgen.interop import CheckpointError, load_program
from axgen.loader import load_spec

FIXTURES = ROOT / "tests/fixtures"
NAMES = ["hf_deepseek_v3", "hf_deepseek_v3_halves"]


def fixture_config(name: str) -> dict:
    return json.loads(str(np.load(FIXTURES / f"{name}.npz")["config"]))


def with_mtp_layer(tensors: dict) -> dict:
    """The tensors with a multi-token-prediction module after the 3 decoder layers, as the Hub's checkpoint holds
    one after its 61 (`model.layers.61.*`): a copy of the last layer plus eh_proj, enorm, hnorm."""
    mtp = {
        k.replace("model.layers.2.", "model.layers.3."): v for k, v in tensors.items() if ".layers.2." in k
    }
    width = tensors["model.embed_tokens.weight"].shape[1]
    mtp["model.layers.3.eh_proj.weight"] = np.ones((width, 2 * width), np.float32)
    mtp["model.layers.3.enorm.weight"] = mtp["model.layers.3.hnorm.weight"] = np.ones(width, np.float32)
    return tensors | mtp


@pytest.mark.parametrize("spec_from", ["hand-written", "import-hf"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers_deepseek_v3_from_either_expert_layout(name, spec_from, tmp_path, capsys):
    fixture = np.load(FIXTURES / f"{name}.npz")
    spec_path = FIXTURES / f"{name}_spec.py"
    if spec_from == "import-hf":
        (tmp_path / "config.json").write_text(json.dumps(fixture_config(name)))
        spec_path = tmp_path / f"{name}_imported.py"
        import_hf(tmp_path / "config.json", spec_path, TrainChoices(targets=("cpu-1",)))
    built = build(spec_path, "cpu-1")
    fused = converted(capsys, tmp_path, spec_path, with_mtp_layer(hf_tensors(name, np.float32)), "fused")
    hub = converted(capsys, tmp_path, spec_path, with_mtp_layer(hf_tensors(name, np.float32, "hub")), "hub")
    for block in fused:
        for key, value in (
            fused[block].items() if isinstance(fused[block], dict) else [(None, fused[block])]
        ):
            expected = hub[block] if key is None else hub[block][key]
            np.testing.assert_array_equal(value, expected, err_msg=f"{block}/{key}")
    write_atomically(tmp_path / "program.py", built.source)
    program = load_program(tmp_path / "program.py")
    logits = np.asarray(program.forward(fused, fixture["input_ids"]))
    np.testing.assert_allclose(logits, fixture["logits"], atol=1e-4, rtol=1e-4)
    print(f"{name} {spec_from}: max |logit error| {np.abs(logits - fixture['logits']).max():.3g}")
    # Every HF tensor is a param: none of the family's weights is silently left out. The count is of the trained
    # params; the correction bias is a statistic the step moves, not a gradient's.
    tensors = hf_tensors(name, np.float32)
    trained = sum(t.size for k, t in tensors.items() if not k.endswith("e_score_correction_bias"))
    assert built.graph.attrs["config"][-2][1] == trained < sum(t.size for t in tensors.values())
    # The correction bias changes which experts are chosen: without it the logits move far past the tolerance.
    assert _zero_correction_bias(fused) == 1  # one stacked bias for the MoE layers' scan
    moved = np.abs(np.asarray(program.forward(fused, fixture["input_ids"])) - fixture["logits"]).max()
    print(f"{name}: max |logit change| with the correction bias zeroed {moved:.3g}")
    assert moved > 1e-2, moved


def _zero_correction_bias(params) -> int:
    """Zeroes every correction_bias in the params, in place; how many there were."""
    count = 0
    for key, value in params.items():
        if isinstance(value, dict):
            count += _zero_correction_bias(value)
        elif key == "correction_bias":
            params[key] = np.zeros_like(value)
            count += 1
    return count


def test_the_hand_written_spec_is_the_imported_one():
    source, read = import_config(fixture_config("hf_deepseek_v3"), "config.json")
    spec = load_spec(FIXTURES / "hf_deepseek_v3_spec.py")
    assert not read.unaccounted()
    assert source.attention.endswith(f"scale={spec.decoder.attention.scale!r})")
    assert "rotary_dim=8, interleaved=True)" in source.features[0]
    moe = source.features[2]
    for field in (
        "renormalize=True",
        'scoring="sigmoid"',
        "routed_scale=2.5",
        "shared_hidden_dim=32",
        "first_dense_layers=1, dense_hidden_dim=96",
        'n_group=4, topk_group=2, group_score="top2_sum"',
        "balance_bias_rate=0.0",
        "num_nextn_predict_layers=1: the multi-token-prediction layers are not trained here",
    ):
        assert field in moe, (field, moe)
    halves, _ = import_config(fixture_config("hf_deepseek_v3_halves"), "config.json")
    assert "interleaved=False)" in halves.features[0] and "q_lora_rank=None" in halves.features[1]


def test_deepseek_s_own_v3_config_keys_are_read():
    """The keys of DeepSeek-V3's own config beside transformers' (its values): aux_loss_alpha is the weight of its
    sequence-wise balance loss (seq_aux); the others change nothing transformers computes."""
    config = fixture_config("hf_deepseek_v3") | {
        "aux_loss_alpha": 0.001,
        "ep_size": 1,
        "moe_layer_freq": 1,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "topk_method": "noaux_tc",
        "auto_map": {"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    }
    source, read = import_config(config, "config.json")
    assert not read.unaccounted()
    assert "seq_aux_loss_weight=0.001, aux_loss_weight=0.0" in source.features[2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["hub", "fused"])
@pytest.mark.parametrize("name", NAMES)
def test_deepseek_v3_round_trips_bit_for_bit(name, layout, dtype, tmp_path, capsys):
    original = hf_tensors(name, np.float32 if dtype == "float32" else ml_dtypes.bfloat16, layout)
    flags = ["--dtype", dtype] + ["--fused-experts"] * (layout == "fused")
    assert_same_tensors(round_trip(tmp_path, capsys, name, original, *flags), original)


@pytest.mark.parametrize("name", NAMES)
def test_the_exported_config_imports_back_to_the_same_spec(name):
    spec = load_spec(FIXTURES / f"{name}_spec.py")
    config = hf_config(spec, "float32")
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["num_nextn_predict_layers"] == 0
    source, read = import_config(config, "exported/config.json")
    assert not read.unaccounted()
    written, _ = import_config(fixture_config(name), "config.json")
    assert source.attention == written.attention and source.features[:2] == written.features[:2]
    # The import's comment on the multi-token-prediction layers goes: the export states none.
    assert source.features[2] == written.features[2].split("\n# num_nextn_predict_layers")[0] + ")"


def test_a_deeper_checkpoint_is_not_taken_for_an_mtp_layer(tmp_path, capsys):
    """Only a layer with an eh_proj is a multi-token-prediction module; another layer past the spec's is refused."""
    from safetensors.numpy import save_file

    tensors = with_mtp_layer(hf_tensors("hf_deepseek_v3", np.float32))
    del tensors["model.layers.3.eh_proj.weight"]
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf/model.safetensors"))
    code, output = run(
        capsys,
        "convert-hf",
        FIXTURES / "hf_deepseek_v3_spec.py",
        "--hf",
        tmp_path / "hf",
        "--out",
        tmp_path / "ckpt",
    )
    assert code == 2 and "holds 'model.layers.3." in output and len(output.strip().splitlines()) == 1, output


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "topk_method",
            "greedy",
            "topk_method='greedy' is not the routing transformers' deepseek_v3 computes",
        ),
        ("scoring_func", "softmax", "scoring_func='softmax' scores experts otherwise"),
        ("seq_aux", False, "seq_aux=False asks for a batch-wise balance loss"),
        ("rope_interleave", "yes", 'rope_interleave="yes" is not true or false'),
        ("num_nextn_predict_layers", -1, "num_nextn_predict_layers=-1 is not a count of layers"),
        ("n_group", 3, "n_group=3 does not split n_routed_experts=8 into equal groups"),
        ("topk_group", 5, "topk_group=5 is not a count of groups up to n_group=4"),
        ("first_k_dense_replace", 3, "first_k_dense_replace=3 is not a count of leading dense layers below"),
        ("attention_bias", True, "attention_bias=True puts biases on q_a, kv_a and o"),
    ],
)
def test_a_deepseek_v3_config_axgen_cannot_honour_is_one_line(key, value, message, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(fixture_config("hf_deepseek_v3") | {key: value}))
    code, output = run(capsys, "import-hf", tmp_path / "config.json", "--out", tmp_path / "spec.py")
    assert code == 2 and message in output and len(output.strip().splitlines()) == 1, output
    assert not (tmp_path / "spec.py").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "moe.replace(balance_bias_rate=None)",
            "MoE.balance_bias_rate=None: DeepSeek-V3 in HF chooses experts",
        ),
        ('moe.replace(group_score="max")', "MoE.group_score='max': DeepSeek-V3 in HF"),
        ("moe.replace(aux_loss_weight=0.01)", "MoE.aux_loss_weight=0.01: DeepSeek-V3 in HF"),
        ("moe.replace(shared_hidden_dim=48)", "DeepSeek-V3 in HF shares an ungated expert"),
    ],
)
def test_routing_deepseek_v3_cannot_state_is_refused_by_export(change, message, tmp_path):
    path = tmp_path / "spec.py"
    path.write_text(
        "from tests.fixtures.hf_deepseek_v3_spec import spec as tiny\n"
        "rope, mla, moe = tiny.features\n"
        f"moe = {change}\n"
        "spec = tiny.replace(features=[rope, mla, moe])\n"
    )
    with pytest.raises(CheckpointError, match=message):
        hf_config(load_spec(path), "float32")
