"""`axgen data`, `axgen tokenizer train`, `axgen corpus` and the dataset format they write."""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models

import axgen.data.datasets
from axgen.cli import main
from axgen.data.corpus import MODULES, write_corpus
from axgen.data.datasets import read_manifest, write_dataset
from axgen.files import OutputError, staging_dir
from axgen.data.inputs import DataError
from axgen.data.tokenizer import train_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "Sphinx of black quartz, judge my vow: naïve café 🦊.",
    "def add(a, b):\n    return a + b\n",
    "How vexingly quick daft zebras jump; the five boxing wizards jump quickly.",
]


def documents_of(directory: Path, split: str) -> list[np.ndarray]:
    """Every document of a split, bos/eos included, read back through the shards' offsets."""
    manifest = read_manifest(directory)
    documents = []
    for shard in manifest["splits"][split]["shards"]:
        tokens = np.load(directory / shard["tokens"])
        ends = np.load(directory / shard["docs"])
        assert ends.dtype == np.int64 and ends[-1] == len(tokens) and np.all(np.diff(ends) > 0)
        documents += np.split(tokens, ends[:-1])
    return documents


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def data(capsys, tokenizer_file: Path, out: Path, *args) -> tuple[int, str, str]:
    """`axgen data ARGS --tokenizer TOKENIZER --out OUT`; every document goes to train unless ARGS say so."""
    return run(capsys, "data", "--eval-fraction", 0, *args, "--tokenizer", tokenizer_file, "--out", out)


def error_of(capsys, *argv: str) -> str:
    """The one-line error of a command that must fail with exit code 2."""
    code, _, err = run(capsys, *argv)
    assert code == 2, err
    assert err.startswith("axgen: error: ") and err.count("\n") == 1, err
    return err.removeprefix("axgen: error: ").strip()


def random_documents(count: int, vocab_size: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size - 2, size=rng.integers(1, 40)) for _ in range(count)]


# --- write_dataset ------------------------------------------------------------------------------------------


def test_write_dataset_frames_documents_and_splits_shards_by_token_count(tmp_path):
    documents = random_documents(50, 1000)
    manifest = write_dataset(
        tmp_path / "ds", documents, vocab_size=1000, bos_id=998, eos_id=999, eval_fraction=0, shard_tokens=100
    )
    train = manifest["splits"]["train"]
    framed = [np.concatenate([[998], doc, [999]]) for doc in documents]
    assert [list(d) for d in documents_of(tmp_path / "ds", "train")] == [list(d) for d in framed]
    assert train["num_documents"] == 50 and train["num_tokens"] == sum(len(d) for d in framed)
    assert manifest["splits"]["eval"] == {"num_documents": 0, "num_tokens": 0, "shards": []}
    # A shard closes at the first document that takes it to 100 tokens or more.
    expected_sizes, size = [], 0
    for document in framed:
        size += len(document)
        if size >= 100:
            expected_sizes, size = expected_sizes + [size], 0
    assert [shard["num_tokens"] for shard in train["shards"]] == expected_sizes + [size] * (size > 0)
    assert len(expected_sizes) > 5
    assert [shard["tokens"] for shard in train["shards"][:2]] == [
        "train-00000.tokens.npy",
        "train-00001.tokens.npy",
    ]
    assert sum(shard["num_documents"] for shard in train["shards"]) == 50
    assert manifest["max_token_id"] == 999
    assert all(
        s["max_token_id"] == int(np.load(tmp_path / "ds" / s["tokens"]).max()) for s in train["shards"]
    )
    assert (
        manifest["token_dtype"] == "uint16"
        and np.load(tmp_path / "ds" / "train-00000.tokens.npy").dtype == np.uint16
    )
    assert manifest["tokenizer"] == {
        "path": None,
        "sha256": None,
        "vocab_size": 1000,
        "bos_id": 998,
        "eos_id": 999,
    }
    assert read_manifest(tmp_path / "ds") == manifest


def test_without_bos_a_document_is_its_tokens_and_eos(tmp_path):
    documents = [np.array([5, 6, 7]), np.array([8])]
    write_dataset(tmp_path / "ds", documents, vocab_size=10, bos_id=None, eos_id=9, eval_fraction=0)
    assert [list(d) for d in documents_of(tmp_path / "ds", "train")] == [[5, 6, 7, 9], [8, 9]]


