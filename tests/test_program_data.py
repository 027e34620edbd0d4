"""The emitted program's reader of `axgen data` directories: windows, order, shares, and the checks it makes
before the first step."""

import contextlib
import io
import json

import numpy as np
import pytest
from tests.conftest import ROOT

from axgen.data.datasets import write_dataset
from axgen.interop import load_program
from axgen.runtime import dataset
from axgen.runtime.program import Program
from axgen.runtime.run import parse_args

PROGRAM = ROOT / "generated/llama_tiny/cpu_1.py"


@pytest.fixture(scope="module")
def program():
    return load_program(PROGRAM)


def documents(count=40, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, rng.integers(5, 300)) for _ in range(count)]


def test_windows_cover_every_token_once_as_a_target_with_documents_numbered(program, tmp_path):
    docs = documents()
    write_dataset(
        tmp_path / "d", docs, vocab_size=256, bos_id=None, eos_id=0, eval_fraction=0, shard_tokens=3000
    )
    split = dataset.PackedSplit(tmp_path / "d", "train", seq_len=64)
    assert len(split.shards) > 1, "the test spans shards"

    stream, targets = [], 0
    for index in range(len(split)):
        tokens, segment_ids = split.window(index)
        real = segment_ids > 0
        first_of_shard = index in split.first_window
        stream.append(tokens[real] if first_of_shard else tokens[real][1:])  # windows share one token
        targets += real[1:].sum()
        ends = np.flatnonzero(np.diff(segment_ids[real]))
        assert np.all(tokens[real][ends] == 0), "a segment ends where its document's EOS is"
        assert segment_ids[0] == 1 and np.all(np.diff(segment_ids[real]) >= 0)
    expected = np.concatenate([np.append(d, 0) for d in docs])
    assert targets == len(expected) - len(split.shards), "every token but each shard's first is a target once"
    np.testing.assert_array_equal(np.concatenate(stream), expected)


def test_order_is_seeded_per_epoch_and_shared_between_processes(program, tmp_path, monkeypatch):
    write_dataset(tmp_path / "d", documents(), vocab_size=256, bos_id=None, eos_id=0, eval_fraction=0)
    split = dataset.PackedSplit(tmp_path / "d", "train", seq_len=32)
    batches = dataset.Batches(split, global_batch=8, seed=3, vocab_size=program.CONFIG["vocab_size"])
    steps_per_epoch = len(split) // 8
    epoch = [tuple(map(tuple, batches.local_batch(step)[0])) for step in range(steps_per_epoch)]
    assert (
        len({row for batch in epoch for row in batch}) == steps_per_epoch * 8
    ), "no window twice in an epoch"
    again = dataset.Batches(
        split, global_batch=8, seed=3, vocab_size=program.CONFIG["vocab_size"]
    ).local_batch(steps_per_epoch + 1)[0]
    assert not np.array_equal(again, batches.local_batch(1)[0]), "each epoch draws a new order"
    np.testing.assert_array_equal(
        dataset.Batches(split, 8, seed=3, vocab_size=program.CONFIG["vocab_size"]).local_batch(5)[0],
        batches.local_batch(5)[0],
    )
    assert not np.array_equal(
        dataset.Batches(split, 8, seed=4, vocab_size=program.CONFIG["vocab_size"]).local_batch(5)[0],
        batches.local_batch(5)[0],
    )

    whole = batches.local_batch(7)[0]
    monkeypatch.setattr(program.jax, "process_count", lambda: 2)
    shares = []
    for index in (0, 1):
        monkeypatch.setattr(program.jax, "process_index", lambda index=index: index)
        shares.append(
            dataset.Batches(split, 8, seed=3, vocab_size=program.CONFIG["vocab_size"]).local_batch(7)[0]
        )
    np.testing.assert_array_equal(np.concatenate(shares), whole)


def test_without_document_masking_rows_are_one_segment_and_padding_stays_out(program, tmp_path):
    write_dataset(tmp_path / "d", documents(3), vocab_size=256, bos_id=None, eos_id=0, eval_fraction=0)
    split = dataset.PackedSplit(tmp_path / "d", "train", seq_len=512)
    _, masked, _ = dataset.Batches(split, 1, seed=0, vocab_size=program.CONFIG["vocab_size"]).local_batch(0)
    _, merged, _ = dataset.Batches(
        split, 1, seed=0, vocab_size=program.CONFIG["vocab_size"], documents=False
    ).local_batch(0)
    assert masked.max() > 1 and set(np.unique(merged)) <= {0, 1}
    np.testing.assert_array_equal(merged == 0, masked == 0)


