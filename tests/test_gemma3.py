"""Gemma 3's text model: import-hf reads transformers 5's per-layer-type `rope_parameters` and 4.x's
rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern alike, and the `text_config` of an
image-text `gemma3` config; export-hf writes Gemma3ForCausalLM back; what axgen cannot honour stops in one line.
Logits against HF's: tests/test_numerics_hf.py (hf_gemma3); the bit-identical round trip: tests/test_hf_export.py.
"""

import json

import numpy as np
import pytest
from tests.conftest import ROOT

from axgen.build import build
from axgen.cli import main as axgen
from axgen.hf.export import hf_config
from axgen.hf.import_config import import_config
from axgen.interop import hf_layout
from axgen.ir import cost, from_spec
from axgen.loader import load_spec
from axgen.passes import run_passes

FIXTURE = ROOT / "tests/fixtures/hf_gemma3.npz"
IGNORED = ("torch_version", "transformers_version", "id2label", "label2id")


def fixture_config() -> dict:
    """The tiny Gemma3ForCausalLM's config as transformers 5.23 wrote it."""
    config = json.loads(str(np.load(FIXTURE)["config"]))
    return {k: v for k, v in config.items() if k not in IGNORED}


def as_transformers_4(config: dict) -> dict:
    """The same model in the keys published Gemma 3 configs carry: rope_theta (global), rope_local_base_freq,
    rope_scaling (global), sliding_window_pattern; no layer_types."""
    config = dict(config)
    rope = config.pop("rope_parameters")
    full = dict(rope["full_attention"])
    config["rope_theta"] = full.pop("rope_theta")
    config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    config["rope_scaling"] = full
    config["sliding_window_pattern"] = config.pop("_sliding_window_pattern")
    del config["layer_types"]
    return config


def imported(tmp_path, capsys, config: dict, name: str = "spec"):
    (tmp_path / f"{name}.json").write_text(json.dumps(config))
    code = axgen(["import-hf", str(tmp_path / f"{name}.json"), "--out", str(tmp_path / f"{name}.py")])
    output = capsys.readouterr()
    assert code == 0, output.err
    return load_spec(tmp_path / f"{name}.py")


def test_transformers_4_and_5_keys_and_the_image_text_config_give_one_spec(tmp_path, capsys):
    v5 = fixture_config()
    image_text = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": as_transformers_4(v5),
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
        "mm_tokens_per_image": 256,
        "boi_token_index": 255_999,
        "eoi_token_index": 256_000,
        "image_token_index": 262_144,
        "torch_dtype": "float32",
    }
    specs = [
        imported(tmp_path, capsys, config, name).replace(name="x", checkpoint_dtype=None)
        for name, config in (("v5", v5), ("v4", as_transformers_4(v5)), ("image_text", image_text))
    ]
    assert specs[0] == specs[1] == specs[2]
    rope = specs[0].feature("rope")
    assert (rope.theta, rope.local_theta, str(rope.scaling)) == (1_000_000.0, 10_000.0, "linear(factor=8.0)")
    window = specs[0].feature("sliding_window")
    assert (window.window, window.global_every) == (8, 6)
    assert specs[0].decoder.attention.scale == 24**-0.5
    assert [f.pass_name for f in specs[0].features] == ["rope", "gemma_block", "qk_norm", "sliding_window"]


def test_the_exported_config_imports_back_to_the_same_spec(tmp_path, capsys):
    spec = load_spec(ROOT / "tests/fixtures/hf_gemma3_spec.py")
    config = hf_config(spec, "float32")
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text")
    assert config["layer_types"] == fixture_config()["layer_types"]
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    _, read = import_config(config, "exported/config.json")
    assert not read.unaccounted()
    back = imported(tmp_path, capsys, config)
    assert back.decoder == spec.decoder and back.features == spec.features


def v4_with(**changes) -> dict:
    return as_transformers_4(fixture_config()) | changes


