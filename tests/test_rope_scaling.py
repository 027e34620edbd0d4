"""RoPE beyond Llama 3's rule: YaRN and linear scaling, and a theta per layer type (Gemma 3's local layers).

YaRN's inverse frequencies and attention factor are checked against transformers' own (`ROPE_INIT_FUNCTIONS
["yarn"]`, 5.23) for published configs' parameters, committed with the script that computed them
(tests/fixtures/rope/). The logits of tiny HF models with each scaling are in tests/test_numerics_hf.py."""

import ast
import json

import numpy as np
import pytest
from tests.conftest import ROOT

from axgen.build import build
from axgen.cli import main as axgen
from axgen.files import write_atomically
from axgen.hf.export import hf_config
from axgen.hf.import_config import TrainChoices, import_hf
from axgen.interop import load_program
from axgen.loader import load_spec
from axgen.runtime.rotary import rope_frequencies
from axgen.spec import SpecError
from axgen.spec import features as F

REFERENCE = json.loads((ROOT / "tests/fixtures/rope/yarn_reference.json").read_text())
CASES = {case["name"]: case for case in REFERENCE["cases"]}


def llama_config(head_dim: int, max_position: int, rope_parameters: dict) -> dict:
    """A small Llama config (transformers 5 keys) whose rope covers `head_dim` channels of each head."""
    return {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 2 * head_dim,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "max_position_embeddings": max_position,
        "rope_parameters": rope_parameters,
    }


def imported(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "spec.py"
    import_hf(tmp_path / "config.json", out, TrainChoices(seq_len=16, targets=("cpu-1",)))
    return out, load_spec(out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_yarn_matches_transformers_frequencies_and_attention_factor(name, tmp_path):
    case = CASES[name]
    spec_path, spec = imported(
        tmp_path, llama_config(case["head_dim"], case["max_position_embeddings"], case["rope_parameters"])
    )
    scaling = spec.feature("rope").scaling
    assert scaling.rule == "yarn"
    assert scaling.attention_factor == case["attention_factor"]
    program_file = tmp_path / "program.py"
    write_atomically(program_file, build(spec_path, "cpu-1").source)
    program = load_program(program_file)
    assert program.ROPE_SCALING["attention_factor"] == case["attention_factor"]
    inv_freq = rope_frequencies(case["head_dim"], spec.feature("rope").theta, program.ROPE_SCALING)
    assert inv_freq.dtype == np.float32
    np.testing.assert_allclose(inv_freq, np.array(case["inv_freq"], np.float32), rtol=2e-7, atol=0)


def test_yarn_defaults_are_written_out_not_left_to_the_spec(tmp_path):
    """Qwen's long-context config names only factor and the original length: the spec states the rest."""
    case = CASES["qwen-long-context"]
    _, spec = imported(
        tmp_path, llama_config(case["head_dim"], case["max_position_embeddings"], case["rope_parameters"])
    )
    assert spec.feature("rope") == F.rope(
        theta=1_000_000.0,
        scaling=F.rope_yarn(
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position=32_768,
            attention_factor=case["attention_factor"],
            truncate=True,
        ),
    )


@pytest.mark.parametrize("name", ["gpt-oss", "deepseek-v3", "linear"])
def test_yarn_and_linear_export_and_import_back_to_the_same_rope(name, tmp_path):
    parameters = (
        CASES[name]["rope_parameters"]
        if name in CASES
        else {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 8.0}
    )
    _, spec = imported(tmp_path, llama_config(64, 131_072, parameters))
    config = hf_config(spec, "bfloat16")
    assert config["rope_scaling"]["rope_type"] == parameters["rope_type"]
    (tmp_path / "exported.json").write_text(json.dumps(config))
    out = tmp_path / "back.py"
    import_hf(tmp_path / "exported.json", out, TrainChoices(seq_len=16, targets=("cpu-1",)))
    assert load_spec(out).feature("rope") == spec.feature("rope")


def test_the_export_of_yarn_states_every_value(tmp_path):
    _, spec = imported(tmp_path, llama_config(64, 131_072, CASES["gpt-oss"]["rope_parameters"]))
    assert hf_config(spec, "bfloat16")["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "attention_factor": CASES["gpt-oss"]["attention_factor"],
        "truncate": False,
    }


BAD = [
    (
        {"rope_type": "dynamic", "factor": 2.0},
        'rope_parameters.rope_type="dynamic" is not one axgen implements',
    ),
    ({"rope_type": "yarn", "factor": 4.0}, "rope_parameters has no 'original_max_position_embeddings'"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 8}, "rope_parameters has no 'factor'"),
    (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": "32"},
        'rope_parameters.beta_fast="32" is not a finite number > 0, or null',
    ),
    (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8.5},
        "rope_parameters.original_max_position_embeddings=8.5 is not an integer > 0",
    ),
    (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "truncate": "no"},
        'rope_parameters.truncate="no" is not true or false',
    ),
    (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": -1},
        "rope_parameters.mscale=-1 is not a number from 0 to 10, or null",
    ),
    (
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "partial_rotary_factor": 0.5,
        },
        "rope_parameters.partial_rotary_factor=0.5 is not a parameter axgen's yarn scaling reads",
    ),
    ({"rope_type": "linear"}, "rope_parameters has no 'factor'"),
    ({"rope_type": "linear", "factor": 0}, "rope_parameters.factor=0 is not a finite number > 0"),
    (
        {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0},
        "rope_parameters.low_freq_factor=1.0 is not a parameter axgen's linear scaling reads",
    ),
]


