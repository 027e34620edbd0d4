"""The dataset format `axgen data` writes and every program reads, in one place.

A dataset is a directory of `manifest.json` and, per split ("train", "eval"), shards `<split>-NNNNN.tokens.npy`
(every document's tokens back to back, each framed as `[bos] + tokens + [eos]`) with `<split>-NNNNN.docs.npy`
(the exclusive end offset of each document). Programs cut each shard into windows of seq_len + 1 tokens and
number the documents in each window (segment ids), so attention and the loss never cross a document.

Format 2 (`axgen data --chat`) adds a loss mask: beside each shard, `<split>-NNNNN.mask.npy`, uint8, one value per
token, 1 where the token is a target the loss trains on (the assistant's tokens and the end of each of its turns)
and 0 where it is not (system, user and tool turns, the chat template's own text). Its documents are
conversations stored exactly as their chat template renders them, with no framing added (the template writes
the BOS and end-of-turn tokens its model expects). A format-1 dataset reads as all ones.

Format 3 (`axgen data --pairs`) is format 2 holding preference pairs: documents 2i and 2i + 1 are pair i's
prompt with its chosen completion and the same prompt with its rejected one, their masks 1 on the completions.
A program trains each pair in one window of its own (segment 1 chosen, segment 2 rejected, the rest padding), so
a pair's two sequences are always in the same pass of the same step.
"""

import collections
import concurrent.futures
import json
import math
import os

import jax
import numpy as np

FORMAT = "axgen-dataset/1"
# A version that format-1 readers refuse, so an older runtime never trains a masked dataset on every token.
MASKED_FORMAT = "axgen-dataset/2"
# Masked documents in preference pairs; other readers refuse it, so no program trains a pair's rejected half as text.
PAIRS_FORMAT = "axgen-dataset/3"
FORMATS = (FORMAT, MASKED_FORMAT, PAIRS_FORMAT)
MANIFEST = "manifest.json"


class DatasetError(ValueError):
    """A dataset that cannot be read as FORMAT describes, or does not fit the model; the message names the file."""


def shard_files(split: str, index: int, masked: bool = False) -> dict[str, str]:
    """The file names of a split's shard: its tokens, its documents' end offsets and, in a masked dataset, its
    loss mask."""
    stem = f"{split}-{index:05d}"
    files = {"tokens": f"{stem}.tokens.npy", "docs": f"{stem}.docs.npy"}
    return {**files, "mask": f"{stem}.mask.npy"} if masked else files


