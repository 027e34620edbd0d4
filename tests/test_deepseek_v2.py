"""DeepSeek-V2 (`model_type="deepseek_v2"`: F.mla and DeepSeek-MoE): logits equal transformers'
DeepseekV2ForCausalLM (tests/fixtures/hf_deepseek_v2*.npz, made by tests/fixtures/make_hf_fixtures.py) through
import-hf, build and convert-hf, from either expert layout; export-hf gives the tensors back bit for bit and its
config imports back; a config or spec axgen cannot honour stops in one line."""

import json

import ml_dtypes
import numpy as np
import pytest
from tests.conftest import ROOT
from tests.test_hf_export import assert_same_tensors, hf_tensors, round_trip, run

from axgen.build import build
from axgen.files import write_atomically
from axgen.hf.export import hf_config, load_params
from axgen.hf.import_config import TrainChoices, import_config, import_hf
from axgen.interop import CheckpointError, load_program
from axgen.loader import load_spec

FIXTURES = ROOT / "tests/fixtures"
NAMES = ["hf_deepseek_v2", "hf_deepseek_v2_q_proj", "hf_deepseek_v2_groups"]


def fixture_config(name: str) -> dict:
    return json.loads(str(np.load(FIXTURES / f"{name}.npz")["config"]))


def converted(capsys, tmp_path, spec_path, tensors: dict, label: str) -> dict:
    """The params `axgen convert-hf` makes of the tensors, saved as a checkpoint folder."""
    from safetensors.numpy import save_file

    folder = tmp_path / f"hf_{label}"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    code, output = run(capsys, "convert-hf", spec_path, "--hf", folder, "--out", tmp_path / f"ckpt_{label}")
    assert code == 0, output
    return load_params(tmp_path / f"ckpt_{label}")


@pytest.mark.parametrize("spec_from", ["hand-written", "import-hf"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers_deepseek_v2_from_either_expert_layout(name, spec_from, tmp_path, capsys):
    fixture = np.load(FIXTURES / f"{name}.npz")
    spec_path = FIXTURES / f"{name}_spec.py"
    if spec_from == "import-hf":
        (tmp_path / "config.json").write_text(json.dumps(fixture_config(name)))
        spec_path = tmp_path / f"{name}_imported.py"
        import_hf(tmp_path / "config.json", spec_path, TrainChoices(targets=("cpu-1",)))
    built = build(spec_path, "cpu-1")
    fused = converted(capsys, tmp_path, spec_path, hf_tensors(name, np.float32), "fused")
    hub = converted(capsys, tmp_path, spec_path, hf_tensors(name, np.float32, "hub"), "hub")
    for block in fused:
        for key, value in (
            fused[block].items() if isinstance(fused[block], dict) else [(None, fused[block])]
        ):
            expected = hub[block] if key is None else hub[block][key]
            np.testing.assert_array_equal(value, expected, err_msg=f"{block}/{key}")
    write_atomically(tmp_path / "program.py", built.source)
    logits = np.asarray(load_program(tmp_path / "program.py").forward(fused, fixture["input_ids"]))
    np.testing.assert_allclose(logits, fixture["logits"], atol=1e-4, rtol=1e-4)
    # Every HF tensor is a param: none of the family's weights is silently left out.
    assert built.graph.attrs["config"][-2][1] == sum(t.size for t in hf_tensors(name, np.float32).values())


def test_the_hand_written_spec_is_the_imported_one():
    source, read = import_config(fixture_config("hf_deepseek_v2"), "config.json")
    spec = load_spec(FIXTURES / "hf_deepseek_v2_spec.py")
    assert not read.unaccounted()
    assert (
        source.attention
        == f"Attention(num_heads=4, num_kv_heads=4, head_dim=24, scale={spec.decoder.attention.scale!r})"
    )
    assert "rotary_dim=8, interleaved=True)" in source.features[0]
    assert source.features[1] == (
        "F.mla(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, eps=1e-06)"
    )
    assert "routed_scale=2.5, shared_hidden_dim=64" in source.features[2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["hub", "fused"])
@pytest.mark.parametrize("name", NAMES)
def test_deepseek_v2_round_trips_bit_for_bit(name, layout, dtype, tmp_path, capsys):
    original = hf_tensors(name, np.float32 if dtype == "float32" else ml_dtypes.bfloat16, layout)
    flags = ["--dtype", dtype] + ["--fused-experts"] * (layout == "fused")
    assert_same_tensors(round_trip(tmp_path, capsys, name, original, *flags), original)


def test_deepseek_s_own_config_keys_are_read():
    """The keys of DeepSeek's remote-code configs beside transformers' (DeepSeek-V2-Lite's values): the balance
    loss's weight is aux_loss_alpha; the others change nothing transformers computes."""
    config = fixture_config("hf_deepseek_v2") | {
        "aux_loss_alpha": 0.001,
        "ep_size": 1,
        "moe_layer_freq": 1,
        "scoring_func": "softmax",
        "seq_aux": True,
        "auto_map": {"AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
    }
    source, read = import_config(config, "config.json")
    assert not read.unaccounted()
    assert "aux_loss_weight=0.001" in source.features[2]


def test_the_exported_config_imports_back_to_the_same_spec(tmp_path, capsys):
    spec = load_spec(FIXTURES / "hf_deepseek_v2_spec.py")
    config = hf_config(spec, "float32")
    assert config["rope_scaling"]["mscale_all_dim"] == 0.8 and config["head_dim"] == 8
    source, read = import_config(config, "exported/config.json")
    assert not read.unaccounted()
    assert source.attention.endswith(f"scale={spec.decoder.attention.scale!r})")
    written, _ = import_config(fixture_config("hf_deepseek_v2"), "config.json")
    assert source.features[1:] == written.features[1:]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("topk_method", "noaux_tc", 'topk_method="noaux_tc" is not one'),
        ("norm_topk_prob", True, "norm_topk_prob=True asks for renormalised top-k weights"),
        ("first_k_dense_replace", 2, "first_k_dense_replace=2 is not a count of leading dense layers below"),
        ("attention_bias", True, "attention_bias=True puts biases on q_a, kv_a and o"),
        ("head_dim", 24, "head_dim=24 is not qk_rope_head_dim=8"),
        ("scoring_func", "sigmoid", "scoring_func='sigmoid' scores experts otherwise"),
        ("moe_layer_freq", 2, "moe_layer_freq=2 puts experts in some layers only"),
    ],
)
def test_a_deepseek_v2_config_axgen_cannot_honour_is_one_line(key, value, message, tmp_path, capsys):
    config = fixture_config("hf_deepseek_v2") | {key: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, output = run(capsys, "import-hf", tmp_path / "config.json", "--out", tmp_path / "spec.py")
    assert code == 2 and message in output and len(output.strip().splitlines()) == 1, output
    assert not (tmp_path / "spec.py").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("moe.replace(renormalize=True)", "keeps the top-k weights as they are"),
        ("mla.replace(eps=1e-5)", "MLA.eps=1e-05: DeepSeek-V2 in HF norms its latents with 1e-6"),
        ("rope.replace(interleaved=False)", "RoPE.interleaved=False: DeepSeek-V2 in HF turns MLA's rope"),
    ],
)
def test_an_mla_spec_deepseek_v2_cannot_state_is_refused_by_export(change, message, tmp_path):
    path = tmp_path / "spec.py"
    path.write_text(
        "from tests.fixtures.hf_deepseek_v2_spec import spec as tiny\n"
        "rope, mla, moe = tiny.features\n"
        f"{change.split('.')[0]} = {change}\n"
        "spec = tiny.replace(features=[rope, mla, moe])\n"
    )
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        hf_config(load_spec(path), "float32")


