"""All feature passes together: the IR after each pass (snapshots), `axgen explain`, a program that uses them
all, and the error for features that cannot work together."""

import re

import jax
import numpy as np
import pytest

from axgen.build import build
from axgen.cli import main as axgen
from axgen.analysis.explain import explain, logic_lines
from axgen.interop import load_program
from axgen.ir import from_spec
from axgen.loader import load_spec
from axgen.passes import run_passes
from axgen.passes.manager import order
from axgen.spec import SpecError
from tests.conftest import ROOT
from axgen.runtime.program import Program

ALL_FEATURES = ROOT / "axgen/specs/features_tiny.py"


def test_ir_after_each_pass(snapshot):
    spec = load_spec(ALL_FEATURES)
    features = {f.pass_name: f for f in spec.features}
    graph = from_spec(spec)
    assert order(list(features)) == [
        "moe",
        "qkv_bias",
        "qk_norm",
        "quantize",
        "remat",
        "sliding_window",
        "gemma_block",
        "rope",
        "softcap",
    ]
    for name in order(list(features)):
        run_passes(graph, [features[name]])
        assert graph.dump() == snapshot(name=f"after_{name}")


def test_a_program_with_every_feature_trains():
    program = load_program(ROOT / "generated/features_tiny/cpu_1.py")
    state = Program.from_module(program).init_state(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    step = jax.jit(program.train_step)
    first = None
    for _ in range(5):
        state, metrics = step(state, tokens)
        first = first or float(metrics["loss"])
    assert float(metrics["loss"]) < first and np.isfinite(float(metrics["load_balance_loss"]))


def test_explain_counts_what_each_pass_did(capsys):
    reports = {r.name: r for r in explain(build(ROOT / "axgen/specs/llama2_7b.py", "tpu-v5e-256"))}
    assert (reports["rope"].nodes, reports["rope"].instances, reports["rope"].layers) == (3, 96, 32)
    # The target's default remat: the lowering names every projection's output, q, k, v, wo, gate, up, down.
    assert (reports["lower.remat"].nodes, reports["lower.remat"].instances) == (7, 224)
    assert reports["lower.remat"].origin == "backends/tpu.py" and "remat" not in reports
    assert reports["lower.attention_kernel"].instances == 32 and reports["lower.shard"].main_nodes == 2
    every = {r.name: r for r in explain(build(ALL_FEATURES, "cpu-1"))}
    assert (every["remat"].nodes, every["remat"].layers) == (0, 4)  # a policy for each block, no node changed
    assert 0 < reports["rope"].logic_lines < reports["rope"].file_lines
    moe = {r.name: r for r in explain(build(ROOT / "axgen/specs/moe_tiny.py", "cpu-8"))}["moe"]
    assert (moe.layers, moe.main_nodes) == (2, 1)  # every second layer, and the scan that now runs two blocks
    assert axgen(["explain", "moe_tiny", "--target", "cpu-8"]) == 0
    assert re.search(r"\nmoe +moe\(num_experts=4", capsys.readouterr().out)


def test_logic_lines_skip_docstrings_comments_imports_and_blanks():
    source = '"""Module."""\n\nimport re\n\n\ndef f(x):\n    """Doc\n    string."""\n    # why\n    return (x +\n            1)\n'
    assert logic_lines(source) == 3


def test_features_that_cannot_work_together_name_both(tmp_path):
    path = tmp_path / "conflict.py"
    path.write_text(
        "from axgen.specs.features_tiny import spec as tiny\n"
        "from axgen.spec import features as F\n"
        "spec = tiny.replace(features=[*tiny.features[:3], F.quantize(dtype='fp8', emulate=True, scaling='delayed',"
        " include='.*')])\n"
    )
    with pytest.raises(SpecError) as error:
        build(path, "cpu-1")
    message = str(error.value)
    assert "conflict.py:3: quantize(dtype=fp8, include=.*, scaling=delayed" in message
    assert "cannot be combined with moe(" in message
    assert "(specs/features_tiny.py:17): include selects moe_layers/moe" in message


@pytest.mark.parametrize("target", ["tpu_v5e_8", "gpu_h100_8"])
def test_every_target_of_the_all_features_spec_runs_here(target, monkeypatch):
    monkeypatch.setenv("AXGEN_XLA_KERNELS", "1")
    program = load_program(ROOT / f"generated/features_tiny/{target}.py")
    params = program.init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    loss, metrics = program.loss_fn(params, jax.numpy.concatenate([tokens, tokens[:, :1]], axis=1))
    assert (
        np.isfinite(float(loss))
        and abs(float(metrics["cross_entropy"]) - np.log(program.CONFIG["vocab_size"])) < 0.5
    )