def read_manifest(directory) -> dict:
    """The manifest of a dataset directory, checked to be one FORMAT describes."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise DatasetError(f"{directory}: no such dataset directory")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise DatasetError(f"{path}: missing; not a dataset (write one with `axgen data`)") from None
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DatasetError(f"{path}: cannot read: {_first_line(err)}") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found not in FORMATS:
        expected = ", ".join(f'"{name}"' for name in FORMATS)
        raise DatasetError(f"{path}: format {json.dumps(found)}, expected one of {expected}")
    _check_fields(path, manifest)
    return manifest


def _count(value) -> bool:
    return type(value) is int and value >= 0  # JSON's true is no count


# What a manifest's field may hold: a check, and its words for the error.
_OBJECT = (lambda v: isinstance(v, dict), "an object")
_LIST = (lambda v: isinstance(v, list), "a list")
_COUNT = (_count, "an integer >= 0")
_TOKEN_ID = (lambda v: v is None or _count(v), "a token id or null")
_TOKENIZER_FIELDS = {
    "vocab_size": (lambda v: _count(v) and v > 0, "an integer > 0"),
    "bos_id": _TOKEN_ID,
    "eos_id": _TOKEN_ID,
    "sha256": (lambda v: v is None or isinstance(v, str), "a string or null"),
}
_SHARD_FIELDS = {
    "tokens": (lambda v: isinstance(v, str), "a file name"),
    "docs": (lambda v: isinstance(v, str), "a file name"),
    "num_tokens": _COUNT,
    "num_documents": _COUNT,
}


def _check_fields(path: str, manifest: dict) -> None:
    """Every field a program reads from a manifest, of the kind it reads: a manifest edited by hand or written
    by another tool is refused here, naming the field, not met as a KeyError or TypeError later."""
    tokenizer = _field(path, manifest, "tokenizer", _OBJECT)
    for key, kind in _TOKENIZER_FIELDS.items():
        _field(path, tokenizer, key, kind, "tokenizer.")
    _field(path, manifest, "max_token_id", _COUNT)
    _field(path, manifest, "token_dtype", (lambda v: v in ("uint16", "uint32"), '"uint16" or "uint32"'))
    splits = _field(path, manifest, "splits", _OBJECT)
    for split in ("train", "eval"):
        entry = _field(path, splits, split, _OBJECT, "splits.")
        for index, shard in enumerate(_field(path, entry, "shards", _LIST, f"splits.{split}.")):
            within = f"splits.{split}.shards[{index}]"
            if not isinstance(shard, dict):
                raise DatasetError(f"{path}: {within} is {_shown(shard)}, not an object")
            for key, kind in _SHARD_FIELDS.items():
                _field(path, shard, key, kind, f"{within}.")


def _field(path: str, parent: dict, key: str, kind: tuple, within: str = ""):
    """parent[key], which must be of `kind`; `within` names the parent in the error (`tokenizer.`)."""
    if key not in parent:
        raise DatasetError(f"{path}: has no {within}{key}; not a dataset `axgen data` wrote (write it again)")
    valid, expected = kind
    if not valid(parent[key]):
        raise DatasetError(f"{path}: {within}{key} is {_shown(parent[key])}, not {expected}")
    return parent[key]


def _shown(value) -> str:
    """A value as an error shows it: JSON, on one line and short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_vocabulary(directory, vocab_size: int, spec: str) -> None:
    """A dataset whose tokenizer or token ids go beyond the model's embedding is refused, naming both numbers."""
    manifest, path = read_manifest(directory), os.path.join(directory, MANIFEST)
    vocab = f"vocab_size={vocab_size} of {spec}"
    if manifest["tokenizer"]["vocab_size"] > vocab_size:
        raise DatasetError(
            f"{path}: the tokenizer's {manifest['tokenizer']['vocab_size']} tokens exceed {vocab}"
        )
    if manifest["max_token_id"] >= vocab_size:
        raise DatasetError(f"{path}: max_token_id {manifest['max_token_id']} is beyond {vocab}")


