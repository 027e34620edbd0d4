"""Input files as documents, for `axgen data` and `axgen tokenizer train`: files, globs and directories; plain text
(a document per file, or per line), JSON Lines and Parquet records; bad records as one-line errors, or counted and
skipped with `--skip-bad`.

Its own module so that imports run one way: the tokenizer (`axgen tokenizer train`) reads inputs without importing
the dataset writer, which imports both.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

INPUT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
SKIPPED_EXAMPLES = 10
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
    """The documents of the files that hold more than whitespace, in order: one of only whitespace would be a
    document of a few tokens that says nothing."""
    readers = {".txt": _plain_text, ".jsonl": _json_lines, ".json": _json_lines, ".parquet": _parquet}
    for path in files:
        for text in readers[path.suffix.lower()](path, options, skipped):
            if text and not text.isspace():
                yield text


def _plain_text(path: Path, options: ReadOptions, skipped: Skipped) -> Iterator[str]:
    if options.doc_per_line:
        with _open(path) as lines:
            for number, line in enumerate(lines, 1):
                text = _decoded(line, f"{path}:{number}", skipped)
                if text is not None:
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
    for where, record in _json_records(path, skipped):
        text = record.get(options.field) if isinstance(record, dict) else None
        if isinstance(text, str):
            yield text
        else:
            skipped.bad(where, _no_string_field(record, options.field))


def _json_records(path: Path, skipped: Skipped) -> Iterator[tuple[str, object]]:
    """(file:line, value) of each non-blank line of a JSON Lines file that parses."""
    with _open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(line)
            except UnicodeDecodeError as err:
                skipped.bad(where, _not_utf8(err))
            except json.JSONDecodeError as err:
                hint = JSON_IS_JSON_LINES if path.suffix.lower() == ".json" else ""
                skipped.bad(where, f"not valid JSON: {err.msg}: column {err.colno}{hint}")


# What a record may carry for its chat template besides the conversation, by the names TRL's datasets use:
# `tools` and `documents` reach the template as apply_chat_template's arguments of those names, and the entries of
# `chat_template_kwargs` as its other keyword arguments (Qwen3's enable_thinking, say).
TEMPLATE_VARIABLES = ("tools", "documents", "chat_template_kwargs")


def read_conversations(
    files: Iterable[Path], field: str, column: str, skipped: Skipped
) -> Iterator[tuple[str, object, dict]]:
    """(where, value, template variables) of each record: a JSON Lines record's `field`, a Parquet row's `column`
    (as Python lists and dicts), and those of TEMPLATE_VARIABLES the record holds (not null); whether they are
    what they should be is the caller's to check. Plain text holds no records, so a .txt input is refused."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix == ".txt":
            raise DataError(f"{path}: plain text holds no conversations (pass JSON Lines or Parquet records)")
        if suffix == ".parquet":
            yield from _parquet_lists(path, column, skipped)
            continue
        for where, record in _json_records(path, skipped):
            if isinstance(record, dict) and field in record:
                variables = {k: record[k] for k in TEMPLATE_VARIABLES if record.get(k) is not None}
                yield where, record[field], variables
            elif isinstance(record, dict):
                skipped.bad(where, f'no field "{field}" (keys: {", ".join(record) or "none"}); pass --field')
            else:
                skipped.bad(where, f'a JSON {_json_type(record)}, not an object with a field "{field}"')


def read_records(files: Iterable[Path], skipped: Skipped) -> Iterator[tuple[str, object]]:
    """(where, record) of each JSON Lines record and each Parquet row (a dict of its columns, as Python values);
    whether a record holds what it should is the caller's to check. Plain text holds no records."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix == ".txt":
            raise DataError(f"{path}: plain text holds no records (pass JSON Lines or Parquet records)")
        if suffix != ".parquet":
            yield from _json_records(path, skipped)
            continue
        file, row = _parquet_file(path), 0
        try:
            for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                for record in batch.to_pylist():
                    yield f"{path}: row {row}", record
                    row += 1
        except pa.ArrowException as err:
            raise DataError(f"{path}: unreadable after row {row}: {first_line(err)}") from None


def _parquet_lists(path: Path, column: str, skipped: Skipped) -> Iterator[tuple[str, object, dict]]:
    """A list column, row by row, batch by batch, with the row's template variables."""
    file = _parquet_file(path)
    schema = file.schema_arrow
    if column not in schema.names:
        raise DataError(f'{path}: no column "{column}" (columns: {", ".join(schema.names)}); pass --column')
    kind = schema.field(column).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        raise DataError(f'{path}: column "{column}" holds {kind}, not lists of messages; pass --column')
    extra = [name for name in TEMPLATE_VARIABLES if name in schema.names and name != column]
    row = 0
    try:
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[column, *extra]):
            rows = zip(*(batch.column(i).to_pylist() for i in range(1 + len(extra))))
            for value, *others in rows:
                if value is None:
                    skipped.bad(f"{path}: row {row}", f'"{column}" is null')
                else:
                    variables = {k: v for k, v in zip(extra, others) if v is not None}
                    yield f"{path}: row {row}", value, variables
                row += 1
    except pa.ArrowException as err:
        raise DataError(f"{path}: unreadable after row {row}: {first_line(err)}") from None


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
    file = _parquet_file(path)
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
        raise DataError(f"{path}: unreadable after row {row}: {first_line(err)}") from None


def _parquet_file(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable Parquet file: {first_line(err)}") from None


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


def first_line(err: BaseException) -> str:
    """The first line of an error's message, or its type where it has none: what a one-line error quotes."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def no_documents(sources: list[str], skipped_count: int) -> DataError:
    """The error for inputs that hold no text, naming the first input file."""
    where = sources[0] if sources else "the inputs"
    if len(sources) > 1:
        where += f" and {len(sources) - 1} more files"
    also = f" ({skipped_count} bad records skipped)" if skipped_count else ""
    return DataError(f"no documents in {where}{also}")