def test_a_scale_no_mscale_all_dim_gives_is_refused_by_export(tmp_path):
    path = tmp_path / "spec.py"
    path.write_text(
        "from tests.fixtures.hf_deepseek_v2_spec import spec as tiny\n"
        "attention = tiny.decoder.attention.replace(scale=0.1)\n"
        "spec = tiny.replace(decoder=tiny.decoder.replace(attention=attention))\n"
    )
    with pytest.raises(CheckpointError, match="Attention.scale=0.1: DeepSeek-V2 in HF scales attention"):
        hf_config(load_spec(path), "float32")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_group": 3}, "n_group=3 does not split n_routed_experts=8 into equal groups"),
        ({"topk_group": 5}, "topk_group=5 is not a count of groups up to n_group=4"),
        (
            {"first_k_dense_replace": 3},
            "first_k_dense_replace=3 is not a count of leading dense layers below",
        ),
    ],
)
def test_groups_or_dense_layers_axgen_cannot_honour_are_one_line(change, message, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(fixture_config("hf_deepseek_v2_groups") | change))
    code, output = run(capsys, "import-hf", tmp_path / "config.json", "--out", tmp_path / "spec.py")
    assert code == 2 and message in output and len(output.strip().splitlines()) == 1, output
    assert not (tmp_path / "spec.py").exists()


def test_the_groups_and_dense_layers_export_as_deepseek_v2_states_them():
    config = hf_config(load_spec(FIXTURES / "hf_deepseek_v2_groups_spec.py"), "float32")
    assert config["topk_method"] == "group_limited_greedy" and (config["n_group"], config["topk_group"]) == (
        4,
        2,
    )
    assert (config["first_k_dense_replace"], config["intermediate_size"]) == (1, 96)
    assert config["moe_intermediate_size"] == 32
    source, read = import_config(config, "exported/config.json")
    written, _ = import_config(fixture_config("hf_deepseek_v2_groups"), "config.json")
    assert not read.unaccounted() and source.features[1:] == written.features[1:]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # Sigmoid scores are DeepSeek-V3's, whose HF model always has the correction bias.
        ('moe.replace(scoring="sigmoid")', "MoE.balance_bias_rate=None: DeepSeek-V3 in HF chooses experts"),
        ("moe.replace(balance_bias_rate=0.0)", "MoE.balance_bias_rate=0.0: DeepSeek-V2 in HF"),
        ('moe.replace(group_score="top2_sum")', "MoE.group_score='top2_sum': DeepSeek-V2 in HF"),
        ("moe.replace(seq_aux_loss_weight=0.001)", "MoE.seq_aux_loss_weight=0.001: DeepSeek-V2 in HF"),
    ],
)
def test_routing_deepseek_v2_cannot_state_is_refused_by_export(change, message, tmp_path):
    path = tmp_path / "spec.py"
    path.write_text(
        "from tests.fixtures.hf_deepseek_v2_groups_spec import spec as tiny\n"
        "rope, mla, moe = tiny.features\n"
        f"moe = {change}\n"
        "spec = tiny.replace(features=[rope, mla, moe])\n"
    )
    with pytest.raises(CheckpointError, match=message):
        hf_config(load_spec(path), "float32")
