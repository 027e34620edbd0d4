"""A program trains on a conversation dataset's loss mask: only the assistant's tokens are targets, in the loss, the
eval loss and the count of trained targets each step logs; plain text trains every token as before."""

import json
import shutil

import jax
import numpy as np
import pytest
from tests.conftest import ROOT, run_python

from axgen.build import build
from axgen.cli import main as axgen
from axgen.files import write_atomically
from axgen.interop import load_program
from axgen.runtime import dataset

CHAT = ROOT / "tests/fixtures/chat"


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """llama_tiny with room for the chat fixtures' 600-token tokenizer, on one CPU device."""
    folder = tmp_path_factory.mktemp("program")
    (folder / "chat_tiny.py").write_text(
        "from axgen.specs.llama_tiny import spec as tiny\n"
        "spec = tiny.replace(name='chat-tiny', vocab_size=640, targets=['cpu-1'], "
        "train=tiny.train.replace(global_batch=8, seq_len=64, warmup_steps=5, steps=60))\n"
    )
    write_atomically(folder / "chat_tiny_cpu_1.py", build(folder / "chat_tiny.py", "cpu-1").source)
    return load_program(folder / "chat_tiny_cpu_1.py")


def test_a_token_the_mask_leaves_out_is_never_a_target(program):
    """The loss is the mean over the targets whose mask is 1; the last token of a row, a user's, is only ever a
    target, so changing it changes nothing when its mask is 0 and changes the loss when it is 1."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 600, (2, 65)).astype(np.int32)
    segment_ids = np.ones_like(tokens)
    loss_mask = (rng.random(tokens.shape) < 0.4).astype(np.int32)
    loss_mask[:, -1] = 0
    params = jax.jit(program.init_params)(jax.random.key(0))
    losses, trained, _ = program.target_losses(params, tokens, segment_ids, loss_mask)
    np.testing.assert_array_equal(trained, loss_mask[:, 1:] == 1)
    loss, metrics = program.loss_fn(params, tokens, segment_ids, loss_mask)
    expected = np.asarray(losses)[loss_mask[:, 1:] == 1].mean()
    np.testing.assert_allclose(float(metrics["cross_entropy"]), expected, rtol=1e-6)

    changed = tokens.copy()
    changed[:, -1] = (tokens[:, -1] + 7) % 600
    assert float(program.loss_fn(params, changed, segment_ids, loss_mask)[0]) == float(loss)
    loss_mask[:, -1] = 1
    assert float(program.loss_fn(params, changed, segment_ids, loss_mask)[0]) != float(
        program.loss_fn(params, tokens, segment_ids, loss_mask)[0]
    )
    # Without a mask, as for plain text, every target trains.
    _, all_trained, _ = program.target_losses(params, tokens, segment_ids, np.ones_like(tokens))
    assert bool(np.all(all_trained))


def test_the_assistant_only_loss_falls_and_each_step_logs_its_trained_targets(program, tmp_path, capsys):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    shutil.copy(CHAT / "synthetic-tokenizer.json", tokenizer / "tokenizer.json")
    shutil.copy(CHAT / "chatml-generation/chat_template.jinja", tokenizer / "chat_template.jinja")
    data = tmp_path / "data"
    # 400 sums asked by a user and answered by the assistant: the answers are learnable, the questions not.
    argv = ["data", CHAT / "arithmetic.jsonl", "--chat", "--tokenizer", tokenizer / "tokenizer.json"]
    assert axgen([str(a) for a in [*argv, "--eval-fraction", "0.1", "--out", data]]) == 0, capsys.readouterr()
    manifest = dataset.read_manifest(data)
    trained, total = manifest["conversations"]["trained_tokens"], sum(
        split["num_tokens"] for split in manifest["splits"].values()
    )
    assert 0 < trained < total / 2

    log = run_python(
        program.__file__,
        *("--data", data, "--run-dir", tmp_path / "run", "--steps", "60", "--log-every", "10"),
        *("--eval-every", "30", "--eval-batches", "2"),
    )
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert all(0 < r["targets"] < 8 * 64 / 2 for r in steps), [r["targets"] for r in steps]
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.5, (steps[0]["loss"], steps[-1]["loss"])
    evals = [r for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert 0 < evals[-1]["eval_tokens"] < 2 * 8 * 64 / 2
    assert f"| targets {int(steps[-1]['targets'])}" in log
