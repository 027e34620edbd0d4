"""Provenance names spec fields and backend rules by file and path, never by line: moving lines in a spec changes
neither the lowered graph nor what the program's header says about where the target's choices came from."""

import re

import pytest

from axgen.build import lowered
from axgen.loader import load_spec
from tests.conftest import ROOT

LINE_NUMBER = re.compile(r"\.py:\d+")


def _lowered_texts(spec_path, target: str) -> tuple[str, list[str]]:
    """The graph `axgen graph SPEC --target T` prints, and the plan's strings an emitted header prints."""
    graph, plan, _ = lowered(load_spec(spec_path), target)
    return graph.dump(), [plan.rule.provenance, plan.rule.why, str(plan.remat_source)]


# gpu-h100-8 takes the spec's own mesh rule and its remat; tpu-v5p-128 the spec's rule and the backend's remat.
@pytest.mark.parametrize("target", ["gpu-h100-8", "tpu-v5p-128"])
def test_moving_lines_in_a_spec_changes_no_provenance(tmp_path, target):
    source = (ROOT / "axgen/specs/gemma2_9b.py").read_text()
    as_written, moved = tmp_path / "as_written/specs/moved.py", tmp_path / "moved/specs/moved.py"
    for path, text in (
        (as_written, source),
        (moved, "\n\n# two blank lines and this comment move every line\n" + source),
    ):
        path.parent.mkdir(parents=True)
        path.write_text(text)
    dump, header = _lowered_texts(as_written, target)
    assert (dump, header) == _lowered_texts(moved, target)
    assert not LINE_NUMBER.search(dump) and not any(LINE_NUMBER.search(text) for text in header)
    assert "# attention · specs/moved.py: decoder.attention" in dump
    assert "# rope · specs/moved.py: features.rope passes=rope" in dump


def test_backend_choices_are_named_by_rule_and_role():
    _, spec_rule = _lowered_texts(ROOT / "axgen/specs/gemma2_9b.py", "gpu-h100-8")
    assert spec_rule[0] == spec_rule[2] == r"specs/gemma2_9b.py: mesh rule 'gpu-h100-\d+'"
    _, backend_rule = _lowered_texts(ROOT / "axgen/specs/llama2_7b.py", "gpu-h100-8")
    assert backend_rule[0] == "backends/gpu.py: mesh rule 'gpu-h100-[1-8]'"
    assert backend_rule[2] == "backends/gpu.py: remat default"


def test_a_derived_spec_names_the_file_that_set_each_field():
    """mixtral_8x7b.py replaces mistral's name and features; mistral_7b.py derives from llama3_8b.py, which
    built the decoder."""
    dump, _ = _lowered_texts(ROOT / "axgen/specs/mixtral_8x7b.py", "cpu-8")
    assert "# attention · specs/llama3_8b.py: decoder.attention" in dump
    assert "# moe · specs/mixtral_8x7b.py: features.moe passes=moe" in dump
    assert "# embedding · specs/mixtral_8x7b.py: vocab_size" in dump
