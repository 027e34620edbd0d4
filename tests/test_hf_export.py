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
from tests.conftest import ROOT

from axgen.cli import main as axgen
from axgen.data.corpus import module_sources
from axgen.hf.export import hf_config
from axgen.hf.import_config import import_config
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
    "hf_qwen3_moe",
    "hf_gemma3",
    "hf_qwen3_yarn",
    "hf_llama_linear",
    "hf_gpt_oss",  # its Hub layout is the fused one, its experts in MXFP4 (tests/test_gpt_oss.py)
]
MOE = ["hf_mixtral", "hf_qwen2_moe", "hf_qwen3_moe"]
# (fixture, expert layout): the Hub's one tensor per expert, as save_pretrained writes it (<name>_hub.npz), and
# transformers 5's fused tensors, as its models hold them (<name>.npz).
LAYOUTS = [(name, None) for name in FAMILIES if name not in MOE] + [
    (name, layout) for name in MOE for layout in ("hub", "fused")
]


def hf_tensors(name: str, dtype, layout: str | None = None) -> dict[str, np.ndarray]:
    fixture = np.load(FIXTURES / f"{name}{'_hub' if layout == 'hub' else ''}.npz")
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


def round_trip(tmp_path, capsys, name, tensors, *export_flags) -> dict[str, np.ndarray]:
    """The tensors through `axgen convert-hf` and `axgen export-hf`."""
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf/model.safetensors"))
    spec = FIXTURES / f"{name}_spec.py"
    assert run(capsys, "convert-hf", spec, "--hf", tmp_path / "hf", "--out", tmp_path / "ckpt")[0] == 0
    code, output = run(
        capsys, "export-hf", spec, "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "out", *export_flags
    )
    assert code == 0, output
    return exported_tensors(tmp_path / "out")


def assert_same_tensors(back: dict, original: dict) -> None:
    assert back.keys() == original.keys()
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and back[key].shape == tensor.shape, key
        assert back[key].tobytes() == tensor.tobytes(), key


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("name", "layout"), LAYOUTS)
def test_hf_to_axgen_to_hf_gives_back_every_tensor_bit_for_bit(name, layout, dtype, tmp_path, capsys):
    original = hf_tensors(name, np.float32 if dtype == "float32" else ml_dtypes.bfloat16, layout)
    flags = ["--dtype", dtype] + ["--fused-experts"] * (layout == "fused")
    assert_same_tensors(round_trip(tmp_path, capsys, name, original, *flags), original)


@pytest.mark.parametrize("out_layout", ["hub", "fused"])
@pytest.mark.parametrize("name", MOE)
def test_either_expert_layout_in_gives_either_layout_out(name, out_layout, tmp_path, capsys):
    """The Hub's per-expert tensors come out fused as transformers 5 fuses them, and the other way round: both
    fixtures were written by transformers from one model."""
    in_layout = {"hub": "fused", "fused": "hub"}[out_layout]
    flags = ["--dtype", "float32"] + ["--fused-experts"] * (out_layout == "fused")
    back = round_trip(tmp_path, capsys, name, hf_tensors(name, np.float32, in_layout), *flags)
    assert_same_tensors(back, hf_tensors(name, np.float32, out_layout))


def test_export_writes_the_source_checkpoints_dtype_unless_told(tmp_path, capsys):
    """A spec imported from a float32 config exports float32 by default; one that does not say, bfloat16."""
    tensors = hf_tensors("hf_qwen3", np.float32)
    spec = (FIXTURES / "hf_qwen3_spec.py").read_text()
    assert "decoder=Decoder(" in spec
    (tmp_path / "f32_spec.py").write_text(
        spec.replace("decoder=Decoder(", 'checkpoint_dtype="float32",\n    decoder=Decoder(')
    )
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf/model.safetensors"))
    assert (
        run(
            capsys,
            "convert-hf",
            FIXTURES / "hf_qwen3_spec.py",
            "--hf",
            tmp_path / "hf",
            "--out",
            tmp_path / "ckpt",
        )[0]
        == 0
    )
    for spec_file, expected in [
        (tmp_path / "f32_spec.py", "float32"),
        (FIXTURES / "hf_qwen3_spec.py", "bfloat16"),
    ]:
        out = tmp_path / f"out_{expected}"
        code, output = run(capsys, "export-hf", spec_file, "--ckpt", tmp_path / "ckpt", "--out", out)
        assert code == 0 and f"in {expected}," in output, output
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == expected
        dtypes = {str(t.dtype) for t in exported_tensors(out).values()}
        assert dtypes == {expected}, dtypes