def check_same_tokenizer(train_dir, eval_dir) -> None:
    """Eval ids made by another tokenizer (or other BOS/EOS tokens) than the training ids measure nothing: the
    manifests must record the same one."""
    train, held_out = (read_manifest(directory)["tokenizer"] for directory in (train_dir, eval_dir))
    differences = [  # a sha256's first 12 hex digits tell it apart
        f"{key} {str(held_out[key])[:12]} vs {str(train[key])[:12]}"
        for key in ("sha256", "vocab_size", "bos_id", "eos_id")
        if held_out[key] != train[key]
    ]
    if differences:
        raise DatasetError(
            f"{os.path.join(eval_dir, MANIFEST)} records another tokenizer than"
            f" {os.path.join(train_dir, MANIFEST)} ({', '.join(differences)}): --eval-data must be tokenized as"
            " --data is"
        )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def open_shard(directory, shard: dict, token_dtype: str, masked: bool = False):
    """A shard's tokens, each document's end offset and (in a masked dataset, else None) its loss mask,
    memory-mapped, after checking them against the manifest."""
    arrays = {}
    if not masked and "mask" in shard:
        raise DatasetError(
            f"{os.path.join(directory, MANIFEST)}: format {FORMAT} trains every token, but its shard"
            f" {shard['tokens']} has a loss mask ({shard['mask']}): a masked dataset is {MASKED_FORMAT}"
        )
    for key in ("tokens", "docs", "mask") if masked else ("tokens", "docs"):
        if key not in shard:
            raise DatasetError(
                f"{os.path.join(directory, MANIFEST)}: a shard of a masked dataset names no {key} file"
            )
        path = os.path.join(directory, shard[key])
        try:
            arrays[key] = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise DatasetError(f"shard {path} is unreadable: {err}") from None
    tokens, ends = arrays["tokens"], arrays["docs"]
    tokens_path, docs_path = (os.path.join(directory, shard[key]) for key in ("tokens", "docs"))
    expected = (shard["num_tokens"],), (shard["num_documents"],)
    if tokens.dtype != token_dtype or (tokens.shape, ends.shape) != expected:
        raise DatasetError(
            f"shard {tokens_path} holds {len(tokens)} {tokens.dtype} tokens in {len(ends)} documents; its"
            f" manifest says {shard['num_tokens']} {token_dtype} tokens in {shard['num_documents']}"
        )
    bounds = np.concatenate([[0], ends])
    decreasing = np.flatnonzero(np.diff(bounds) <= 0)
    if len(decreasing):
        i = decreasing[0]
        raise DatasetError(
            f"shard {docs_path}: document end offsets must increase, but document {i} ends at"
            f" {bounds[i + 1]}, not after {bounds[i]}"
        )
    if bounds[-1] != len(tokens):
        raise DatasetError(
            f"shard {docs_path}: the last document ends at {bounds[-1]}, but {tokens_path} holds"
            f" {len(tokens)} tokens"
        )
    mask = arrays.get("mask")
    if mask is not None and (mask.dtype != np.uint8 or mask.shape != tokens.shape):
        raise DatasetError(
            f"shard {os.path.join(directory, shard['mask'])} holds {len(mask)} {mask.dtype} values; a loss mask"
            f" holds one uint8 for each of the {len(tokens)} tokens of {tokens_path}"
        )
    if mask is not None:
        # The manifest's count is what `axgen data` trained; a mask that says otherwise (all zeros, say: a run
        # that trains nothing at loss 0) is not the dataset it describes.
        trained = int(np.count_nonzero(mask))
        if trained != shard.get("num_trained_tokens"):
            raise DatasetError(
                f"shard {os.path.join(directory, shard['mask'])} trains {trained} tokens; its manifest says"
                f" {shard.get('num_trained_tokens')}"
            )
    return tokens, ends, mask


