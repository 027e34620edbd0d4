"""Token datasets: the documents of `axgen data`'s inputs (read by `axgen.data.inputs`) encoded by a tokenizer, and
written in the format the emitted programs read (`axgen.runtime.dataset` defines it: the manifest, the shards'
names and contents, and the reader). A dataset is written into a temporary sibling directory and renamed into
place at the end, so a directory at the output path is always complete.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from axgen.data.chat import ChatTemplate, ConversationCounts, encode_conversations
from axgen import progress
from axgen.files import check_not_stopped, check_replaceable, staging_dir
from axgen.data.inputs import (
    SKIPPED_EXAMPLES,
    DataError,
    ReadOptions,
    Skipped,
    expand_inputs,
    no_documents,
    read_conversations,
    read_records,
    read_texts,
)
from axgen.data.pairs import PairCounts, encode_pairs
from axgen.runtime import dataset
from axgen.runtime.dataset import FORMAT, MANIFEST, MASKED_FORMAT, PAIRS_FORMAT
from axgen.data.tokenizer import LoadedTokenizer

SPLITS = ("train", "eval")
# The largest vocabulary whose ids fit uint16; larger ones are stored as uint32.
UINT16_VOCAB = 65536


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
    paths, shown = progress.reading(files)
    with shown:
        documents = progress.counted(tokenizer.encode(read_texts(paths, options, skipped)), shown)
        settings = dict(
            eval_fraction=eval_fraction, seed=seed, shard_tokens=shard_tokens, overwrite=overwrite
        )
        return _write_encoded(out_dir, documents, tokenizer, files, skipped, **settings)


def _write_encoded(
    out_dir: Path, documents, tokenizer: LoadedTokenizer, files, skipped: Skipped, **settings
) -> dict:
    """write_dataset of documents `tokenizer` encoded from `files`, which the manifest names."""
    return write_dataset(
        out_dir,
        documents,
        vocab_size=tokenizer.vocab_size,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        tokenizer=tokenizer.manifest_entry(),
        sources=[str(path) for path in files],
        skipped=skipped,
        **settings,
    )


def build_chat_dataset(
    inputs: Iterable[str],
    tokenizer: LoadedTokenizer,
    template: ChatTemplate,
    out_dir: Path,
    options: ReadOptions,
    *,
    sharegpt: bool = False,
    max_len: int | None = None,
    **settings,
) -> dict:
    """`axgen data --chat`: reads conversations (`options.field` of JSON Lines records, `options.column` of
    Parquet rows), renders each with `template`, and writes the token ids with their loss masks as a masked
    dataset; returns its manifest. Conversations longer than `max_len` tokens are cut after their last
    assistant turn that ends within it, or dropped where none does (`axgen.data.chat.cut_to`). `settings` are
    write_dataset's (eval_fraction, seed, shard_tokens, overwrite)."""
    files = expand_inputs(inputs)
    skipped = Skipped(options.skip_bad)
    counts = ConversationCounts(max_len=max_len)
    paths, shown = progress.reading(files)
    conversations = read_conversations(paths, options.field, options.column, skipped)
    documents = encode_conversations(
        conversations, template, tokenizer, sharegpt=sharegpt, skipped=skipped, counts=counts
    )
    manifest = _ChatManifest(template, "sharegpt" if sharegpt else "messages", counts)
    with shown:
        counted = progress.counted(documents, shown)
        return _write_encoded(out_dir, counted, tokenizer, files, skipped, conversations=manifest, **settings)


def build_pairs_dataset(
    inputs: Iterable[str],
    tokenizer: LoadedTokenizer,
    template: ChatTemplate | DataError,
    out_dir: Path,
    options: ReadOptions,
    *,
    max_len: int | None = None,
    **settings,
) -> dict:
    """`axgen data --pairs`: reads preference records (JSON Lines records, Parquet rows) with prompt, chosen and
    rejected as text or as messages, tokenizes them as TRL's DPOTrainer does (`axgen.data.pairs`) and writes a
    dataset of pairs (format 3); returns its manifest. `template` is the chat template, or why the tokenizer has
    none (an error only for a conversational record). A pair whose two sequences exceed `max_len` tokens together
    is left out and counted. `settings` are write_dataset's."""
    files = expand_inputs(inputs)
    skipped = Skipped(options.skip_bad)
    counts = PairCounts(max_len=max_len, template=None if isinstance(template, DataError) else template)
    paths, shown = progress.reading(files)
    pairs = encode_pairs(read_records(paths, skipped), template, tokenizer, skipped=skipped, counts=counts)
    with shown:
        counted = progress.counted(pairs, shown)
        return _write_encoded(
            out_dir, counted, tokenizer, files, skipped, conversations=counts, pairs=True, **settings
        )


