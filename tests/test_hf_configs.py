"""The published configs of every family axgen claims (tests/fixtures/hf_configs/published/, each with where it was
found and its sha256 in sources.json) import with the parameter count transformers computes for them, or are
refused in one line naming the key that stops them, as the README's support table says."""

import hashlib
import json
import re

import pytest
from tests.conftest import ROOT

from axgen.build import lowered
from axgen.cli import main as axgen
from axgen.ir import cost, from_spec
from axgen.loader import load_spec
from axgen.passes import run_passes

CORPUS = ROOT / "tests/fixtures/hf_configs/published"
SOURCES = json.loads((CORPUS / "sources.json").read_text())

# transformers 5.23.0's count for each config, by tests/fixtures/count_hf_params.py: the model built from the
# config on torch's meta device, numel() summed over model.parameters(), a tied embedding once.
TRANSFORMERS_PARAMS = {
    "gemma-2-9b-it": 9_241_705_984,
    "llama-2-13b-hf": 13_015_864_320,
    "llama-2-70b-hf": 68_976_648_192,
    "llama-2-7b-hf": 6_738_415_616,
    "llama-3.1-405b": 405_853_388_800,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-70b-instruct": 70_553_706_496,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-8b-instruct": 8_030_261_248,
    "llama-3.2-1b-instruct": 1_235_814_400,
    "llama-3.2-3b-instruct": 3_212_749_824,
    "meta-llama-3-8b-instruct": 8_030_261_248,
    "mistral-7b-v0.1": 7_241_732_096,
    "mistral-nemo-instruct-2407": 12_247_782_400,
    "mixtral-8x22b-v0.1": 140_620_634_112,
    "mixtral-8x7b-v0.1": 46_702_792_704,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
    "qwen2-0.5b": 494_032_768,
    "qwen2-1.5b-instruct": 1_543_714_304,
    "qwen2-72b-instruct": 72_706_203_648,
    "qwen2-7b-instruct": 7_615_616_512,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-1.5b-instruct": 1_543_714_304,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-32b-instruct": 32_763_876_352,
    "qwen2.5-3b-instruct": 3_085_938_688,
    "qwen2.5-72b": 72_706_203_648,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-7b-instruct": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-14b": 14_768_307_200,
    "qwen3-32b": 32_762_123_264,
    "qwen3-30b-a3b": 30_532_122_624,
    # transformers builds the experts in the model's dtype: the dequantized model, not the Hub's MXFP4.
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "smollm2-135m": 134_515_008,
    "tinyllama-1.1b-chat-v1.0": 1_100_048_384,
    "deepseek-v2-lite": 15_706_484_224,
}
# DeepSeek's checkpoints of V3's architecture store their projections in FP8 (quantization_config: e4m3 in 128x128
# blocks, each with a weight_scale_inv), which convert-hf dequantizes. transformers 5.23.0's count, by
# count_hf_params.py: from_config applies no quantizer, so it is the model in its dtype, as convert-hf writes it. The
# multi-token-prediction layer (num_nextn_predict_layers, the Hub's model.layers.61) is not in transformers' model,
# nor trained by axgen.
TRANSFORMERS_PARAMS |= {
    "deepseek-v3": 671_026_404_352,
    "deepseek-v3.1": 671_026_404_352,
    "deepseek-r1": 671_026_404_352,
}


# The published configs axgen refuses, with the start of the line that says why.
def test_the_corpus_is_what_sources_json_says():
    assert {p.stem for p in CORPUS.glob("*.json")} - {"sources"} == set(SOURCES)
    assert set(SOURCES) == set(TRANSFORMERS_PARAMS)
    for slug, source in SOURCES.items():
        assert hashlib.sha256((CORPUS / f"{slug}.json").read_bytes()).hexdigest() == source["sha256"], slug
        assert "/" in source["hub"] and "/" in source["repository"] and source["path"], slug
        assert re.fullmatch("[0-9a-f]{40}", source["commit"]), slug


@pytest.mark.parametrize("slug", sorted(TRANSFORMERS_PARAMS))
def test_each_published_config_imports_with_the_parameter_count_transformers_gives(slug, tmp_path, capsys):
    code = axgen(["import-hf", str(CORPUS / f"{slug}.json"), "--out", str(tmp_path / "spec.py")])
    output = capsys.readouterr()
    assert code == 0, output.err
    assert f", {TRANSFORMERS_PARAMS[slug]:,} parameters" in output.out
    lowered(load_spec(tmp_path / "spec.py"), "cpu-8")  # and builds for its target as written


@pytest.mark.parametrize("slug", ["gpt-oss-20b", "gpt-oss-120b"])
def test_gpt_oss_imports_as_the_bundled_spec(slug, tmp_path, capsys):
    """The published config, YaRN and all, imports as the bundled spec, with transformers' count."""
    assert axgen(["import-hf", str(CORPUS / f"{slug}.json"), "--out", str(tmp_path / "spec.py")]) == 0
    imported = load_spec(tmp_path / "spec.py")
    bundled = load_spec(ROOT / "axgen/specs" / f"{slug.replace('-', '_')}.py")
    assert (imported.vocab_size, imported.d_model, imported.tie_embeddings, imported.decoder) == (
        bundled.vocab_size,
        bundled.d_model,
        bundled.tie_embeddings,
        bundled.decoder,
    )
    assert imported.features == bundled.features
    graph = from_spec(bundled)
    run_passes(graph, bundled.features)
    assert cost.num_params(graph) == TRANSFORMERS_PARAMS[slug]


# The published DeepSeek configs, each with the bundled spec it must import as (V3's, V3.1's and R1's with their
# quantization_config, which says how the checkpoint stores the weights, not what the model computes: the spec's
# comment says it).
DEEPSEEK_BUNDLED = {
    "deepseek-v2-lite": "deepseek_v2_lite",
    "deepseek-v3": "deepseek_v3",
    "deepseek-v3.1": "deepseek_v3",
    "deepseek-r1": "deepseek_v3",
}


@pytest.mark.parametrize("slug", sorted(DEEPSEEK_BUNDLED))
def test_a_published_deepseek_config_imports_as_the_bundled_spec(slug, tmp_path, capsys):
    config = json.loads((CORPUS / f"{slug}.json").read_text())
    assert ("quantization_config" in config) == (DEEPSEEK_BUNDLED[slug] == "deepseek_v3")
    code = axgen(["import-hf", str(CORPUS / f"{slug}.json"), "--out", str(tmp_path / "spec.py")])
    output = capsys.readouterr()
    assert code == 0, output.err
    assert f", {TRANSFORMERS_PARAMS[slug]:,} parameters" in output.out
    text = (tmp_path / "spec.py").read_text()
    fp8 = "# The published checkpoint stores the projections as FP8 (e4m3) in 128 x 128 blocks"
    assert (fp8 in text) == ("quantization_config" in config)
    assert ("scale_fmt ue8m0" in text) == (slug == "deepseek-v3.1")
    imported = load_spec(tmp_path / "spec.py")
    bundled = load_spec(ROOT / "axgen/specs" / f"{DEEPSEEK_BUNDLED[slug]}.py")
    assert (imported.vocab_size, imported.d_model, imported.tie_embeddings, imported.decoder) == (
        bundled.vocab_size,
        bundled.d_model,
        bundled.tie_embeddings,
        bundled.decoder,
    )
    assert imported.features == bundled.features