@pytest.mark.parametrize(("parameters", "message"), BAD, ids=[m for _, m in BAD])
def test_a_rope_axgen_cannot_honour_stops_the_import_in_one_line(parameters, message, tmp_path, capsys):
    config = llama_config(16, 128, {"rope_theta": 10_000.0, **parameters})
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = axgen(["import-hf", str(tmp_path / "config.json"), "--out", str(tmp_path / "specs/out.py")])
    error = capsys.readouterr().err
    assert code == 2
    assert error.startswith(f"axgen: error: {tmp_path / 'config.json'}: {message}"), error
    assert error.count("\n") == 1
    assert not (tmp_path / "specs").exists(), "nothing is written"


def test_spec_checks_of_the_new_scalings():
    with pytest.raises(SpecError, match=r"YarnRopeScaling.beta_fast=1.0 must be > beta_slow=1.0"):
        F.rope_yarn(
            factor=4.0,
            beta_fast=1.0,
            beta_slow=1.0,
            original_max_position=8,
            attention_factor=1.0,
            truncate=True,
        )
    with pytest.raises(SpecError, match=r"YarnRopeScaling.truncate=1 must be a bool"):
        F.rope_yarn(
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position=8,
            attention_factor=1.0,
            truncate=1,
        )
    with pytest.raises(SpecError, match=r"LinearRopeScaling.factor=0.0 must be > 0"):
        F.rope_linear(factor=0.0)
    with pytest.raises(TypeError):
        F.rope_yarn(factor=4.0, original_max_position=8)  # no field has a default


def test_local_theta_needs_windowed_layers(tmp_path):
    (tmp_path / "spec.py").write_text(
        "from axgen.specs.llama_tiny import spec as tiny\nfrom axgen.spec import features as F\n"
        "spec = tiny.replace(features=[F.rope(theta=1e6, local_theta=1e4)])\n"
    )
    with pytest.raises(SpecError, match=r"RoPE.local_theta=10000.0 is the theta of windowed layers"):
        build(tmp_path / "spec.py", "cpu-1")


def test_each_layer_type_gets_its_theta_in_the_lowered_graph(tmp_path):
    """Gemma 3's pattern: the windowed block's rope has local_theta and no scaling; the global block's has theta
    and the scaling. The scan runs them as separate blocks, so each block's rope has one set of attrs."""
    (tmp_path / "spec.py").write_text(
        "from axgen.specs.llama_tiny import spec as tiny\nfrom axgen.spec import features as F\n"
        "spec = tiny.replace(decoder=tiny.decoder.replace(num_layers=6), features=[\n"
        "    F.rope(theta=1e6, scaling=F.rope_linear(factor=8.0), local_theta=1e4),\n"
        "    F.sliding_window(window=16, global_every=3)])\n"
    )
    built = build(tmp_path / "spec.py", "cpu-1")
    ropes = {(n.region, n.attrs.theta, str(n.attrs.scaling)) for n in built.graph.nodes(op="rope")}
    assert ropes == {("layers", 10_000.0, "None"), ("global_layers", 1_000_000.0, "linear(factor=8.0)")}
    assert [b.repeat for b in built.graph.blocks()] == [4, 2]
    calls = {
        ast.unparse(call)
        for call in ast.walk(ast.parse(built.source))
        if isinstance(call, ast.Call) and ast.unparse(call).startswith("runtime.rope(q,")
    }
    assert calls == {
        "runtime.rope(q, positions, theta=10000.0, scaling=None, rotary_dim=None, interleaved=False)",
        "runtime.rope(q, positions, theta=1000000.0, scaling=ROPE_SCALING, rotary_dim=None, interleaved=False)",
    }