def test_a_shard_closes_as_soon_as_it_holds_shard_tokens(tmp_path):
    manifest = write_dataset(
        tmp_path / "ds",
        [np.arange(3)] * 5,
        vocab_size=10,
        bos_id=None,
        eos_id=9,
        eval_fraction=0,
        shard_tokens=8,
    )
    shards = manifest["splits"]["train"]["shards"]
    assert [(s["num_documents"], s["num_tokens"]) for s in shards] == [(2, 8), (2, 8), (1, 4)]
    assert list(np.load(tmp_path / "ds" / "train-00001.docs.npy")) == [4, 8]


@pytest.mark.parametrize("vocab_size, dtype", [(65536, np.uint16), (65537, np.uint32), (151_000, np.uint32)])
def test_token_dtype_is_the_smallest_that_holds_the_vocabulary(tmp_path, vocab_size, dtype):
    top = vocab_size - 1
    manifest = write_dataset(
        tmp_path / "ds",
        [np.array([top - 1, 3])],
        vocab_size=vocab_size,
        bos_id=0,
        eos_id=top,
        eval_fraction=0,
    )
    tokens = np.load(tmp_path / "ds" / "train-00000.tokens.npy")
    assert tokens.dtype == dtype and manifest["token_dtype"] == np.dtype(dtype).name
    assert list(tokens) == [0, top - 1, 3, top] and manifest["max_token_id"] == top


def test_eval_split_is_drawn_per_document_from_the_seed(tmp_path):
    documents = random_documents(400, 500)

    def eval_documents(seed: int) -> list[list[int]]:
        out = tmp_path / f"seed{seed}-{len(list(tmp_path.iterdir()))}"
        write_dataset(out, documents, vocab_size=500, bos_id=None, eos_id=499, eval_fraction=0.25, seed=seed)
        return [list(d[:-1]) for d in documents_of(out, "eval")]

    chosen = np.random.default_rng(7).random(len(documents)) < 0.25
    expected = [list(d) for d, to_eval in zip(documents, chosen) if to_eval]
    assert eval_documents(7) == expected and 60 < len(expected) < 140
    assert eval_documents(7) == expected
    assert eval_documents(8) != expected


def test_an_empty_train_split_and_out_of_vocabulary_ids_are_errors(tmp_path):
    with pytest.raises(DataError, match="no documents"):
        write_dataset(tmp_path / "a", [], vocab_size=10, bos_id=None, eos_id=9)
    with pytest.raises(DataError, match="went to the eval split"):
        write_dataset(
            tmp_path / "b", [np.array([1])], vocab_size=10, bos_id=None, eos_id=9, eval_fraction=0.99999
        )
    with pytest.raises(DataError, match="token id 10 in the train split is outside the vocabulary of 10"):
        write_dataset(
            tmp_path / "c", [np.array([1, 10])], vocab_size=10, bos_id=None, eos_id=9, eval_fraction=0
        )
    with pytest.raises(DataError, match="expected a 1-D integer array"):
        write_dataset(tmp_path / "d", [np.array([1.5])], vocab_size=10, bos_id=None, eos_id=9)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_directory_is_replaced_only_when_asked_and_only_if_it_is_a_dataset(tmp_path):
    out = tmp_path / "ds"
    write_dataset(out, [np.array([1])], vocab_size=10, bos_id=None, eos_id=9, eval_fraction=0)
    with pytest.raises(OutputError, match="already exists"):
        write_dataset(out, [np.array([2])], vocab_size=10, bos_id=None, eos_id=9, eval_fraction=0)
    write_dataset(out, [np.array([3])], vocab_size=10, bos_id=None, eos_id=9, eval_fraction=0, overwrite=True)
    assert [list(d) for d in documents_of(out, "train")] == [[3, 9]]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="has no manifest.json, so --force will not replace it"):
        write_dataset(
            tmp_path / "notes", [np.array([3])], vocab_size=10, bos_id=None, eos_id=9, overwrite=True
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "notes"]


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError])
def test_an_interrupted_write_leaves_no_directory_behind(tmp_path, monkeypatch, failure):
    saves, real_save = [], np.save

    def failing_save(path, array):
        saves.append(path)
        if len(saves) == 3:
            raise failure("interrupted")
        real_save(path, array)

    monkeypatch.setattr(axgen.data.datasets.np, "save", failing_save)
    with pytest.raises(failure):
        write_dataset(
            tmp_path / "ds", random_documents(40, 100), vocab_size=100, bos_id=0, eos_id=99, shard_tokens=50
        )
    assert len(saves) == 3 and saves[2].name == "train-00001.tokens.npy" and list(tmp_path.iterdir()) == []