BAD = [
    (
        fixture_config()
        | {"layer_types": ["sliding_attention"] * 5 + ["full_attention"] * 2 + ["sliding_attention"] * 7},
        "layer_types=['sliding_attention', 'sliding_attention', ",
    ),
    (v4_with(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 caps attention scores"),
    (
        v4_with(use_bidirectional_attention=True),
        "use_bidirectional_attention=True makes attention bidirectional",
    ),
    (v4_with(rope_local_base_freq="1e4"), 'rope_local_base_freq="1e4" is not a finite number > 0'),
    (v4_with(rope_scaling={"rope_type": "longrope"}), 'rope_scaling.rope_type="longrope" is not one axgen'),
    (
        fixture_config()
        | {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
            }
        },
        "rope_parameters.sliding_attention scales RoPE on the local layers",
    ),
    (
        fixture_config()
        | {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
        "rope_parameters.sliding_attention=null is not an object of RoPE parameters",
    ),
    (
        {"model_type": "gemma3", "text_config": v4_with(shiny=1)},
        "text_config.shiny=1 is a key axgen's gemma3_text import does not know",
    ),
    ({"model_type": "gemma3", "text_config": [1]}, "text_config=[1] is not an object"),
]


@pytest.mark.parametrize(("config", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_a_gemma3_config_axgen_cannot_honour_stops_in_one_line(config, message, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = axgen(["import-hf", str(tmp_path / "config.json"), "--out", str(tmp_path / "specs/out.py")])
    error = capsys.readouterr().err
    assert code == 2
    assert error.startswith(f"axgen: error: {tmp_path / 'config.json'}"), error
    assert message in error and error.count("\n") == 1, error
    assert not (tmp_path / "specs").exists(), "nothing is written"


def test_layers_after_the_last_whole_group_are_windowed_in_a_scan_of_their_own(tmp_path):
    """Gemma 3 27B's 62 layers are 10 groups of 5 windowed : 1 global, then 2 windowed: here 8 layers in groups of
    3. The last two run in a second scan, with the window and the local theta, and read HF layers 6 and 7."""
    (tmp_path / "spec.py").write_text(
        "from axgen.specs.llama_tiny import spec as tiny\nfrom axgen.spec import features as F\n"
        "spec = tiny.replace(decoder=tiny.decoder.replace(num_layers=8), features=[\n"
        "    F.rope(theta=1e6, local_theta=1e4), F.sliding_window(window=16, global_every=3)])\n"
    )
    built = build(tmp_path / "spec.py", "cpu-1")
    assert [(b.name, b.repeat) for b in built.graph.blocks()] == [
        ("layers", 4),
        ("tail_layers", 2),
        ("global_layers", 2),
    ]
    scans = [(n.name, n.attrs.blocks, n.attrs.steps) for n in built.graph.nodes(op="scan")]
    assert scans == [("layers", ("layers", "global_layers"), 2), ("tail_layers", ("tail_layers",), 2)]
    windows = {(n.region, n.attrs.window) for n in built.graph.nodes(op="attention")}
    assert windows == {("layers", 16), ("tail_layers", 16), ("global_layers", None)}
    thetas = {(n.region, n.attrs.theta) for n in built.graph.nodes(op="rope")}
    assert thetas == {("layers", 1e4), ("tail_layers", 1e4), ("global_layers", 1e6)}
    layers = {block: rows for block, _, rows in hf_layout(built.spec) if rows}
    assert layers == {"layers": [0, 1, 3, 4], "global_layers": [2, 5], "tail_layers": [6, 7]}


# Gemma 3 27B's text_config keys as google/gemma-3-27b-it's config.json states them (quoted in public code; no
# verbatim copy of the file was found, so it is not in the published corpus); the rest are Gemma3TextConfig's
# defaults. transformers 5.23 builds a Gemma3ForCausalLM of 27,009,346,304 parameters from it
# (tests/fixtures/count_hf_params.py, meta device): the text model, which is what the import builds; the Hub's
# 27B count adds the SigLIP vision tower and the projector.
GEMMA3_27B_TEXT = {
    "model_type": "gemma3_text",
    "head_dim": 128,
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_attention_heads": 32,
    "num_hidden_layers": 62,
    "num_key_value_heads": 16,
    "query_pre_attn_scalar": 168,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}
GEMMA3_27B_TRANSFORMERS_PARAMS = 27_009_346_304


def test_gemma3_27b_is_the_published_text_model_with_transformers_parameter_count(tmp_path, capsys):
    bundled = load_spec(ROOT / "axgen/specs/gemma3_27b.py")
    image_text = {"model_type": "gemma3", "text_config": GEMMA3_27B_TEXT, "vision_config": {}}
    imported_spec = imported(tmp_path, capsys, image_text)
    assert imported_spec.decoder == bundled.decoder
    assert (imported_spec.vocab_size, imported_spec.d_model, imported_spec.tie_embeddings) == (
        262_208,
        5376,
        True,
    )
    assert imported_spec.features == bundled.features
    graph = from_spec(bundled)
    run_passes(graph, bundled.features)
    assert cost.num_params(graph) == GEMMA3_27B_TRANSFORMERS_PARAMS
    assert [(b.name, b.repeat) for b in graph.blocks()] == [
        ("layers", 50),
        ("tail_layers", 2),
        ("global_layers", 10),
    ]
