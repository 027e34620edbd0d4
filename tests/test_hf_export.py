"""`axgen export-hf`: HF -> axgen -> HF gives back bit-identical tensors for every family; the written config
imports back to the same spec; a run's newest checkpoint exports; bad input writes nothing.

That transformers loads an exported folder and computes the fixture's logits from it (within 7e-6, every family)
is checked by tests/fixtures/check_export_in_transformers.py, which needs torch and runs by hand (`make
check-export`), as the fixtures are made."""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tests.conftest import ROOT, byte_documents, run_python

from axgen.build import build
from axgen.files import write_atomically
from axgen.cli import main as axgen
from axgen.corpus import module_sources
from axgen.data import write_dataset
from axgen.hf_export import hf_config
from axgen.hf_import import import_config
from axgen.loader import load_spec

FIXTURES = ROOT / "tests/fixtures"
FAMILIES = [
    "hf_llama_gqa",
    "hf_llama_rope_scaling",
    "hf_mixtral",
    "hf_qwen2",
    "hf_qwen3",
    "hf_mistral_window",
    "hf_gemma2",
    "hf_qwen2_moe",
]


def hf_tensors(name: str, dtype) -> dict[str, np.ndarray]:
    fixture = np.load(FIXTURES / f"{name}.npz")
    return {k: fixture[k].astype(dtype) for k in fixture.files if k.startswith(("model.", "lm_head."))}


def small_tokenizer(tmp_path, capsys):
    """A 300-token BPE of some of the demo corpus."""
    (tmp_path / "text.txt").write_text(module_sources()["argparse"])
    tokenizer = tmp_path / "tok/tokenizer.json"
    code, output = run(
        capsys, "tokenizer", "train", tmp_path / "text.txt", "--vocab-size", 300, "--out", tokenizer
    )
    assert code == 0, output
    return tokenizer


def run(capsys, *argv) -> tuple[int, str]:
    code = axgen([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def exported_tensors(directory) -> dict[str, np.ndarray]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors |= load_file(str(directory / file))
    assert set(tensors) == set(index["weight_map"])
    return tensors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_hf_to_axgen_to_hf_gives_back_every_tensor_bit_for_bit(name, dtype, tmp_path, capsys):
    original = hf_tensors(name, np.float32 if dtype == "float32" else ml_dtypes.bfloat16)
    (tmp_path / "hf").mkdir()
    save_file(original, str(tmp_path / "hf/model.safetensors"))
    spec = FIXTURES / f"{name}_spec.py"
    assert run(capsys, "convert-hf", spec, "--hf", tmp_path / "hf", "--out", tmp_path / "ckpt")[0] == 0
    code, output = run(
        capsys, "export-hf", spec, "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "out", "--dtype", dtype
    )
    assert code == 0, output
    back = exported_tensors(tmp_path / "out")
    assert back.keys() == original.keys()
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and back[key].shape == tensor.shape, key
        assert back[key].tobytes() == tensor.tobytes(), key


BUNDLED = [
    "llama2_7b",
    "llama3_8b",
    "mistral_7b",
    "mixtral_8x7b",
    "qwen2_7b",
    "qwen3_8b",
    "qwen2_moe_a2_7b",
    "gemma2_9b",
]


@pytest.mark.parametrize("name", BUNDLED)
def test_the_written_config_imports_back_to_the_same_model(name):
    spec = load_spec(ROOT / "specs" / f"{name}.py")
    config = hf_config(spec, "bfloat16")
    assert config["architectures"][0].endswith("ForCausalLM")
    source, read = import_config(config, "exported/config.json")
    assert not read.unaccounted()
    assert (source.vocab_size, source.d_model, source.num_layers, source.tie_embeddings) == (
        spec.vocab_size,
        spec.d_model,
        spec.decoder.num_layers,
        spec.tie_embeddings,
    )
    attention = spec.decoder.attention
    assert source.attention == (
        f"Attention(num_heads={attention.num_heads}, num_kv_heads={attention.num_kv_heads}, "
        f"head_dim={attention.head_dim})"
    )
    assert [f.split("(")[0] for f in source.features] == [f"F.{f.pass_name}" for f in spec.features]


def test_a_runs_newest_checkpoint_exports_with_its_tokenizer(tmp_path, capsys):
    program = tmp_path / "llama_tiny_cpu_1.py"
    write_atomically(program, build(ROOT / "specs/llama_tiny.py", "cpu-1").source)
    write_dataset(
        tmp_path / "data", byte_documents()[:5], vocab_size=256, bos_id=None, eos_id=0, eval_fraction=0
    )
    run_python(
        str(program), "--data", str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"), "--steps", "3"
    )
    tokenizer = small_tokenizer(tmp_path, capsys)
    code, output = run(
        capsys,
        *("export-hf", ROOT / "specs/llama_tiny.py", "--ckpt", tmp_path / "run", "--out", tmp_path / "out"),
        *("--tokenizer", tokenizer),
    )
    assert code == 0, output
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (tmp_path / "out").iterdir()
    }
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["torch_dtype"]) == ("llama", 512, "bfloat16")
    assert exported_tensors(tmp_path / "out")["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16


def test_a_tokenizer_beyond_the_vocabulary_or_a_feature_hf_lacks_writes_nothing(tmp_path, capsys):
    original = hf_tensors("hf_qwen2", np.float32)
    (tmp_path / "hf").mkdir()
    save_file(original, str(tmp_path / "hf/model.safetensors"))
    spec = FIXTURES / "hf_qwen2_spec.py"
    assert run(capsys, "convert-hf", spec, "--hf", tmp_path / "hf", "--out", tmp_path / "ckpt")[0] == 0
    tokenizer = small_tokenizer(tmp_path, capsys)
    code, output = run(
        capsys,
        "export-hf",
        spec,
        "--ckpt",
        tmp_path / "ckpt",
        "--out",
        tmp_path / "out",
        "--tokenizer",
        tokenizer,
    )
    assert code == 2 and "its 300 tokens exceed vocab_size=128" in output and output.count("\n") == 1
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))

    windowed = tmp_path / "windowed.py"
    windowed.write_text(
        "from tests.fixtures.hf_qwen2_spec import spec as base\nfrom axgen.spec import features as F\n"
        "spec = base.replace(features=[*base.features, F.sliding_window(window=8)])\n"
    )
    code, output = run(capsys, "export-hf", windowed, "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "out")
    assert code == 2 and "qwen2 models in HF have no 'sliding_window'" in output
    assert not (tmp_path / "out").exists()


def test_export_of_another_models_checkpoint_is_refused(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    save_file(hf_tensors("hf_qwen2", np.float32), str(tmp_path / "hf/model.safetensors"))
    qwen2, qwen3 = FIXTURES / "hf_qwen2_spec.py", FIXTURES / "hf_qwen3_spec.py"
    assert run(capsys, "convert-hf", qwen2, "--hf", tmp_path / "hf", "--out", tmp_path / "ckpt")[0] == 0
    code, output = run(capsys, "export-hf", qwen3, "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "out")
    assert code == 2 and output.count("\n") == 1, output
    assert "has no param layers/q_norm of hf-qwen3: a checkpoint of another model?" in output
    assert not (tmp_path / "out").exists()