class _ChatManifest:
    """The manifest's "conversations" entry, read once every conversation has been counted."""

    def __init__(self, template: ChatTemplate, form: str, counts: ConversationCounts):
        self.template, self.form, self.counts = template, form, counts

    def manifest_entry(self) -> dict:
        return {
            "form": self.form,
            "chat_template": self.template.manifest_entry(),
            **self.counts.manifest_entry(),
        }


def summary(manifest: dict, seconds: float) -> str:
    """One line: documents (conversations) and tokens per split, shards, what was trained, cut and skipped, and
    throughput."""
    splits = manifest["splits"]
    chat, pairs = manifest.get("conversations"), manifest.get("pairs")
    parts = []
    for name, split in splits.items():
        shards = len(split["shards"])
        trained = f" ({split['num_trained_tokens']:,} trained)" if chat or pairs else ""
        count = f"{split['num_documents'] // 2:,} pairs" if pairs else f"{split['num_documents']:,} documents"
        count = f"{split['num_documents']:,} conversations" if chat else count
        parts.append(
            f"{name} {count} / {split['num_tokens']:,} tokens{trained} in {shards} shard{'' if shards == 1 else 's'}"
        )
    tokens = sum(split["num_tokens"] for split in splits.values())
    cut = f"; {chat['truncated']} cut and {chat['dropped_too_long']} dropped by --max-len" if chat else ""
    cut = f"; {pairs['dropped_too_long']} dropped by --max-len" if pairs else cut
    return (
        f"{', '.join(parts)}{cut}; {manifest['skipped']['count']} skipped; {tokens / seconds:,.0f} tokens/s"
    )


# --- the dataset format -------------------------------------------------------------------------------------