BUNDLED = [
    "llama2_7b",
    "llama3_8b",
    "mistral_7b",
    "mixtral_8x7b",
    "qwen2_7b",
    "qwen3_8b",
    "qwen2_moe_a2_7b",
    "qwen3_30b_a3b",
    "qwen3_235b_a22b",
    "gemma2_9b",
    "gemma3_27b",
]


@pytest.mark.parametrize("name", BUNDLED)
def test_the_written_config_imports_back_to_the_same_model(name):
    spec = load_spec(ROOT / "axgen/specs" / f"{name}.py")
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
    scale = "" if attention.scale is None else f", scale={round(attention.scale**-2)}**-0.5"  # Gemma's scalar
    assert source.attention == (
        f"Attention(num_heads={attention.num_heads}, num_kv_heads={attention.num_kv_heads}, "
        f"head_dim={attention.head_dim}{scale})"
    )
    assert [f.split("(")[0] for f in source.features] == [f"F.{f.pass_name}" for f in spec.features]


def test_a_runs_newest_checkpoint_exports_with_its_tokenizer(shared_run, tmp_path, capsys):
    tokenizer = small_tokenizer(tmp_path, capsys)
    code, output = run(
        capsys,
        *(
            "export-hf",
            ROOT / "axgen/specs/llama_tiny.py",
            "--ckpt",
            shared_run.resumed,
            "--out",
            tmp_path / "out",
        ),
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


def test_a_bad_tokenizer_a_scale_hf_cannot_state_or_a_damaged_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    save_file(hf_tensors("hf_qwen2", np.float32), str(tmp_path / "hf/model.safetensors"))
    spec = FIXTURES / "hf_qwen2_spec.py"
    assert run(capsys, "convert-hf", spec, "--hf", tmp_path / "hf", "--out", tmp_path / "ckpt")[0] == 0
    export = ["export-hf", spec, "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "out"]
    (tmp_path / "notes.json").write_text('{"not": "a tokenizer"}')
    cases = [
        (
            ["--tokenizer", tmp_path / "nope.json"],
            f"{tmp_path / 'nope.json'}: no such file or folder (--tokenizer)",
        ),
        (["--tokenizer", tmp_path / "hf"], f"{tmp_path / 'hf'}: has no tokenizer.json (--tokenizer)"),
        (["--tokenizer", tmp_path / "notes.json"], f"{tmp_path / 'notes.json'}: not a valid tokenizer.json"),
    ]
    for flags, message in cases:
        code, output = run(capsys, *export, *flags)
        assert code == 2 and message in output and output.count("\n") == 1, output
        assert not (tmp_path / "out").exists()

    scaled = tmp_path / "scaled.py"
    scaled.write_text(
        "from tests.fixtures.hf_qwen2_spec import spec as base\n"
        "spec = base.replace(decoder=base.decoder.replace(attention=base.decoder.attention.replace(scale=0.2)))\n"
    )
    code, output = run(capsys, "export-hf", scaled, *export[2:])
    assert (
        code == 2
        and "Attention.scale=0.2: qwen2 models in HF scale attention by head_dim**-0.5 only" in output
    )

    for data in (tmp_path / "ckpt").rglob("d/*"):  # orbax's data files, cut in half
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    code, output = run(capsys, *export)
    assert code == 2 and output.count("\n") == 1, output
    assert f"{tmp_path / 'ckpt'}: not a readable orbax checkpoint" in output
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_gemma_2_27b_s_attention_scale_exports_as_its_query_pre_attn_scalar(tmp_path):
    spec = load_spec(FIXTURES / "hf_gemma2_spec.py")
    assert hf_config(spec, "float32")["query_pre_attn_scalar"] == 24
    source, _ = import_config(hf_config(spec, "float32"), "exported/config.json")
    assert source.attention.endswith("scale=24**-0.5)")