def run_main(program, *args):
    """The one line main prints refusing a dataset before jax starts; it exits 2, as for a bad flag."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = program.main(["--run-dir", "unused", "--steps", "1", *map(str, args)])
    assert code == 2
    [line] = stderr.getvalue().splitlines()
    return line


def test_a_vocabulary_beyond_the_spec_is_refused_naming_both_numbers_and_files(program, tmp_path):
    write_dataset(
        tmp_path / "big", [np.array([600, 3])], vocab_size=700, bos_id=None, eos_id=1, eval_fraction=0
    )
    message = run_main(program, "--data", tmp_path / "big")
    assert (
        f"{tmp_path / 'big' / 'manifest.json'}: the tokenizer's 700 tokens exceed vocab_size=512" in message
    )
    assert "specs/llama_tiny.py" in message

    write_dataset(
        tmp_path / "ids", [np.array([3, 4])], vocab_size=256, bos_id=None, eos_id=0, eval_fraction=0
    )
    manifest = json.loads((tmp_path / "ids/manifest.json").read_text())
    manifest["max_token_id"] = 9000
    (tmp_path / "ids/manifest.json").write_text(json.dumps(manifest))
    assert "max_token_id 9000 is beyond vocab_size=512 of specs/llama_tiny.py" in run_main(
        program, "--data", tmp_path / "ids"
    )


def test_a_token_the_manifest_hides_never_reaches_the_embedding(program, tmp_path):
    write_dataset(
        tmp_path / "d", [np.array([3, 4, 5])], vocab_size=256, bos_id=None, eos_id=0, eval_fraction=0
    )
    np.save(
        tmp_path / "d/train-00000.tokens.npy", np.array([3, 700, 5, 0], np.uint16)
    )  # the manifest says max 5
    split = dataset.PackedSplit(tmp_path / "d", "train", seq_len=4)
    with pytest.raises(dataset.DatasetError) as raised:
        dataset.Batches(split, 1, seed=0, vocab_size=program.CONFIG["vocab_size"]).local_batch(0)
    assert str(raised.value) == (
        f"shard {tmp_path / 'd/train-00000.tokens.npy'} holds token 700 >= vocab_size=512 (step 0)"
    )


@pytest.mark.parametrize("damage", ["truncated", "missing", "resized"])
def test_a_damaged_shard_is_named(program, tmp_path, damage):
    write_dataset(tmp_path / "d", documents(), vocab_size=256, bos_id=None, eos_id=0, eval_fraction=0)
    shard = tmp_path / "d/train-00000.tokens.npy"
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "missing":
        shard.unlink()
    else:
        np.save(shard, np.load(shard)[:-3])
    assert f"shard {shard}" in run_main(program, "--data", tmp_path / "d")


def test_document_offsets_that_do_not_increase_are_named_with_their_file_and_values(tmp_path):
    write_dataset(
        tmp_path / "d",
        [np.arange(1, 50), np.arange(1, 30), np.arange(1, 80)],
        vocab_size=256,
        bos_id=None,
        eos_id=0,
        eval_fraction=0,
    )
    docs = tmp_path / "d/train-00000.docs.npy"
    np.save(docs, np.load(docs)[::-1])  # 160, 80, 50
    with pytest.raises(dataset.DatasetError) as raised:
        dataset.PackedSplit(tmp_path / "d", "train", seq_len=16)
    assert (
        str(raised.value)
        == f"shard {docs}: document end offsets must increase, but document 1 ends at 80, not after 160"
    )


def test_a_directory_that_is_not_a_dataset_is_named(program, tmp_path):
    # The same words as `axgen data` and `axgen report` use: one reader of the format.
    assert f"{tmp_path / 'manifest.json'}: missing; not a dataset" in run_main(program, "--data", tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    assert f"{tmp_path / 'manifest.json'}:1: not valid JSON" in run_main(program, "--data", tmp_path)


def test_eval_data_of_another_tokenizer_is_refused_naming_both_manifests(program, tmp_path):
    for name, sha256 in (("train", "a" * 64), ("held_out", "b" * 64)):
        tokenizer = {"path": f"{name}.json", "sha256": sha256, "vocab_size": 256, "bos_id": None, "eos_id": 0}
        write_dataset(
            tmp_path / name,
            documents(),
            vocab_size=256,
            bos_id=None,
            eos_id=0,
            eval_fraction=0.5,
            tokenizer=tokenizer,
        )
    message = run_main(
        program, "--data", tmp_path / "train", "--eval-data", tmp_path / "held_out", "--eval-every", "5"
    )
    assert message == (
        f"error: {tmp_path / 'held_out/manifest.json'} records another tokenizer than"
        f" {tmp_path / 'train/manifest.json'} (sha256 bbbbbbbbbbbb vs aaaaaaaaaaaa): --eval-data must be"
        " tokenized as --data is"
    )


def test_evaluation_needs_an_eval_split(program, tmp_path):
    write_dataset(tmp_path / "d", documents(), vocab_size=256, bos_id=None, eos_id=0, eval_fraction=0)
    message = run_main(program, "--data", tmp_path / "d", "--eval-every", "5")
    assert f"{tmp_path / 'd'} has no eval split" in message


def test_a_run_dir_that_cannot_be_a_folder_is_refused_in_one_line(program, tmp_path):
    write_dataset(tmp_path / "d", documents(), vocab_size=256, bos_id=None, eos_id=0, eval_fraction=0)
    (tmp_path / "file").write_text("mine")
    assert run_main(program, "--data", tmp_path / "d", "--run-dir", tmp_path / "file") == (
        f"error: --run-dir {tmp_path / 'file'}: {tmp_path / 'file'} is not a directory"
    )
    assert (tmp_path / "file").read_text() == "mine"
    # Root may write anywhere but under /proc, which no check before trying can tell.
    assert run_main(program, "--data", tmp_path / "d", "--run-dir", "/proc/axgen-test/run").startswith(
        "error: --run-dir /proc/axgen-test/run: cannot create /proc/axgen-test: "
    )


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--batch", "0", "argument --batch: must be >= 1, got 0"),
        ("--batch", "-4", "argument --batch: must be >= 1, got -4"),
        ("--log-every", "0", "argument --log-every: must be >= 1, got 0"),
        ("--steps", "0", "argument --steps: must be >= 1, got 0"),
        ("--eval-every", "-1", "argument --eval-every: must be >= 0, got -1"),
    ],
)
def test_a_bad_flag_exits_2_with_one_line(program, flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(Program.from_module(program), ["--data", "d", "--run-dir", "r", flag, value])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.endswith(message)
