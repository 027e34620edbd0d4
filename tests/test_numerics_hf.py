"""The emitted forward against HF transformers' LlamaForCausalLM (fixtures made by tests/fixtures/make_hf_fixtures.py)."""

import ast
import json

import jax
import numpy as np
import pytest
from tests.conftest import ROOT

from axgen.build import build
from axgen.files import write_atomically
from axgen.hf.import_config import TrainChoices, import_hf
from axgen.interop import hf_to_params, load_program

FIXTURES = ROOT / "tests/fixtures"


@pytest.mark.parametrize("name", ["hf_llama_gqa", "hf_llama_rope_scaling"])
def test_forward_matches_hf_llama_logits(name, tmp_path):
    fixture = np.load(FIXTURES / f"{name}.npz")
    built = build(FIXTURES / f"{name}_spec.py", "cpu-1")
    config = json.loads(str(fixture["config"]))
    spec = built.spec
    assert (spec.vocab_size, spec.d_model, spec.decoder.num_layers) == (
        config["vocab_size"],
        config["hidden_size"],
        config["num_hidden_layers"],
    )
    assert spec.feature("rope").theta == config["rope_theta"]
    assert (spec.feature("rope").scaling is None) == (config["rope_scaling"] is None)

    program_file = tmp_path / f"{name}.py"
    write_atomically(program_file, built.source)
    program = load_program(program_file)
    state_dict = {k: fixture[k] for k in fixture.files if k.startswith(("model.", "lm_head."))}
    logits = program.forward(hf_to_params(state_dict, spec), fixture["input_ids"])

    assert logits.dtype == np.float32
    np.testing.assert_allclose(np.asarray(logits), fixture["logits"], atol=1e-4, rtol=1e-4)


def test_converter_reads_safetensors_files(tmp_path):
    from safetensors.numpy import save_file

    fixture = np.load(FIXTURES / "hf_llama_gqa.npz")
    state_dict = {k: fixture[k] for k in fixture.files if k.startswith(("model.", "lm_head."))}
    save_file(state_dict, tmp_path / "model.safetensors")
    spec = build(FIXTURES / "hf_llama_gqa_spec.py", "cpu-1").spec
    from_file = hf_to_params(tmp_path / "model.safetensors", spec)
    from_dict = hf_to_params(state_dict, spec)
    np.testing.assert_array_equal(from_file["layers"]["wq"], from_dict["layers"]["wq"])


# One tiny model per family that adds a feature to Llama; each fixture's spec is tests/fixtures/<name>_spec.py.
ARCHITECTURES = [
    "hf_qwen2",
    "hf_qwen3",
    "hf_mistral_window",
    "hf_gemma2",
    "hf_qwen2_moe",
    "hf_qwen3_moe",
    "hf_gemma3",
    "hf_qwen3_yarn",
    "hf_llama_linear",
    "hf_gpt_oss",
]


@pytest.mark.parametrize("spec_from", ["hand-written", "import-hf"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_forward_matches_each_family_in_hf(name, spec_from, tmp_path):
    """Against each family's logits in HF transformers: the fixture's hand-written spec, and the spec that
    `axgen import-hf` writes from the fixture model's own config.json (transformers 5 keys)."""
    fixture = np.load(FIXTURES / f"{name}.npz")
    config = json.loads(str(fixture["config"]))
    spec_path = FIXTURES / f"{name}_spec.py"
    if spec_from == "import-hf":
        (tmp_path / "config.json").write_text(json.dumps(config))
        spec_path = tmp_path / f"{name}_imported.py"
        import_hf(tmp_path / "config.json", spec_path, TrainChoices(targets=("cpu-1",)))
    built = build(spec_path, "cpu-1")
    spec, attention = built.spec, built.spec.decoder.attention
    assert (spec.vocab_size, spec.d_model, spec.decoder.num_layers, attention.num_kv_heads) == (
        config["vocab_size"],
        config["hidden_size"],
        config["num_hidden_layers"],
        config["num_key_value_heads"],
    )
    program_file = tmp_path / f"{name}.py"
    write_atomically(program_file, built.source)
    program = load_program(program_file)
    state_dict = {k: fixture[k] for k in fixture.files if k.startswith(("model.", "lm_head."))}
    params = hf_to_params(state_dict, spec)
    logits = program.forward(params, fixture["input_ids"])
    np.testing.assert_allclose(np.asarray(logits), fixture["logits"], atol=1e-4, rtol=1e-4)
    # Every HF tensor was used: none of the family's weights is silently left out.
    used = sum(np.asarray(leaf).size for leaf in jax.tree.leaves(params))
    assert used == sum(state_dict[k].size for k in state_dict)


def test_sliding_window_every_other_layer_keeps_full_attention(tmp_path):
    spec = tmp_path / "alternating.py"
    spec.write_text(
        "from axgen.specs.llama_tiny import spec as tiny\nfrom axgen.spec import features as F\n"
        "spec = tiny.replace(features=[*tiny.features, F.sliding_window(window=16, global_every=2)])\n"
    )
    built = build(spec, "cpu-1")
    windows = {n.region: n.attrs.window for n in built.graph.nodes(op="attention")}
    assert windows == {"layers": 16, "global_layers": None}
    assert [b.repeat for b in built.graph.blocks()] == [2, 2]
    calls = [
        call
        for call in ast.walk(ast.parse(built.source))
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "runtime.causal_attention"
    ]
    # One call a layer function: the local layers' with their window, the global layers' without.
    assert sorted(str({k.arg: ast.unparse(k.value) for k in c.keywords}.get("window")) for c in calls) == [
        "16",
        "None",
    ]
    assert "def global_decoder_layer(" in built.source