class PackedSplit:
    """One split of a dataset cut into windows of seq_len + 1 tokens. Each window comes with segment ids that
    number its documents from 1; padding is segment 0, which no loss counts. `masked` says whether the dataset
    holds loss masks (format 2); `mask_window` gives each window's.

    Plain text: documents lie back to back in each shard, so a window packs whole documents and parts of those at
    its edges; consecutive windows share one token, so every token is a target once, and only a shard's last
    window is padded.

    Conversations (format 2): a window packs whole conversations, and one that does not fit what is left of a
    window starts the next, the rest padded, so a reply never trains in a window without its prompt. A
    conversation longer than a window is cut at that window's end and its rest not trained (`cut_conversations`
    counts them; `axgen data --max-len` at most seq_len + 1 keeps every one whole).

    Preference pairs (format 3, `pairs`): a window holds one pair, its chosen sequence (segment 1) then its
    rejected one (segment 2); a pair longer than a window is refused, naming the --max-len that fits."""

    def __init__(self, directory, split: str, seq_len: int):
        manifest = read_manifest(directory)
        shards = manifest["splits"][split]["shards"]
        self.masked = manifest["format"] in (MASKED_FORMAT, PAIRS_FORMAT)
        self.pairs = manifest["format"] == PAIRS_FORMAT
        opened = [open_shard(directory, shard, manifest["token_dtype"], self.masked) for shard in shards]
        self.shards = [(tokens, ends) for tokens, ends, _ in opened]
        self.masks = [mask for _, _, mask in opened]
        self.files = [os.path.join(directory, shard["tokens"]) for shard in shards]
        self.mask_files = [os.path.join(directory, shard.get("mask", "")) for shard in shards]
        self.seq_len = seq_len
        self.cut_conversations = 0
        if self.pairs:
            spans = [_pairs(ends, seq_len + 1, file) for (_, ends), file in zip(self.shards, self.files)]
            self.starts, self.stops = [starts for starts, _ in spans], [stops for _, stops in spans]
        elif self.masked:
            packed = [_whole_conversations(ends, seq_len + 1) for _, ends in self.shards]
            self.starts, self.stops = [starts for starts, _, _ in packed], [stops for _, stops, _ in packed]
            self.cut_conversations = sum(cut for _, _, cut in packed)
        else:
            self.starts = [
                np.arange(max(1, math.ceil((len(tokens) - 1) / seq_len))) * seq_len
                for tokens, _ in self.shards
            ]
            self.stops = [
                np.minimum(starts + seq_len + 1, len(tokens))
                for starts, (tokens, _) in zip(self.starts, self.shards)
            ]
        self.first_window = np.cumsum([0, *map(len, self.starts)])

    def __len__(self):
        return int(self.first_window[-1])

    def shard_of(self, index):
        """The shard that window `index` is cut from."""
        return int(np.searchsorted(self.first_window, index, side="right")) - 1

    def _bounds(self, index):
        shard = self.shard_of(index)
        within = index - self.first_window[shard]
        return shard, int(self.starts[shard][within]), int(self.stops[shard][within])

    def window(self, index):
        """Tokens and segment ids, each [seq_len + 1] int32, of window `index`."""
        shard, start, stop = self._bounds(index)
        tokens, ends = self.shards[shard]
        piece = tokens[start:stop]
        # Documents that end inside the window: the token after each end starts the next segment.
        first, last = np.searchsorted(ends, [start, start + len(piece) - 1], side="right")
        starts = np.zeros(len(piece), np.int32)
        starts[ends[first:last] - start] = 1
        window, segment_ids = np.zeros((2, self.seq_len + 1), np.int32)
        window[: len(piece)] = piece
        segment_ids[: len(piece)] = 1 + np.cumsum(starts)
        return window, segment_ids

    def mask_window(self, index):
        """The loss mask [seq_len + 1] int32 of window `index`, aligned with `window(index)`'s tokens: the stored
        mask in a masked dataset, 1 for every token of one without; 0 in the padding past a shard's end."""
        shard, start, stop = self._bounds(index)
        mask = np.zeros(self.seq_len + 1, np.int32)
        mask[: stop - start] = 1 if self.masks[shard] is None else self.masks[shard][start:stop]
        return mask


