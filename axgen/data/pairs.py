"""Preference pairs (`axgen data --pairs`): records of a `prompt` with a `chosen` and a `rejected` completion, in
either of the forms TRL's DPOTrainer reads, tokenized as it tokenizes them:

* text: three strings; the prompt is tokenized with the tokenizer's own special tokens (a BOS where it adds one),
  the eos token's text is added to each completion that does not end with it, and prompt + completion is
  tokenized as one text;
* conversational: three lists of messages; the prompt is rendered by the chat template with its generation prompt
  (and the record's `tools`, `documents` and `chat_template_kwargs`), prompt + completion without it.

In both, the completion is what follows the longest prefix the prompt's tokens share with both prompt +
completion sequences (TRL's `common_prefix_length`: a template may render the prompt alone differently), and only
its tokens train. Each pair becomes two masked documents, chosen then rejected (`axgen.runtime.dataset`'s
format 3), which a program trains in one window.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from axgen.data.chat import (
    ChatTemplate,
    TemplateRaised,
    parts_printed_as_lists,
    messages_of,
    template_variables,
)
from axgen.data.inputs import SKIPPED_EXAMPLES, TEMPLATE_VARIABLES, DataError, Skipped
from axgen.data.tokenizer import LoadedTokenizer

FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class PairCounts:
    """What became of the pairs: kept, or left out by --max-len (a window holds both of a pair's sequences)."""

    max_len: int | None = None
    template: ChatTemplate | None = None
    pairs: int = 0
    trained_tokens: int = 0
    dropped_too_long: int = 0
    examples: list[str] = field(default_factory=list)
    forms: set[str] = field(default_factory=set)

    def manifest_entry(self) -> dict:
        return {
            "forms": sorted(self.forms),
            "chat_template": self.template.manifest_entry() if "messages" in self.forms else None,
            "pairs": self.pairs,
            "trained_tokens": self.trained_tokens,
            "max_len": self.max_len,
            "dropped_too_long": self.dropped_too_long,
            "dropped_examples": self.examples,
            "tokenized": "as TRL's DPOTrainer: the completion follows the prompt tokens both sequences share",
        }


def encode_pairs(
    records: Iterable[tuple[str, object]],
    template: ChatTemplate | DataError,
    tokenizer: LoadedTokenizer,
    *,
    skipped: Skipped,
    counts: PairCounts,
) -> Iterator[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]]:
    """((chosen ids, mask), (rejected ids, mask)) of each record (where, value) that is a pair, each sequence
    the shared prompt and its completion, the mask 1 on the completion; other records go to `skipped` with their
    reason. `template` is the chat template, or why there is none (raised at the first conversational record).
    """
    for where, record in records:
        try:
            prompt, completions = _sequences(record, template, tokenizer, counts)
        except _NotAPair as why:
            skipped.bad(where, str(why))
            continue
        chosen, rejected = (np.array(prompt + ids, np.uint32) for ids in completions)
        if counts.max_len is not None and len(chosen) + len(rejected) > counts.max_len:
            if 2 * len(prompt) + 2 > counts.max_len:
                skipped.bad(
                    where,
                    f"its prompt of {len(prompt)} tokens leaves no room for both completions within --max-len"
                    f" {counts.max_len} (a window holds the prompt twice, once before each completion)",
                )
                continue
            counts.dropped_too_long += 1
            if len(counts.examples) < SKIPPED_EXAMPLES:
                counts.examples.append(f"{where}: {len(chosen)} + {len(rejected)} tokens")
            continue
        masks = [np.r_[np.zeros(len(prompt), np.uint8), np.ones(len(ids), np.uint8)] for ids in completions]
        counts.pairs += 1
        counts.trained_tokens += sum(len(ids) for ids in completions)
        yield (chosen, masks[0]), (rejected, masks[1])


class _NotAPair(ValueError):
    """Why a record is not a preference pair."""


def _sequences(
    record: object, template: ChatTemplate | DataError, tokenizer: LoadedTokenizer, counts: PairCounts
) -> tuple[list[int], tuple[list[int], list[int]]]:
    """The prompt's token ids and the chosen and rejected completions' (TRL's tokenization, module docstring)."""
    if not isinstance(record, dict):
        raise _NotAPair(f"a JSON {type(record).__name__}, not an object with prompt, chosen and rejected")
    missing = [name for name in FIELDS if record.get(name) is None]
    if missing:
        raise _NotAPair(
            f'no "{missing[0]}" (keys: {", ".join(record) or "none"}); a pair has {", ".join(FIELDS)}'
        )
    prompt, chosen, rejected = (record[name] for name in FIELDS)
    conversational = isinstance(prompt, list)
    for name in FIELDS:
        if not isinstance(record[name], list if conversational else str):
            form = "a list of messages" if conversational else "a string"
            raise _NotAPair(f'"{name}" is not {form}, as "prompt" is: give all three in one form')
    for name in ("chosen", "rejected"):
        if not record[name] or (not conversational and not record[name].strip()):
            raise _NotAPair(f'"{name}" is empty: nothing to prefer')
    if chosen == rejected:
        raise _NotAPair('"chosen" and "rejected" are the same: the pair prefers nothing')
    if conversational:
        texts = _rendered(record, template)
        encodings = tokenizer.tokenizer.encode_batch(texts, add_special_tokens=False)
    else:
        eos = tokenizer.tokenizer.id_to_token(tokenizer.eos_id)
        texts = [prompt] + [prompt + (c if c.endswith(eos) else c + eos) for c in (chosen, rejected)]
        encodings = tokenizer.tokenizer.encode_batch(texts)
    counts.forms.add("messages" if conversational else "text")
    prompt_ids, *sequences = (encoding.ids for encoding in encodings)
    shared = min(_common_prefix(prompt_ids, ids) for ids in sequences)
    completions = tuple(ids[shared:] for ids in sequences)
    if not all(completions):
        raise _NotAPair("a completion tokenizes as nothing after the prompt: nothing to train")
    if completions[0] == completions[1]:
        raise _NotAPair('"chosen" and "rejected" tokenize the same: the pair prefers nothing')
    return prompt_ids[:shared], completions


def _rendered(record: dict, template: ChatTemplate | DataError) -> list[str]:
    """The chat template's prompt (with its generation prompt), prompt + chosen and prompt + rejected."""
    if isinstance(template, DataError):
        raise template
    given = {name: record[name] for name in TEMPLATE_VARIABLES if record.get(name) is not None}
    variables, why = template_variables(given)
    if variables is None:
        raise _NotAPair(why)
    conversations = []
    for name in ("chosen", "rejected"):
        messages, why = messages_of(record["prompt"] + record[name], sharegpt=False)
        if messages is None:
            raise _NotAPair(f"prompt + {name}: {why}")
        conversations.append(messages)
    prompt = conversations[0][: len(record["prompt"])]
    try:
        texts = [template.render(prompt, add_generation_prompt=True, variables=variables)]
        texts += [template.render(messages, variables=variables) for messages in conversations]
    except TemplateRaised as err:
        raise _NotAPair(str(err)) from None
    for messages in conversations:
        printed = parts_printed_as_lists(messages, [(text, None) for text in texts])
        if printed is not None:
            raise _NotAPair(
                f"message {printed} has its content as a list of parts, which the chat template prints as a"
                " Python list; give the content as a string"
            )
    return texts


def _common_prefix(ids: list[int], other: list[int]) -> int:
    """How many leading tokens the two share."""
    return next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))