def test_a_reader_failing_midway_leaves_no_directory_behind(tmp_path):
    def documents():
        yield np.array([1, 2])
        raise DataError("data.jsonl:2: not valid JSON")

    with pytest.raises(DataError, match="data.jsonl:2"):
        write_dataset(tmp_path / "ds", documents(), vocab_size=10, bos_id=None, eos_id=9, shard_tokens=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "no such dataset directory"),
        (lambda d: d.mkdir(), "manifest.json: missing"),
        (
            lambda d: d.mkdir() or (d / "manifest.json").write_text('{"format":\n'),
            "manifest.json:2: not valid JSON",
        ),
        (
            lambda d: d.mkdir() or (d / "manifest.json").write_text('{"format": "x/2"}'),
            'format "x/2", expected',
        ),
    ],
)
def test_read_manifest_names_what_is_wrong(tmp_path, setup, message):
    setup(tmp_path / "ds")
    with pytest.raises(DataError, match=message) as raised:
        read_manifest(tmp_path / "ds")
    assert str(tmp_path / "ds") in str(raised.value)


# --- axgen tokenizer train, axgen data ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A byte-level BPE of 320 tokens fitted to TEXTS by `axgen tokenizer train`."""
    directory = tmp_path_factory.mktemp("tokenizer")
    (directory / "corpus.txt").write_text("\n".join(TEXTS * 3))
    out = directory / "tok" / "tokenizer.json"
    assert (
        main(["tokenizer", "train", str(directory / "corpus.txt"), "--vocab-size", "320", "--out", str(out)])
        == 0
    )
    return out


def test_tokenizer_train_writes_a_byte_level_bpe_with_its_special_tokens(tokenizer_file):
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    assert tokenizer.get_vocab_size() == 320
    assert tokenizer.token_to_id("<|endoftext|>") == 0 and tokenizer.token_to_id("<|begin_of_text|>") == 1
    config = json.loads(tokenizer_file.with_name("tokenizer_config.json").read_text())
    assert config == {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}
    unseen = "Ünïcödé ✓ text never seen in training"
    assert tokenizer.decode(tokenizer.encode(unseen).ids) == unseen


def test_tokenizer_train_needs_room_for_bytes_and_special_tokens(tmp_path, capsys, tokenizer_file):
    message = error_of(
        capsys, "tokenizer", "train", tokenizer_file, "--vocab-size", 258, "--out", tmp_path / "t.json"
    )
    assert message == "--vocab-size 258: must be more than 258 (256 bytes and 2 special tokens)"


