"""One adapter per Hugging Face family, both directions (axgen/hf/adapter.py, axgen/hf/families.py):
`hf_to_params` reads DeepSeek's checkpoints in the Hub's names (`mlp.shared_experts.`, one tensor per expert) to
transformers' logits (tests/fixtures/hf_deepseek_v*.npz, made by transformers: the `_hub` files hold the same
weights as save_pretrained writes them); every published config that import-hf accepts comes back key for key
through import-hf and export-hf with its folder as the base; `export-hf --base` keeps a model's config and its
generation_config.json."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file
from tests.conftest import ROOT
from tests.test_hf_export import hf_tensors, run

from axgen.build import build
from axgen.files import write_atomically
from axgen.hf.export import config_json, export_dtype, hf_config
from axgen.hf.families import family
from axgen.hf.import_config import TrainChoices, import_hf
from axgen.interop import hf_to_params, load_program, params_to_hf
from axgen.loader import load_spec

FIXTURES = ROOT / "tests/fixtures"
PUBLISHED = sorted(p for p in (FIXTURES / "hf_configs/published").glob("*.json") if p.name != "sources.json")


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """Each DeepSeek fixture's hand-written spec, built for cpu-1 once."""
    built = {}
    for name in ("hf_deepseek_v2", "hf_deepseek_v3"):
        folder = tmp_path_factory.mktemp(name)
        write_atomically(folder / "program.py", build(FIXTURES / f"{name}_spec.py", "cpu-1").source)
        built[name] = load_program(folder / "program.py")
    return built


@pytest.mark.parametrize("layout", ["hub", "fused"])
@pytest.mark.parametrize("name", ["hf_deepseek_v2", "hf_deepseek_v3"])
def test_hf_to_params_reads_deepseek_in_the_hubs_names_to_transformers_logits(name, layout, programs):
    reference = np.load(FIXTURES / f"{name}.npz")  # transformers' input ids and logits
    tensors = hf_tensors(name, np.float32, layout)
    assert any(".mlp.shared_experts." in key for key in tensors)
    assert any(".mlp.experts.0.gate_proj.weight" in key for key in tensors) == (layout == "hub")
    spec = load_spec(FIXTURES / f"{name}_spec.py")
    params = hf_to_params(tensors, spec)
    logits = np.asarray(programs[name].forward(params, reference["input_ids"]))
    np.testing.assert_allclose(logits, reference["logits"], atol=1e-4, rtol=1e-4)
    # params_to_hf is its inverse: transformers 5's names in memory, experts fused, DeepSeek's shared_experts.
    fused = hf_tensors(name, np.float32, "fused")
    back = params_to_hf(params, spec)
    assert back.keys() == fused.keys()
    for key, tensor in fused.items():
        np.testing.assert_array_equal(back[key], tensor, err_msg=key)


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda path: path.stem)
def test_a_published_config_comes_back_key_for_key_through_import_and_export(path, tmp_path):
    """Config in, config out: no weights. The keys of tensors export-hf does not write (`Family.not_exported`:
    DeepSeek-V3's FP8 quantization_config and multi-token-prediction layers, gpt-oss's MXFP4) are the spec's.
    """
    source = json.loads(path.read_text())
    spec = import_hf(path, tmp_path / "spec.py", TrainChoices())
    base = tmp_path / "base"
    base.mkdir()
    shutil.copy(path, base / "config.json")
    dtype = export_dtype(spec, None)
    config, notes = config_json(spec, dtype, base)
    alone = hf_config(spec, dtype)
    not_exported = family(spec).not_exported
    expected = {key: value for key, value in source.items() if key not in not_exported}
    expected |= {key: alone[key] for key in not_exported if key in alone}
    assert config == expected and list(config) == list(expected) and notes == []
    assert "quantization_config" not in config and config.get("num_nextn_predict_layers", 0) == 0
    # Without a base the spec alone decides, and its max_position_embeddings is still the model's.
    assert spec.max_position == source.get("max_position_embeddings", spec.max_position)
    assert alone["max_position_embeddings"] == spec.max_position


def test_export_hf_with_a_base_keeps_its_config_and_generation_config(tmp_path, capsys):
    """The Qwen2-MoE round trip that rewrote intermediate_size and sliding_window (0 -> null) now gives the base's
    config back, with the dtype written; a base that says otherwise than the spec is overruled by name."""
    fixture = np.load(FIXTURES / "hf_qwen2_moe.npz")
    base_config = json.loads(str(fixture["config"])) | {
        "intermediate_size": 128,
        "max_position_embeddings": 32768,
    }
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(base_config))
    (base / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.7}\n')
    save_file(hf_tensors("hf_qwen2_moe", np.float32, "hub"), str(base / "model.safetensors"))
    spec = FIXTURES / "hf_qwen2_moe_spec.py"
    assert run(capsys, "convert-hf", spec, "--hf", base, "--out", tmp_path / "ckpt")[0] == 0
    export = ["export-hf", spec, "--ckpt", tmp_path / "ckpt", "--dtype", "float32"]
    code, output = run(capsys, *export, "--out", tmp_path / "out", "--base", base)
    assert code == 0 and "note:" not in output, output
    assert json.loads((tmp_path / "out/config.json").read_text()) == base_config | {"dtype": "float32"}
    assert (tmp_path / "out/generation_config.json").read_bytes() == (
        base / "generation_config.json"
    ).read_bytes()

    (base / "config.json").write_text(json.dumps(base_config | {"vocab_size": 256}))
    code, output = run(capsys, *export, "--out", tmp_path / "grown", "--base", base)
    assert code == 0 and "vocab_size=256 is written as the spec's 128" in output, output
    assert json.loads((tmp_path / "grown/config.json").read_text())["vocab_size"] == 128

    code, output = run(capsys, *export, "--out", tmp_path / "none", "--base", tmp_path / "nowhere")
    assert code == 2 and output.count("\n") == 1 and f"{tmp_path / 'nowhere'}" in output, output
    assert not (tmp_path / "none").exists()