class ManifestEntry(Protocol):
    """What a masked dataset's manifest says of its conversations or pairs, known once its documents are read."""

    def manifest_entry(self) -> dict: ...


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
    conversations: dict | ManifestEntry | None = None,
    pairs: bool = False,
) -> dict:
    """Writes `documents` (1-D integer arrays of token ids, without bos/eos) as a dataset; returns the
    manifest.

    Each document goes to eval with probability `eval_fraction`, drawn in order from
    `np.random.default_rng(seed)`. `skipped` is (count, examples), read once `documents` is exhausted, so a
    reader may still be counting while it is consumed. An existing `out_dir` is replaced only with
    `overwrite`, and only when it is a dataset (or empty).

    With `conversations` (a dict for the manifest, or an object whose `manifest_entry()` gives one once
    `documents` is exhausted), the dataset is a masked one (format 2): each document is a pair (token ids, loss
    mask of 0s and 1s, as long), stored as it is, without bos/eos. With `pairs` too (format 3), each document is
    a preference pair of two such (chosen, then rejected), which go to the same split and shard."""
    out_dir = Path(out_dir)
    _check_settings(vocab_size, bos_id, eos_id, eval_fraction, shard_tokens)
    check_replaceable(out_dir, overwrite, MANIFEST)
    staging = staging_dir(out_dir)
    masked = conversations is not None
    try:
        token_dtype = np.uint16 if vocab_size <= UINT16_VOCAB else np.uint32
        splits = {
            name: _SplitWriter(staging, name, token_dtype, vocab_size, bos_id, eos_id, shard_tokens, masked)
            for name in SPLITS
        }
        _distribute(documents, splits, eval_fraction, seed, masked, pairs)
        skipped_count, skipped_examples = skipped
        _check_split_sizes(splits, list(sources), skipped_count)
        manifest = {
            "format": PAIRS_FORMAT if pairs else MASKED_FORMAT if masked else FORMAT,
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
        if masked:
            manifest["pairs" if pairs else "conversations"] = (
                conversations if isinstance(conversations, dict) else conversations.manifest_entry()
            )
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


def _distribute(
    documents: Iterable,
    splits: dict,
    eval_fraction: float,
    seed: int,
    masked: bool = False,
    pairs: bool = False,
) -> None:
    rng = np.random.default_rng(seed)
    for index, item in enumerate(documents):
        parts = [_checked(index, document, masked) for document in (item if pairs else [item])]
        splits["eval" if rng.random() < eval_fraction else "train"].add(parts)
    for writer in splits.values():
        writer.close()


def _checked(index: int, document, masked: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(token ids, loss mask or None) of document `index`, checked to be what the format stores."""
    mask = None
    if masked:
        document, mask = (np.asarray(part) for part in document)
    else:
        document = np.asarray(document)
    if document.ndim != 1 or document.dtype.kind not in "iu":
        shape = "x".join(map(str, document.shape)) or "scalar"
        raise DataError(f"document {index}: expected a 1-D integer array, not {document.dtype} {shape}")
    if mask is not None and (mask.shape != document.shape or not np.isin(mask, (0, 1)).all()):
        raise DataError(
            f"document {index}: its loss mask is not one 0 or 1 for each of its {len(document)} tokens"
        )
    return document, mask


def _check_split_sizes(splits: dict, sources: list[str], skipped_count: int) -> None:
    total = sum(writer.num_documents for writer in splits.values())
    if total == 0:
        raise no_documents(sources, skipped_count)
    if splits["train"].num_documents == 0:
        raise DataError(f"all {total} documents went to the eval split; lower the eval fraction or add data")


def _publish(staging: Path, out_dir: Path, overwrite: bool) -> None:
    """Renames the finished directory into place; a dataset it replaces is moved aside first and removed
    after, so the path never holds a partial one."""
    check_not_stopped()
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
    """One split's shards: documents gather until they hold `shard_tokens` tokens, then become a shard. A masked
    split's documents come with their loss masks and are stored unframed (their chat template frames them)."""

    def __init__(
        self,
        directory: Path,
        split: str,
        token_dtype: type[np.unsignedinteger],
        vocab_size: int,
        bos_id: int | None,
        eos_id: int,
        shard_tokens: int,
        masked: bool = False,
    ):
        self.directory, self.split, self.token_dtype = directory, split, token_dtype
        self.vocab_size, self.shard_tokens, self.masked = vocab_size, shard_tokens, masked
        # In the token dtype, so framing never widens the documents' own dtype when they are concatenated.
        self.bos = [] if bos_id is None or masked else [np.array([bos_id], dtype=token_dtype)]
        self.eos = [] if masked else [np.array([eos_id], dtype=token_dtype)]
        self.framing = len(self.bos) + len(self.eos)
        self.pending: list[np.ndarray] = []
        self.pending_masks: list[np.ndarray] = []
        self.pending_tokens = 0
        self.shards: list[dict] = []

    def add(self, documents: list[tuple[np.ndarray, np.ndarray | None]]) -> None:
        """(token ids, loss mask or None) of documents that stay in one shard (a preference pair's two)."""
        for document, mask in documents:
            self.pending.append(document)
            if self.masked:
                self.pending_masks.append(mask)
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
        manifest = {
            "num_documents": self.num_documents,
            "num_tokens": sum(shard["num_tokens"] for shard in self.shards),
            "shards": self.shards,
        }
        if self.masked:
            manifest["num_trained_tokens"] = sum(shard["num_trained_tokens"] for shard in self.shards)
        return manifest

    def _save_shard(self) -> None:
        tokens = np.concatenate([part for doc in self.pending for part in (*self.bos, doc, *self.eos)])
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise DataError(
                f"token id {bad} in the {self.split} split is outside the vocabulary of {self.vocab_size}"
            )
        ends = np.cumsum([len(doc) + self.framing for doc in self.pending], dtype=np.int64)
        files = dataset.shard_files(self.split, len(self.shards), self.masked)
        np.save(self.directory / files["tokens"], tokens.astype(self.token_dtype, copy=False))
        np.save(self.directory / files["docs"], ends)
        shard = {**files, "num_documents": len(self.pending), "num_tokens": len(tokens), "max_token_id": high}
        if self.masked:
            mask = np.concatenate(self.pending_masks).astype(np.uint8)
            np.save(self.directory / files["mask"], mask)
            shard["num_trained_tokens"] = int(mask.sum(dtype=np.int64))
        self.shards.append(shard)
        self.pending, self.pending_masks, self.pending_tokens = [], [], 0


def read_manifest(dir: Path) -> dict:
    """The manifest of a dataset directory, checked by the reader the programs use."""
    try:
        return dataset.read_manifest(Path(dir))
    except dataset.DatasetError as err:
        raise DataError(str(err)) from None
