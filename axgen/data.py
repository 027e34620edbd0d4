"""Token datasets: text, JSON Lines and Parquet inputs read as documents, and the sharded on-disk format the
emitted training programs read (`axgen data`).

A dataset is a directory of `manifest.json` and, per split ("train", "eval"), shards
`<split>-NNNNN.tokens.npy` (every document's tokens back to back, each framed as `[bos] + tokens + [eos]`)
with `<split>-NNNNN.docs.npy` (the exclusive end offset of each document). It is written into a temporary
sibling directory and renamed into place at the end, so a directory at the output path is always complete.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from axgen.files import check_replaceable, staging_dir

if TYPE_CHECKING:
    from axgen.tokenizer import LoadedTokenizer

FORMAT = "axgen-dataset/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "eval")
INPUT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
SKIPPED_EXAMPLES = 10
# The largest vocabulary whose ids fit uint16; larger ones are stored as uint32.
UINT16_VOCAB = 65536
PARQUET_BATCH_ROWS = 1024
JSON_IS_JSON_LINES = " (a .json input is read as JSON Lines: one object per line)"


class DataError(ValueError):
    """Bad input data, tokenizer or dataset; the message is one line naming the file (and line)."""


@dataclass(frozen=True)
class ReadOptions:
    """How input files become documents (the input flags of `axgen data` and `axgen tokenizer train`)."""

    field: str = "text"
    column: str = "text"
    doc_per_line: bool = False
    skip_bad: bool = False


@dataclass
class Skipped:
    """Bad records: an error, or with `skip_bad` counted, keeping the first few reasons for the manifest."""

    skip_bad: bool
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def bad(self, where: str, why: str) -> None:
        if not self.skip_bad:
            raise DataError(f"{where}: {why}")
        self.count += 1
        if len(self.examples) < SKIPPED_EXAMPLES:
            self.examples.append(f"{where}: {why}")

    def __iter__(self) -> Iterator:
        """Unpacks as (count, examples), the form `write_dataset` takes."""
        return iter((self.count, self.examples))


# --- inputs -------------------------------------------------------------------------------------------------


def expand_inputs(patterns: Iterable[str]) -> list[Path]:
    """Files, globs (expanded here, so quoted ones work) and directories (searched recursively for input
    files), as one sorted list: the order documents are read in, which the seeded eval split depends on."""
    files = set()
    for pattern in patterns:
        # A path that exists is taken as it is, even when its name holds glob characters such as [ ].
        matches = [pattern] if os.path.lexists(pattern) else sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise DataError(f"{pattern}: no input files matched")
        for match in map(Path, matches):
            files.update(_input_files(match) if match.is_dir() else [_input_file(match)])
    return sorted(files)


def _input_files(directory: Path) -> list[Path]:
    found = [p for p in directory.rglob("*") if p.suffix.lower() in INPUT_SUFFIXES and p.is_file()]
    if not found:
        raise DataError(f"{directory}: no {_suffix_list()} files in this directory")
    return found


def _input_file(path: Path) -> Path:
    if path.suffix.lower() not in INPUT_SUFFIXES:
        raise DataError(f"{path}: not an input file type (expected {_suffix_list()})")
    return path


def _suffix_list() -> str:
    return ", ".join(INPUT_SUFFIXES[:-1]) + " or " + INPUT_SUFFIXES[-1]


def read_texts(files: Iterable[Path], options: ReadOptions, skipped: Skipped) -> Iterator[str]:
    """The non-empty documents of the files, in order."""
    readers = {".txt": _plain_text, ".jsonl": _json_lines, ".json": _json_lines, ".parquet": _parquet}
    for path in files:
        for text in readers[path.suffix.lower()](path, options, skipped):
            if text:
                yield text


def _plain_text(path: Path, options: ReadOptions, skipped: Skipped) -> Iterator[str]:
    if options.doc_per_line:
        with _open(path) as lines:
            for number, line in enumerate(lines, 1):
                text = _decoded(line, f"{path}:{number}", skipped)
                if text is not None and text.strip():
                    yield text.rstrip("\r\n")
        return
    with _open(path) as file:
        data = file.read()
    try:
        text = data.decode()
    except UnicodeDecodeError as err:
        skipped.bad(f"{path}:{data.count(b'\n', 0, err.start) + 1}", _not_utf8(err))
        return
    yield text


def _json_lines(path: Path, options: ReadOptions, skipped: Skipped) -> Iterator[str]:
    with _open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except UnicodeDecodeError as err:
                skipped.bad(where, _not_utf8(err))
                continue
            except json.JSONDecodeError as err:
                hint = JSON_IS_JSON_LINES if path.suffix.lower() == ".json" else ""
                skipped.bad(where, f"not valid JSON: {err.msg}: column {err.colno}{hint}")
                continue
            text = record.get(options.field) if isinstance(record, dict) else None
            if isinstance(text, str):
                yield text
            else:
                skipped.bad(where, _no_string_field(record, options.field))


def _no_string_field(record: object, name: str) -> str:
    if not isinstance(record, dict):
        return f'a JSON {_json_type(record)}, not an object with a string field "{name}"'
    if name in record:
        return f'field "{name}" is a JSON {_json_type(record[name])}, not a string; pass --field'
    return f'no string field "{name}" (keys: {", ".join(record) or "none"}); pass --field'


def _json_type(value: object) -> str:
    types = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", dict: "object"}
    return types.get(type(value), "null")


def _parquet(path: Path, options: ReadOptions, skipped: Skipped) -> Iterator[str]:
    """Reads the text column batch by batch, so a file larger than memory streams through."""
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable Parquet file: {_first_line(err)}") from None
    schema = file.schema_arrow
    if options.column not in schema.names:
        raise DataError(
            f'{path}: no column "{options.column}" (columns: {", ".join(schema.names)}); pass --column'
        )
    kind = schema.field(options.column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f'{path}: column "{options.column}" holds {kind}, not strings; pass --column')
    row = 0
    try:
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[options.column]):
            for text in batch.column(0).to_pylist():
                if text is None:
                    skipped.bad(f"{path}: row {row}", f'"{options.column}" is null')
                else:
                    yield text
                row += 1
    except pa.ArrowException as err:
        raise DataError(f"{path}: unreadable after row {row}: {_first_line(err)}") from None


def _open(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err.strerror}") from None


def _decoded(line: bytes, where: str, skipped: Skipped) -> str | None:
    try:
        return line.decode()
    except UnicodeDecodeError as err:
        skipped.bad(where, _not_utf8(err))
        return None


def _not_utf8(err: UnicodeDecodeError) -> str:
    return f"not valid UTF-8 (byte 0x{err.object[err.start]:02x} at offset {err.start})"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


# --- tokenizing inputs into a dataset -----------------------------------------------------------------------


def build_dataset(
    inputs: Iterable[str],
    tokenizer: LoadedTokenizer,
    out_dir: Path,
    options: ReadOptions = ReadOptions(),
    *,
    eval_fraction: float = 0.01,
    seed: int = 0,
    shard_tokens: int = 50_000_000,
    overwrite: bool = False,
) -> dict:
    """`axgen data`: reads the inputs, encodes them with the tokenizer and writes the dataset; returns its
    manifest."""
    files = expand_inputs(inputs)
    skipped = Skipped(options.skip_bad)
    return write_dataset(
        out_dir,
        tokenizer.encode(read_texts(files, options, skipped)),
        vocab_size=tokenizer.vocab_size,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        tokenizer=tokenizer.manifest_entry(),
        eval_fraction=eval_fraction,
        seed=seed,
        shard_tokens=shard_tokens,
        sources=[str(path) for path in files],
        skipped=skipped,
        overwrite=overwrite,
    )


def summary(manifest: dict, seconds: float) -> str:
    """One line: documents and tokens per split, shards, skipped records and throughput."""
    splits = manifest["splits"]
    parts = [
        f"{name} {split['num_documents']:,} documents / {split['num_tokens']:,} tokens "
        f"in {len(split['shards'])} shard{'' if len(split['shards']) == 1 else 's'}"
        for name, split in splits.items()
    ]
    tokens = sum(split["num_tokens"] for split in splits.values())
    return f"{', '.join(parts)}; {manifest['skipped']['count']} skipped; {tokens / seconds:,.0f} tokens/s"


# --- the dataset format -------------------------------------------------------------------------------------


def write_dataset(
    out_dir: Path,
    documents: Iterable[np.ndarray],
    *,
    vocab_size: int,
    bos_id: int | None,
    eos_id: int,
    tokenizer: dict | None = None,
    eval_fraction: float = 0.01,
    seed: int = 0,
    shard_tokens: int = 50_000_000,
    sources: list[str] = (),
    skipped=(0, []),
    overwrite: bool = False,
) -> dict:
    """Writes `documents` (1-D integer arrays of token ids, without bos/eos) as a dataset; returns the
    manifest.

    Each document goes to eval with probability `eval_fraction`, drawn in order from
    `np.random.default_rng(seed)`. `skipped` is (count, examples), read once `documents` is exhausted, so a
    reader may still be counting while it is consumed. An existing `out_dir` is replaced only with
    `overwrite`, and only when it is a dataset (or empty)."""
    out_dir = Path(out_dir)
    _check_settings(vocab_size, bos_id, eos_id, eval_fraction, shard_tokens)
    check_replaceable(out_dir, overwrite, MANIFEST)
    staging = staging_dir(out_dir)
    try:
        token_dtype = np.uint16 if vocab_size <= UINT16_VOCAB else np.uint32
        splits = {
            name: _SplitWriter(staging, name, token_dtype, vocab_size, bos_id, eos_id, shard_tokens)
            for name in SPLITS
        }
        _distribute(documents, splits, eval_fraction, seed)
        skipped_count, skipped_examples = skipped
        _check_split_sizes(splits, list(sources), skipped_count)
        manifest = {
            "format": FORMAT,
            "tokenizer": tokenizer
            or {"path": None, "sha256": None, "vocab_size": vocab_size, "bos_id": bos_id, "eos_id": eos_id},
            "token_dtype": np.dtype(token_dtype).name,
            "max_token_id": max(s.max_token_id for s in splits.values()),
            "seed": seed,
            "eval_fraction": eval_fraction,
            "sources": sorted(sources),
            "skipped": {"count": skipped_count, "examples": list(skipped_examples)[:SKIPPED_EXAMPLES]},
            "splits": {name: writer.manifest() for name, writer in splits.items()},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _publish(staging, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _check_settings(
    vocab_size: int, bos_id: int | None, eos_id: int, eval_fraction: float, shard_tokens: int
) -> None:
    if vocab_size < 1:
        raise DataError(f"vocab_size {vocab_size}: must be positive")
    for name, token_id in (("bos_id", bos_id), ("eos_id", eos_id)):
        if token_id is not None and not 0 <= token_id < vocab_size:
            raise DataError(f"{name} {token_id}: outside the vocabulary of {vocab_size}")
    if not 0 <= eval_fraction < 1:
        raise DataError(f"eval_fraction {eval_fraction}: must be at least 0 and below 1")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens {shard_tokens}: must be positive")


def _distribute(documents: Iterable[np.ndarray], splits: dict, eval_fraction: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for index, document in enumerate(documents):
        document = np.asarray(document)
        if document.ndim != 1 or document.dtype.kind not in "iu":
            shape = "x".join(map(str, document.shape)) or "scalar"
            raise DataError(f"document {index}: expected a 1-D integer array, not {document.dtype} {shape}")
        splits["eval" if rng.random() < eval_fraction else "train"].add(document)
    for writer in splits.values():
        writer.close()


def _check_split_sizes(splits: dict, sources: list[str], skipped_count: int) -> None:
    total = sum(writer.num_documents for writer in splits.values())
    if total == 0:
        raise no_documents(sources, skipped_count)
    if splits["train"].num_documents == 0:
        raise DataError(f"all {total} documents went to the eval split; lower the eval fraction or add data")


def no_documents(sources: list[str], skipped_count: int) -> DataError:
    """The error for inputs that hold no text, naming the first input file."""
    where = sources[0] if sources else "the inputs"
    if len(sources) > 1:
        where += f" and {len(sources) - 1} more files"
    also = f" ({skipped_count} bad records skipped)" if skipped_count else ""
    return DataError(f"no documents in {where}{also}")


def _publish(staging: Path, out_dir: Path, overwrite: bool) -> None:
    """Renames the finished directory into place; a dataset it replaces is moved aside first and removed
    after, so the path never holds a partial one."""
    if overwrite and out_dir.exists():
        old = staging.with_name(staging.name + ".old")
        out_dir.rename(old)
        staging.rename(out_dir)
        shutil.rmtree(old)
    else:
        try:
            staging.rename(out_dir)
        except OSError as err:
            raise DataError(f"{out_dir}: cannot create: {err.strerror}") from None


class _SplitWriter:
    """One split's shards: documents gather until they hold `shard_tokens` tokens, then become a shard."""

    def __init__(
        self,
        directory: Path,
        split: str,
        token_dtype: type[np.unsignedinteger],
        vocab_size: int,
        bos_id: int | None,
        eos_id: int,
        shard_tokens: int,
    ):
        self.directory, self.split, self.token_dtype = directory, split, token_dtype
        self.vocab_size, self.shard_tokens = vocab_size, shard_tokens
        # In the token dtype, so framing never widens the documents' own dtype when they are concatenated.
        self.bos = [] if bos_id is None else [np.array([bos_id], dtype=token_dtype)]
        self.eos = np.array([eos_id], dtype=token_dtype)
        self.framing = len(self.bos) + 1
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.shards: list[dict] = []

    def add(self, document: np.ndarray) -> None:
        self.pending.append(document)
        self.pending_tokens += len(document) + self.framing
        if self.pending_tokens >= self.shard_tokens:
            self._save_shard()

    def close(self) -> None:
        if self.pending:
            self._save_shard()

    @property
    def num_documents(self) -> int:
        return sum(shard["num_documents"] for shard in self.shards)

    @property
    def max_token_id(self) -> int:
        return max((shard["max_token_id"] for shard in self.shards), default=0)

    def manifest(self) -> dict:
        return {
            "num_documents": self.num_documents,
            "num_tokens": sum(shard["num_tokens"] for shard in self.shards),
            "shards": self.shards,
        }

    def _save_shard(self) -> None:
        tokens = np.concatenate([part for doc in self.pending for part in (*self.bos, doc, self.eos)])
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise DataError(
                f"token id {bad} in the {self.split} split is outside the vocabulary of {self.vocab_size}"
            )
        ends = np.cumsum([len(doc) + self.framing for doc in self.pending], dtype=np.int64)
        stem = f"{self.split}-{len(self.shards):05d}"
        np.save(self.directory / f"{stem}.tokens.npy", tokens.astype(self.token_dtype, copy=False))
        np.save(self.directory / f"{stem}.docs.npy", ends)
        self.shards.append(
            {
                "tokens": f"{stem}.tokens.npy",
                "docs": f"{stem}.docs.npy",
                "num_documents": len(self.pending),
                "num_tokens": len(tokens),
                "max_token_id": high,
            }
        )
        self.pending, self.pending_tokens = [], 0


def read_manifest(dir: Path) -> dict:
    """The manifest of a dataset directory, checked to be one this format describes."""
    directory = Path(dir)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise DataError(f"{directory}: no such dataset directory")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: missing; not a dataset (write one with `axgen data`)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read: {_first_line(err)}") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != FORMAT:
        raise DataError(f'{path}: format {json.dumps(found)}, expected "{FORMAT}"')
    return manifest
