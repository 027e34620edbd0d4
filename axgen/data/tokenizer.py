"""Hugging Face tokenizers for `axgen data`: loading a `tokenizer.json` with its BOS/EOS tokens, encoding
documents on every core, and fitting a byte-level BPE (`axgen tokenizer train`)."""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
from tokenizers import Encoding, Tokenizer, decoders, models, pre_tokenizers, trainers

from axgen import progress
from axgen.files import check_replaceable, write_atomically
from axgen.data.inputs import DataError, ReadOptions, Skipped, expand_inputs, no_documents, read_texts

CONFIG = "tokenizer_config.json"
# Tried in order when neither a flag nor tokenizer_config.json names the token.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")
# The special tokens of a tokenizer `axgen tokenizer train` fits, in id order.
TRAINED_EOS = "<|endoftext|>"
TRAINED_BOS = "<|begin_of_text|>"
BYTE_ALPHABET = 256
# tokenizers' BPE trainer allocates about 70 bytes per token asked for before it reads a text, and aborts the
# process (a Rust panic) when that fails: 10**9 did. 2**24 needs about 1.2 GB, and is 64 times the largest
# vocabularies in use.
MAX_TRAINED_VOCAB = 2**24
# Texts per encode call, by size: large enough to keep every core of tokenizers' thread pool busy, small
# enough that reading the next batch and writing the last one overlap with it.
BATCH_CHARS = 4_000_000
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class LoadedTokenizer:
    tokenizer: Tokenizer
    path: Path
    sha256: str
    bos_id: int | None
    eos_id: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def manifest_entry(self) -> dict:
        return {
            "path": str(self.path),
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }

    def encode(self, texts: Iterable[str]) -> Iterator[np.ndarray]:
        """The token ids of each text (without special tokens), in order, encoded by `pipelined`."""

        def encode(batch: list[str]) -> list[Encoding]:
            return self.tokenizer.encode_batch_fast(batch, add_special_tokens=False)

        for encodings in pipelined(_batches(texts), encode):
            yield from _ids(encodings)


def pipelined(batches: Iterable[T], work: Callable[[T], R]) -> Iterator[R]:
    """work(batch) of each batch, in order. A worker thread only works (tokenizers releases the GIL and spreads a
    batch over every core) while this one makes the next batch and hands the last one's result to the caller.
    """
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")
    try:
        pending: Future | None = None
        for batch in batches:
            next_pending = worker.submit(work, batch)
            if pending is not None:
                yield pending.result()
            pending = next_pending
        if pending is not None:
            yield pending.result()
    finally:
        # On an error or interrupt the queued batch is dropped; the one being worked on cannot be stopped.
        worker.shutdown(cancel_futures=True)


def _ids(encodings: list[Encoding]) -> Iterator[np.ndarray]:
    for encoding in encodings:
        yield np.array(encoding.ids, dtype=np.uint32)


def _batches(texts: Iterable[str]) -> Iterator[list[str]]:
    batch, chars = [], 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def load_tokenizer(path: Path, *, bos: str | None = None, eos: str | None = None) -> LoadedTokenizer:
    """A `tokenizer.json` and its BOS/EOS ids: the tokens named by `bos`/`eos`, else those of a
    `tokenizer_config.json` beside it, else the first well-known special token name in the vocabulary."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot read the tokenizer: {err.strerror}") from None
    try:
        tokenizer = Tokenizer.from_str(data.decode())
    # tokenizers raises a bare Exception for a file it cannot parse.
    except Exception as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"{path}: not a valid tokenizer.json: {message}") from None
    config = read_tokenizer_config(path.with_name(CONFIG))
    bos_id = _special_id(tokenizer, path, "bos", bos, config, BOS_NAMES)
    eos_id = _special_id(tokenizer, path, "eos", eos, config, EOS_NAMES)
    if eos_id is None:
        raise DataError(
            f"{path}: no EOS token (no eos_token in a {CONFIG} beside it, none of {', '.join(EOS_NAMES)} in "
            "the vocabulary); pass --eos TOKEN"
        )
    return LoadedTokenizer(tokenizer, path, hashlib.sha256(data).hexdigest(), bos_id, eos_id)


def read_tokenizer_config(path: Path) -> dict:
    """tokenizer_config.json, or {} where there is none."""
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read: {err}") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a JSON object")
    return config


def _special_id(
    tokenizer: Tokenizer, path: Path, role: str, flag: str | None, config: dict, well_known: tuple[str, ...]
) -> int | None:
    if flag is not None:
        return _token_id(tokenizer, path, flag, f"--{role}")
    key = f"{role}_token"
    if key in config:
        # A string, or an AddedToken written as a dict; null says the tokenizer has no such token.
        entry = config[key]
        token = entry.get("content") if isinstance(entry, dict) else entry
        if token is None:
            return None
        if not isinstance(token, str):
            raise DataError(f"{path.with_name(CONFIG)}: {key} is {json.dumps(entry)}, not a token")
        return _token_id(tokenizer, path, token, f"{key} of {CONFIG}")
    return next(
        (tokenizer.token_to_id(name) for name in well_known if tokenizer.token_to_id(name) is not None), None
    )


def _token_id(tokenizer: Tokenizer, path: Path, token: str, named_by: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise DataError(f"{path}: no token {json.dumps(token)} in the vocabulary (named by {named_by})")
    return token_id


def train_tokenizer(
    inputs: Iterable[str],
    vocab_size: int,
    out: Path,
    options: ReadOptions = ReadOptions(),
    overwrite: bool = False,
) -> tuple[Tokenizer, Skipped]:
    """Fits a byte-level BPE of `vocab_size` tokens (fewer, with a warning, if the inputs run out of merges)
    to the documents `axgen data` would read from `inputs`, and writes it to `out` with a tokenizer_config.json
    beside it naming its BOS and EOS tokens. Existing files there are replaced only with `overwrite`."""
    special = [TRAINED_EOS, TRAINED_BOS]
    if vocab_size <= BYTE_ALPHABET + len(special):
        raise DataError(
            f"--vocab-size {vocab_size}: must be more than {BYTE_ALPHABET + len(special)} "
            f"({BYTE_ALPHABET} bytes and {len(special)} special tokens)"
        )
    if vocab_size > MAX_TRAINED_VOCAB:
        raise DataError(f"--vocab-size {vocab_size}: must be at most {MAX_TRAINED_VOCAB} (2**24)")
    for path in (out, out.with_name(CONFIG)):
        check_replaceable(path, overwrite)
    files = expand_inputs(inputs)
    skipped = Skipped(options.skip_bad)
    texts = read_texts(files, options, skipped)
    first = next(texts, None)
    if first is None:
        raise no_documents([str(path) for path in files], skipped.count)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress.shown(),  # its own bars: documents read, words counted, merges made
    )
    tokenizer.train_from_iterator(itertools.chain([first], texts), trainer=trainer)
    write_atomically(out, tokenizer.to_str(pretty=True))
    config = {"bos_token": TRAINED_BOS, "eos_token": TRAINED_EOS}
    write_atomically(out.with_name(CONFIG), json.dumps(config, indent=2) + "\n")
    if tokenizer.get_vocab_size() < vocab_size:
        # A warning, not an error: this is every merge the inputs hold, a usable tokenizer; only more text
        # gives more, and how many the inputs hold is known only now.
        print(
            f"axgen: warning: {out}: {tokenizer.get_vocab_size()} tokens, fewer than --vocab-size "
            f"{vocab_size}: the inputs ran out of pairs to merge",
            file=sys.stderr,
        )
    return tokenizer, skipped