def _whole_conversations(ends, span: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(start, stop) offsets of windows of at most `span` tokens that each hold whole conversations (their end
    offsets `ends`), greedily in order; a conversation longer than `span` gets a window of its first `span` tokens.
    Returns the starts, the stops, and how many conversations were cut so."""
    starts, stops, cut = [], [], 0
    window = begin = 0
    for end in ends.tolist():
        if end - window > span:  # it does not fit what is left: the window closes before it
            if begin > window:
                starts.append(window), stops.append(begin)
            window = begin
            if end - begin > span:
                starts.append(begin), stops.append(begin + span)
                cut, window = cut + 1, end
        begin = end
    if begin > window or not starts:
        starts.append(window), stops.append(begin)
    return np.array(starts, np.int64), np.array(stops, np.int64), cut


def _pairs(ends, span: int, file: str) -> tuple[np.ndarray, np.ndarray]:
    """(start, stop) offsets of each pair of documents (a preference pair: chosen, rejected) of a shard whose
    documents end at `ends`; DatasetError where a pair does not fit a window of `span` tokens."""
    if len(ends) % 2:
        raise DatasetError(
            f"shard {file} holds {len(ends)} documents; a shard of preference pairs holds two a pair"
        )
    bounds = np.concatenate([[0], ends])
    starts, stops = bounds[:-1:2], bounds[2::2]
    long = np.flatnonzero(stops - starts > span)
    if len(long):
        longest = int((stops - starts).max())
        raise DatasetError(
            f"shard {file}: {len(long)} preference pairs are longer than a window of seq_len + 1 = {span} tokens"
            f" (the longest {longest}): write them with `axgen data --pairs --max-len {span}`, which leaves them"
            " out, or raise seq_len"
        )
    return starts.astype(np.int64), stops.astype(np.int64)


class Batches:
    """The rows of each step's global batch that this process feeds: windows in an order drawn from (seed, epoch),
    a new one each epoch, so a batch depends only on its step and a resumed run sees the batches an uninterrupted
    one would. `shuffle=False` keeps the split's order (evaluation); `documents=False` makes each row one
    document, so attention and positions run across the documents packed into it. A token id at or beyond
    `vocab_size` (a manifest that understates its max_token_id) is refused before it reaches the embedding."""

    def __init__(
        self, split: PackedSplit, global_batch: int, seed: int, vocab_size: int, shuffle=True, documents=True
    ):
        self.split, self.global_batch, self.seed, self.vocab_size = split, global_batch, seed, vocab_size
        self.shuffle, self.documents = shuffle, documents
        self.orders = {}

    def order(self, epoch):
        if epoch not in self.orders:  # keeps only the newest epoch's: a batch spans at most two
            rng = np.random.default_rng([self.seed, epoch])
            self.orders = {
                epoch: rng.permutation(len(self.split)) if self.shuffle else np.arange(len(self.split))
            }
        return self.orders[epoch]

    def local_batch(self, step):
        """tokens, segment ids and loss mask [global_batch / processes, seq_len + 1] int32 of this process's rows
        of `step`. The mask is 1 where the token is trained as a target (every token of plain text), 0 where it is
        not (a non-assistant token of a conversation; padding): the target tokens[:, 1:] is weighted by
        loss_mask[:, 1:]; loss_mask[:, 0] belongs to a token the previous window already predicts."""
        indices = self._indices(step)
        tokens, segment_ids = (np.stack(arrays) for arrays in zip(*map(self.split.window, indices)))
        if not self.documents:
            segment_ids = np.minimum(segment_ids, 1)  # padding stays 0
        if tokens.max() >= self.vocab_size:
            row = int(np.argmax(tokens.max(axis=1)))
            raise DatasetError(
                f"shard {self.split.files[self.split.shard_of(indices[row])]} holds token {tokens[row].max()}"
                f" >= vocab_size={self.vocab_size} (step {step})"
            )
        masks = np.stack([self.split.mask_window(i) for i in indices])
        if masks.max() > 1:
            row = int(np.argmax(masks.max(axis=1)))
            raise DatasetError(
                f"shard {self.split.mask_files[self.split.shard_of(indices[row])]} holds loss mask value"
                f" {masks[row].max()}; a loss mask holds 0 and 1 (step {step})"
            )
        return tokens, segment_ids, masks

    def _indices(self, step):
        """The windows of this process's rows of `step`."""
        rows = self.global_batch // jax.process_count()
        first = step * self.global_batch + jax.process_index() * rows
        epochs, offsets = np.divmod(np.arange(first, first + rows), len(self.split))
        return [self.order(e)[i] for e, i in zip(epochs, offsets)]


def prefetched(make_batch, steps, depth=2):
    """make_batch(step) for each step, made on a background thread up to `depth` steps ahead of the consumer."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pending = collections.deque()
        for step in steps:
            pending.append(pool.submit(make_batch, step))
            if len(pending) > depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