def test_tokenizer_train_refuses_a_vocabulary_too_large_to_allocate(tmp_path, capsys, tokenizer_file):
    # tokenizers allocates for every token asked for before it reads a text: 10**9 aborted the process.
    message = error_of(
        capsys, "tokenizer", "train", tokenizer_file, "--vocab-size", 10**9, "--out", tmp_path / "t.json"
    )
    assert message == "--vocab-size 1000000000: must be at most 16777216 (2**24)"
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_train_warns_when_the_inputs_give_fewer_tokens_than_asked(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("a tiny corpus, a tiny corpus")
    out = tmp_path / "tok.json"
    code, printed, err = run(
        capsys, "tokenizer", "train", tmp_path / "in.txt", "--vocab-size", 100000, "--out", out
    )
    size = Tokenizer.from_file(str(out)).get_vocab_size()
    assert code == 0 and size < 300 and f"({size} tokens)" in printed
    assert err == (
        f"axgen: warning: {out}: {size} tokens, fewer than --vocab-size 100000: the inputs ran out of pairs to"
        " merge\n"
    )


def test_tokenizer_train_replaces_an_existing_tokenizer_only_when_asked(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("\n".join(TEXTS * 3))
    out = tmp_path / "tok" / "tokenizer.json"
    train = ["tokenizer", "train", tmp_path / "in.txt", "--vocab-size", 320, "--out", out]
    assert run(capsys, *train)[0] == 0
    trained = out.read_bytes()
    out.write_text("mine")
    assert error_of(capsys, *train) == f"{out}: already exists (pass --force to replace it)"
    out.unlink()
    config = out.with_name("tokenizer_config.json")
    assert error_of(capsys, *train) == f"{config}: already exists (pass --force to replace it)"
    assert sorted(p.name for p in out.parent.iterdir()) == ["tokenizer_config.json"]
    train_tokenizer([str(tmp_path / "in.txt")], 320, out, overwrite=True)  # what --force passes
    assert out.read_bytes() == trained


def decoded_documents(directory: Path, tokenizer_file: Path, split: str = "train") -> list[str]:
    """The text of each document, checked to be framed by the trained tokenizer's BOS (1) and EOS (0)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    documents = documents_of(directory, split)
    assert all(doc[0] == 1 and doc[-1] == 0 and 0 not in doc[1:-1] for doc in documents)
    return [tokenizer.decode(doc[1:-1].tolist()) for doc in documents]


def test_data_from_text_files_one_document_per_file(tmp_path, capsys, tokenizer_file):
    for index, text in enumerate(TEXTS):
        (tmp_path / f"doc{index}.txt").write_text(text)
    code, out, _ = data(capsys, tokenizer_file, tmp_path / "ds", tmp_path / "doc*.txt")
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'ds'}: train 5 documents / ")
    assert decoded_documents(tmp_path / "ds", tokenizer_file) == TEXTS
    manifest = read_manifest(tmp_path / "ds")
    assert manifest["sources"] == [str(tmp_path / f"doc{index}.txt") for index in range(5)]
    assert manifest["tokenizer"]["path"] == str(tokenizer_file) and manifest["tokenizer"]["vocab_size"] == 320
    assert (manifest["tokenizer"]["bos_id"], manifest["tokenizer"]["eos_id"]) == (1, 0)
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()


def test_data_one_document_per_non_empty_line(tmp_path, capsys, tokenizer_file):
    (tmp_path / "lines.txt").write_text("first line\n\n   \r\nsecond line\r\nthird\n")
    assert data(capsys, tokenizer_file, tmp_path / "ds", tmp_path / "lines.txt", "--doc-per-line")[0] == 0
    assert decoded_documents(tmp_path / "ds", tokenizer_file) == ["first line", "second line", "third"]


def test_data_from_json_lines_and_parquet(tmp_path, capsys, tokenizer_file):
    inputs = tmp_path / "in"
    (inputs / "nested").mkdir(parents=True)
    (inputs / "a.jsonl").write_text(
        "".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(TEXTS[:2])) + "\n"
    )
    pq.write_table(
        pa.table({"id": [1, 2, 3], "body": TEXTS[2:]}), inputs / "nested" / "b.parquet", row_group_size=2
    )
    (inputs / "nested" / "README.md").write_text("not an input")
    code, _, err = data(
        capsys, tokenizer_file, tmp_path / "ds", inputs, "--field", "body", "--column", "body"
    )
    assert code == 0, err
    assert decoded_documents(tmp_path / "ds", tokenizer_file) == TEXTS
    assert read_manifest(tmp_path / "ds")["sources"] == [
        str(inputs / "a.jsonl"),
        str(inputs / "nested" / "b.parquet"),
    ]


def test_data_splits_by_seed_and_shards_by_token_count(tmp_path, capsys, tokenizer_file):
    lines = [f"{TEXTS[i % 3]} #{i}" for i in range(300)]
    (tmp_path / "many.txt").write_text("\n".join(lines))
    inputs = [tmp_path / "many.txt", "--doc-per-line", "--eval-fraction", 0.1]
    assert data(capsys, tokenizer_file, tmp_path / "a", *inputs, "--shard-tokens", 1000)[0] == 0
    assert data(capsys, tokenizer_file, tmp_path / "b", *inputs, "--seed", 1)[0] == 0
    a, b = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    chosen = np.random.default_rng(0).random(300) < 0.1
    eval_texts = decoded_documents(tmp_path / "a", tokenizer_file, "eval")
    assert eval_texts == [line for line, to_eval in zip(lines, chosen) if to_eval]
    assert len(decoded_documents(tmp_path / "a", tokenizer_file)) == 300 - len(eval_texts)
    assert decoded_documents(tmp_path / "b", tokenizer_file, "eval") != eval_texts
    assert len(a["splits"]["train"]["shards"]) > 5 and len(b["splits"]["train"]["shards"]) == 1
    assert a["splits"]["train"]["num_tokens"] + a["splits"]["eval"]["num_tokens"] == sum(
        split["num_tokens"] for split in b["splits"].values()
    )


def test_skip_bad_counts_the_records_it_skips(tmp_path, capsys, tokenizer_file):
    lines = [
        '{"text": "good one"}',
        "{not json",
        '{"title": "no text"}',
        '{"text": "good two"}',
        '{"text": 5}',
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    code, out, _ = data(capsys, tokenizer_file, tmp_path / "ds", tmp_path / "d.jsonl", "--skip-bad")
    assert code == 0 and "; 3 skipped;" in out
    assert decoded_documents(tmp_path / "ds", tokenizer_file) == ["good one", "good two"]
    skipped = read_manifest(tmp_path / "ds")["skipped"]
    assert skipped["count"] == 3
    assert [e.split(": ")[0] for e in skipped["examples"]] == [
        f"{tmp_path / 'd.jsonl'}:{n}" for n in (2, 3, 5)
    ]


def bad_input_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """(inputs, the start of the error they give): each writes its own file under tmp."""
    (tmp / "bad.jsonl").write_text('{"text": "ok"}\n{"text": "cut\n')
    (tmp / "fields.jsonl").write_text('{"text": "ok"}\n\n{"title": "t", "body": "b"}\n')
    (tmp / "number.jsonl").write_text('{"text": 3}\n')
    (tmp / "array.json").write_text("[1, 2]\n")
    (tmp / "latin1.txt").write_bytes("line one\ncaf\xe9\n".encode("latin-1"))
    (tmp / "garbage.parquet").write_bytes(b"not parquet at all")
    pq.write_table(pa.table({"id": [1], "body": ["b"]}), tmp / "columns.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp / "ints.parquet")
    pq.write_table(pa.table({"text": ["a", None]}), tmp / "nulls.parquet")
    (tmp / "empty.txt").write_text("")
    (tmp / "blank.txt").write_text(" \n\t\r\n")
    (tmp / "data.csv").write_text("a,b\n")
    (tmp / "nothing").mkdir()
    return [
        (["bad.jsonl"], "{tmp}/bad.jsonl:2: not valid JSON: Invalid control character at: column 14"),
        (["fields.jsonl"], '{tmp}/fields.jsonl:3: no string field "text" (keys: title, body); pass --field'),
        (["number.jsonl"], '{tmp}/number.jsonl:1: field "text" is a JSON number, not a string; pass --field'),
        (["array.json"], '{tmp}/array.json:1: a JSON array, not an object with a string field "text"'),
        (["latin1.txt"], "{tmp}/latin1.txt:2: not valid UTF-8 (byte 0xe9 at offset 12)"),
        (["garbage.parquet"], "{tmp}/garbage.parquet: not a readable Parquet file: "),
        (["columns.parquet"], '{tmp}/columns.parquet: no column "text" (columns: id, body); pass --column'),
        (["ints.parquet"], '{tmp}/ints.parquet: column "text" holds int64, not strings; pass --column'),
        (["nulls.parquet"], '{tmp}/nulls.parquet: row 1: "text" is null'),
        (["empty.txt"], "no documents in {tmp}/empty.txt"),
        (["blank.txt"], "no documents in {tmp}/blank.txt"),
        (["data.csv"], "{tmp}/data.csv: not an input file type (expected .txt, .jsonl, .json or .parquet)"),
        (["nothing"], "{tmp}/nothing: no .txt, .jsonl, .json or .parquet files in this directory"),
        (["*.missing"], "{tmp}/*.missing: no input files matched"),
    ]


def test_every_bad_input_is_one_line_naming_the_file_and_line(tmp_path, capsys, tokenizer_file):
    for inputs, expected in bad_input_cases(tmp_path):
        paths = [tmp_path / name for name in inputs]
        message = error_of(capsys, "data", *paths, "--tokenizer", tokenizer_file, "--out", tmp_path / "ds")
        assert message.startswith(expected.format(tmp=tmp_path)), message
        assert not (tmp_path / "ds").exists()


def test_the_same_bad_inputs_stop_tokenizer_training(tmp_path, capsys):
    for inputs, expected in bad_input_cases(tmp_path):
        paths = [tmp_path / name for name in inputs]
        train = ["tokenizer", "train", *paths, "--vocab-size", 300, "--out", tmp_path / "t" / "tok.json"]
        assert error_of(capsys, *train).startswith(expected.format(tmp=tmp_path))
        assert not (tmp_path / "t").exists()


def write_tokenizer(path: Path, vocab: dict[str, int]) -> Path:
    Tokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab)))).save(str(path))
    return path


def test_tokenizer_problems_are_one_line_errors(tmp_path, capsys, tokenizer_file):
    (tmp_path / "in.txt").write_text("some text")
    (tmp_path / "broken.json").write_text('{"model": ')
    no_eos = write_tokenizer(tmp_path / "plain.json", {"[UNK]": 0, "a": 1})
    with_tokenizer = ["data", tmp_path / "in.txt", "--out", tmp_path / "ds", "--tokenizer"]
    assert error_of(capsys, *with_tokenizer, tmp_path / "none.json").startswith(
        f"{tmp_path / 'none.json'}: cannot read"
    )
    assert error_of(capsys, *with_tokenizer, tmp_path / "broken.json").startswith(
        f"{tmp_path / 'broken.json'}: not a valid tokenizer.json: "
    )
    assert error_of(capsys, *with_tokenizer, no_eos).endswith("in the vocabulary); pass --eos TOKEN")
    assert error_of(capsys, *with_tokenizer, tokenizer_file, "--bos", "<missing>") == (
        f'{tokenizer_file}: no token "<missing>" in the vocabulary (named by --bos)'
    )
    assert not (tmp_path / "ds").exists()


def test_special_tokens_come_from_flags_then_tokenizer_config_then_well_known_names(tmp_path, capsys):
    vocab = {"[UNK]": 0, "some": 1, "text": 2, "</s>": 3, "<s>": 4, "<|im_end|>": 5, "[END]": 6}
    tokenizer = write_tokenizer(tmp_path / "tokenizer.json", vocab)
    (tmp_path / "in.txt").write_text("some text")

    def special_ids(*flags) -> tuple[int | None, int]:
        out = tmp_path / f"ds{len(list(tmp_path.glob('ds*')))}"
        assert data(capsys, tokenizer, out, tmp_path / "in.txt", *flags)[0] == 0
        entry = read_manifest(out)["tokenizer"]
        return entry["bos_id"], entry["eos_id"]

    assert special_ids() == (4, 3)
    assert special_ids("--eos", "[END]", "--bos", "<|im_end|>") == (5, 6)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(
        json.dumps({"bos_token": None, "eos_token": {"content": "<|im_end|>", "lstrip": False}})
    )
    assert special_ids() == (None, 5)
    config.write_text(json.dumps({"eos_token": "<eot>"}))
    assert error_of(
        capsys, "data", tmp_path / "in.txt", "--tokenizer", tokenizer, "--out", tmp_path / "x"
    ) == (f'{tokenizer}: no token "<eot>" in the vocabulary (named by eos_token of tokenizer_config.json)')
    config.write_text("{\n  oops")
    assert error_of(
        capsys, "data", tmp_path / "in.txt", "--tokenizer", tokenizer, "--out", tmp_path / "x"
    ).startswith(f"{config}:2: not valid JSON")


def test_an_existing_output_is_refused_without_force(tmp_path, capsys, tokenizer_file):
    (tmp_path / "in.txt").write_text("first")
    assert data(capsys, tokenizer_file, tmp_path / "ds", tmp_path / "in.txt")[0] == 0
    (tmp_path / "in.txt").write_text("second")
    again = ["data", tmp_path / "in.txt", "--tokenizer", tokenizer_file, "--out", tmp_path / "ds"]
    assert error_of(capsys, *again) == f"{tmp_path / 'ds'}: already exists (pass --force to replace it)"
    assert decoded_documents(tmp_path / "ds", tokenizer_file) == ["first"]
    assert data(capsys, tokenizer_file, tmp_path / "ds", tmp_path / "in.txt", "--force")[0] == 0
    assert decoded_documents(tmp_path / "ds", tokenizer_file) == ["second"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "in.txt"]


def test_an_out_whose_folder_cannot_be_made_is_one_line(tmp_path, capsys, tokenizer_file):
    """Root passes every check made before the work, yet no folder can be made under /proc: `axgen data`, and
    `convert-hf` and `export-hf` through the same staging_dir, say so in one line."""
    (tmp_path / "in.txt").write_text("some text")
    out = Path("/proc/axgen-test/ds")
    message = error_of(capsys, "data", tmp_path / "in.txt", "--tokenizer", tokenizer_file, "--out", out)
    assert message.startswith(f"{out}: cannot ")
    with pytest.raises(OutputError, match=f"^{out}: cannot create /proc/axgen-test "):
        staging_dir(out)
    assert not out.parent.exists()


def test_an_interrupted_run_publishes_nothing(tmp_path, capsys, monkeypatch, tokenizer_file):
    (tmp_path / "in.txt").write_text("\n".join(TEXTS * 20))
    real_save = np.save

    def interrupted_save(path, array):
        if "train-00002" in str(path):
            raise KeyboardInterrupt
        real_save(path, array)

    monkeypatch.setattr(axgen.data.datasets.np, "save", interrupted_save)
    code, _, err = data(
        capsys, tokenizer_file, tmp_path / "ds", tmp_path / "in.txt", "--doc-per-line", "--shard-tokens", 100
    )
    assert (code, err) == (130, "axgen: interrupted\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_a_stop_whose_interrupt_python_dropped_still_publishes_nothing(
    tmp_path, capsys, monkeypatch, tokenizer_file
):
    """A KeyboardInterrupt raised while a garbage-collection callback runs (jax registers one) is dropped: CI once
    saw `axgen data` publish and exit 0 after its SIGTERM so. Nor does Python's hook print it as a traceback
    ("Exception ignored in ...", which a SIGTERM test of `axgen data chat` once read on its stderr)."""
    import gc
    import signal

    (tmp_path / "in.txt").write_text("\n".join(TEXTS * 20))
    real_save = np.save

    def signal_inside_a_gc_callback(phase, info):
        if phase == "start":
            signal.raise_signal(signal.SIGTERM)

    def save_stopped_in_gc(path, array):
        if "train-00002" in str(path):
            gc.callbacks.append(signal_inside_a_gc_callback)
            try:
                gc.collect()  # the handler's KeyboardInterrupt is dropped here, and the write goes on
            finally:
                gc.callbacks.remove(signal_inside_a_gc_callback)
        real_save(path, array)

    monkeypatch.setattr(axgen.data.datasets.np, "save", save_stopped_in_gc)
    printed = []  # what reaches the process's hook for exceptions Python drops
    monkeypatch.setattr(sys, "unraisablehook", printed.append)
    code, _, err = data(
        capsys, tokenizer_file, tmp_path / "ds", tmp_path / "in.txt", "--doc-per-line", "--shard-tokens", 100
    )
    assert (code, err, printed) == (130, "axgen: interrupted\n", [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


# --- axgen corpus -------------------------------------------------------------------------------------------


def test_corpus_writes_one_text_document_per_module(tmp_path, capsys):
    code, out, _ = run(capsys, "corpus", tmp_path / "corpus")
    files = sorted((tmp_path / "corpus").iterdir())
    assert code == 0 and out.startswith(f"wrote {len(MODULES)} documents (") and len(MODULES) >= 50
    assert [p.name for p in files] == sorted(f"{name}.txt" for name in MODULES)
    assert "class ArgumentParser" in (tmp_path / "corpus" / "argparse.txt").read_text()
    assert sum(p.stat().st_size for p in files) < 5_000_000
    assert write_corpus(tmp_path / "again") == [tmp_path / "again" / f"{name}.txt" for name in MODULES]


@pytest.mark.parametrize("quiet", [False, True])
def test_axgen_data_shows_its_progress_on_a_terminal_unless_quiet(
    tmp_path, tokenizer_file, capsys, monkeypatch, quiet
):
    import axgen.progress

    monkeypatch.setattr(axgen.progress.sys.stderr, "isatty", lambda: True, raising=False)
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"{i}.txt").write_text(f"document {i} " * 50)
    argv = ["data", str(texts), "--tokenizer", str(tokenizer_file), "--out", str(tmp_path / "out")]
    assert main(argv + (["--quiet"] if quiet else [])) == 0
    err = capsys.readouterr().err
    assert ("reading" in err) != quiet, err
