"""Conversations for supervised fine-tuning: rendered with a tokenizer's chat template exactly as transformers'
`apply_chat_template` renders them, tokenized, and given a loss mask that trains only the assistant's tokens.

Rendering. The template runs in jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
loopcontrols extension, a `{% generation %}` tag, a `tojson` filter that does not escape HTML, and the globals
`raise_exception`, `strftime_now`, `dict` and `namespace` (the last two limited as transformers limits them); it
sees `messages`, `tools`, `documents`, `add_generation_prompt` and the tokenizer's named special tokens
(`bos_token`, `eos_token`, ... from tokenizer_config.json). A record's `tools` and `documents` (each a list of
objects, or a JSON string of one, as TRL reads them) are passed as apply_chat_template's arguments of those names,
and its `chat_template_kwargs` (an object) as its other keyword arguments, which win over the special tokens'
names as there; without them, `tools` and `documents` are None. As transformers does, keys whose value is null are
dropped from each message, and a message's reasoning (`reasoning_content`, `thinking` or `reasoning`) is offered
under both `thinking` and `reasoning_content`. `strftime_now` formats one moment per template (when it was
loaded), so every conversation of a dataset carries the same date and the renderings of one conversation agree.

The loss mask is 1 for the tokens the assistant generates, up to and including the token that ends each of its
turns, and 0 for everything else (system, user and tool turns and the template's own text):

* A template that marks `{% generation %}` blocks says itself which text is the assistant's: the characters
  rendered inside them, as transformers' `return_assistant_tokens_mask=True` takes them.
* Any other template is rendered on prefixes of the conversation. For the assistant message at index i, the text
  from the end of `render(messages[:i], add_generation_prompt=True)` (the prompt a model is given) to the end of
  `render(messages[:i + 1])` is what the model must generate; whitespace the template writes after the end of the
  turn is left out (generation stops at the end-of-turn token, so nothing after it is generated). Both renderings
  must be prefixes of the whole conversation's for the conversation to train as one example.
* A template that renders earlier turns differently once later ones follow (Qwen3 drops a turn's reasoning once a
  user turn follows it; Phi-3.5 ends a conversation with eos only when it is the whole one) cannot be split so.
  Such a conversation trains as its users train it: one example per assistant turn, each the rendering of the
  conversation up to that turn (as the model sees it when it writes that turn), training that turn only. The
  manifest counts these conversations and their examples (`per_turn`). A turn whose rendering does not start with
  its generation prompt is still refused.

The tokens trained are those from the one holding the first character of the assistant's text to the one
holding its last, as transformers' `char_to_token` picks them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding

from axgen.data.inputs import SKIPPED_EXAMPLES, DataError, Skipped, first_line
from axgen.data.tokenizer import CONFIG, LoadedTokenizer, pipelined, read_tokenizer_config

CHAT_TEMPLATE_FILE = "chat_template.jinja"
# ChatML, as Qwen2 and SmolLM write it, for tokenizers without a template of their own; its special tokens must be
# in the vocabulary.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {"chatml": (CHATML, ("<|im_start|>", "<|im_end|>"))}
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speakers as transformers' roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
}
# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Rendered conversations per encode call, by size (as `LoadedTokenizer.encode` batches texts).
BATCH_CHARS = 1_000_000


class TemplateRaised(Exception):
    """A chat template failed on a conversation; the message says how, in one line."""


# --- the template environment -------------------------------------------------------------------------------


class _GenerationTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and, while a render is being tracked, records the
    character span the body occupies in the output."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        self.spans: list[tuple[int, int]] | None = None
        self.rendered = 0  # characters output before the chunk now being rendered

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

    def _generation(self, caller) -> str:
        text = caller()
        if self.spans is not None:
            self.spans.append((self.rendered, self.rendered + len(text)))
        return text


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes <, > and & for HTML, which chat templates never want.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` in a template, without handing it the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing the underscore names through which a template could reach Python internals."""

    def __init__(*args, **kwargs):  # Namespace's own signature trick, so namespace(self=...) still works
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template cannot set {name!r} on a namespace")


def _environment(now: datetime) -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTracker, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = now.strftime
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment


# --- a tokenizer's chat template ----------------------------------------------------------------------------


class ChatTemplate:
    """A compiled chat template with the special tokens it is rendered with. `source` names where it came from
    (a file, or `builtin:chatml`) for messages and the manifest."""

    def __init__(
        self,
        text: str,
        source: str,
        special_tokens: dict[str, str],
        now: datetime | None = None,
        tool_use: "ChatTemplate | None" = None,
    ):
        self.text, self.source, self.special_tokens = text, source, dict(special_tokens)
        # The tokenizer's named "tool_use" template beside its "default": transformers renders a conversation
        # given tools with it.
        self.tool_use = tool_use
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        self.marks_generation = bool(GENERATION_TAG.search(text))
        environment = _environment(now or datetime.now())
        try:
            self.template = environment.from_string(text)
        except jinja2.TemplateSyntaxError as err:
            raise DataError(
                f"{source}: the chat template does not parse: line {err.lineno}: {err.message}"
            ) from None
        self.tracker = next(e for e in environment.extensions.values() if isinstance(e, _GenerationTracker))

    def render(
        self, messages: list[dict], add_generation_prompt: bool = False, variables: dict | None = None
    ) -> str:
        """The conversation as `apply_chat_template(messages, tokenize=False, **variables)` renders it, where
        `variables` are those `template_variables` gives."""
        if self.tool_use is not None and (variables or {}).get("tools") is not None:
            return self.tool_use.render(messages, add_generation_prompt, variables)
        return self._render(messages, add_generation_prompt, None, variables or {})

    def examples(
        self, messages: list[dict], variables: dict | None = None
    ) -> tuple[list[tuple[str, list[tuple[int, int]]]], bool]:
        """(rendered text, character spans to train) of each example the conversation trains as: itself whole,
        or, where the template renders earlier turns differently once later ones follow, one example per
        assistant turn (module docstring); and whether it was split so."""
        if self.tool_use is not None and (variables or {}).get("tools") is not None:
            return self.tool_use.examples(messages, variables)
        variables = variables or {}
        if self.marks_generation:
            spans: list[tuple[int, int]] = []
            return [(self._render(messages, False, spans, variables), spans)], False
        whole = self.render(messages, variables=variables)
        turns = [
            self._turn(messages, i, variables) for i, m in enumerate(messages) if m.get("role") == "assistant"
        ]
        if all(whole.startswith(prompt) and whole.startswith(turn) for prompt, turn in turns):
            return [(whole, [_span(prompt, turn) for prompt, turn in turns])], False
        return [(turn, [_span(prompt, turn)]) for prompt, turn in turns], True

    def _turn(self, messages: list[dict], i: int, variables: dict) -> tuple[str, str]:
        """(the generation prompt before assistant message i, the rendering up to and with it)."""
        prompt = self.render(messages[:i], add_generation_prompt=True, variables=variables)
        turn = self.render(messages[: i + 1], variables=variables)
        if not turn.startswith(prompt):
            raise TemplateRaised(
                f"message {i} (assistant) does not render after the generation prompt before it, so the"
                " generation prompt is not how this template starts an assistant turn"
            )
        return prompt, turn

    def _render(
        self, messages: list[dict], add_generation_prompt: bool, spans: list | None, variables: dict
    ) -> str:
        given = dict(variables)
        keywords = given.pop("chat_template_kwargs", {})
        context = {
            **self.special_tokens,
            **keywords,
            "messages": messages,
            "tools": given.get("tools"),
            "documents": given.get("documents"),
            "add_generation_prompt": add_generation_prompt,
        }
        self.tracker.spans, self.tracker.rendered = spans, 0
        chunks = []
        try:
            for chunk in self.template.generate(**context):
                chunks.append(chunk)
                self.tracker.rendered += len(chunk)
        # A template is a program from the tokenizer's author: whatever it raises (raise_exception's TemplateError,
        # an undefined name, a TypeError from adding None to a string) is the template failing on this input.
        except Exception as err:
            raise TemplateRaised(f"the chat template raises: {first_line(err)}") from None
        finally:
            self.tracker.spans = None
        return "".join(chunks)

    def manifest_entry(self) -> dict:
        entry = {
            "source": self.source,
            "sha256": self.sha256,
            "assistant_text": "generation marks" if self.marks_generation else "prefix renderings",
        }
        if self.tool_use is not None:
            entry["with_tools"] = self.tool_use.manifest_entry()
        return entry


def parts_printed_as_lists(messages: list[dict], examples: list) -> int | None:
    """The index of a message whose content is a list of parts (OpenAI's `[{"type": "text", "text": ...}]`) that
    the template printed as the Python repr of the list, as a text-only template does (transformers' rendering
    too): the model would train on the repr."""
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list) and content:
            first = repr(content[0])[:20]
            if any(first in text for text, _ in examples):
                return index
    return None


def _span(prompt: str, turn: str) -> tuple[int, int]:
    """What the assistant writes: the turn's rendering after its generation prompt, without the whitespace the
    template puts after the end of the turn (generation stops at the end-of-turn token)."""
    return len(prompt), max(len(prompt), len(turn.rstrip()))


def load_chat_template(
    tokenizer: LoadedTokenizer,
    choice: str | None = None,
    *,
    bos: str | None = None,
    eos: str | None = None,
    now: datetime | None = None,
) -> ChatTemplate:
    """The chat template to render conversations with: `choice` is `chatml` (the built-in), a template file, or the
    name of one of the tokenizer's named templates; without it, the tokenizer's own: a chat_template.jinja beside
    its tokenizer.json (which transformers prefers), else tokenizer_config.json's `chat_template` (a string, or a
    list of named templates, of which "default", with "tool_use" for records that carry tools, as transformers
    picks them). `bos`/`eos` (--bos/--eos) replace the config's tokens, as keyword arguments to apply_chat_template
    would."""
    config_path = tokenizer.path.with_name(CONFIG)
    config = read_tokenizer_config(config_path)
    special = _special_tokens(tokenizer, config, {"bos_token": bos, "eos_token": eos})
    if choice in BUILTIN_TEMPLATES:
        text, needed = BUILTIN_TEMPLATES[choice]
        missing = [token for token in needed if tokenizer.tokenizer.token_to_id(token) is None]
        if missing:
            raise DataError(
                f"{tokenizer.path}: no {' or '.join(missing)} in the vocabulary, which the built-in {choice} template"
                " writes as single tokens; add them as special tokens or pass a template that fits this tokenizer"
            )
        return ChatTemplate(text, f"builtin:{choice}", special, now)
    named = _named_templates(config.get("chat_template"), config_path)
    if choice is not None and choice in named:
        return ChatTemplate(named[choice], f"{config_path} ({choice})", special, now)
    if choice is not None:
        path = Path(choice)
        if not path.is_file():
            known = ", ".join([*BUILTIN_TEMPLATES, *named])
            raise DataError(f"--chat-template {choice}: no such file, and not a template name ({known})")
        return ChatTemplate(_read_text(path), str(path), special, now)
    jinja_file = tokenizer.path.with_name(CHAT_TEMPLATE_FILE)
    if jinja_file.is_file():
        return ChatTemplate(_read_text(jinja_file), str(jinja_file), special, now)
    if "default" in named:
        source = (
            f"{config_path}" if isinstance(config.get("chat_template"), str) else f"{config_path} (default)"
        )
        tool_use = named.get("tool_use")
        if tool_use is not None:
            tool_use = ChatTemplate(tool_use, f"{config_path} (tool_use)", special, now)
        return ChatTemplate(named["default"], source, special, now, tool_use)
    if named:
        raise DataError(
            f"{config_path}: chat_template holds {', '.join(named)} but no \"default\"; pass --chat-template NAME"
        )
    raise DataError(
        f"{tokenizer.path}: no chat template (no {CHAT_TEMPLATE_FILE} beside it, no chat_template in {CONFIG});"
        " pass --chat-template chatml or a .jinja file"
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read: {err}") from None


def _named_templates(entry, config_path: Path) -> dict[str, str]:
    """tokenizer_config.json's chat_template as {name: template}: a string is the default; a list holds
    {"name", "template"} objects."""
    if entry is None:
        return {}
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list) and all(
        isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)
        for item in entry
    ):
        return {item["name"]: item["template"] for item in entry}
    raise DataError(
        f"{config_path}: chat_template is neither a string nor a list of {{name, template}} objects"
    )


def _special_tokens(tokenizer: LoadedTokenizer, config: dict, flags: dict[str, str | None]) -> dict[str, str]:
    """The special tokens a template sees: tokenizer_config.json's named ones (and the named ones of its
    `extra_special_tokens` object), replaced by `flags` where given; BOS and EOS come from `tokenizer` where the
    config says nothing of them (a bare tokenizer.json, whose BOS/EOS axgen found by their well-known names).
    """
    entries = {name: config.get(name) for name in SPECIAL_TOKEN_NAMES}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        entries.update(extra)
    tokens = {}
    for name, entry in entries.items():
        # A string, or an AddedToken written as a dict; null says the tokenizer has no such token.
        token = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(token, str):
            tokens[name] = token
    for name, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
        if flags[name] is not None:
            tokens[name] = flags[name]
        elif name not in config and token_id is not None:
            tokens[name] = tokenizer.tokenizer.id_to_token(token_id)
    return tokens


# --- records as conversations -------------------------------------------------------------------------------


def messages_of(conversation: object, sharegpt: bool) -> tuple[list[dict] | None, str]:
    """A record's conversation as transformers' messages, or None and why it is not one. `sharegpt` reads
    [{from, value}] with ShareGPT's speakers; otherwise [{role, content, ...}], whose other keys (tool_calls,
    reasoning_content, ...) pass to the template."""
    if not isinstance(conversation, list) or not conversation:
        return None, f"the conversation is {_described(conversation)}, not a non-empty array of messages"
    messages = []
    for index, item in enumerate(conversation):
        if not isinstance(item, dict):
            return None, f"message {index} is {_described(item)}, not an object"
        if sharegpt:
            speaker, value = item.get("from"), item.get("value")
            if speaker not in SHAREGPT_ROLES:
                known = ", ".join(SHAREGPT_ROLES)
                return None, f"message {index} is from {json.dumps(speaker)}, not one of {known}"
            if not isinstance(value, str):
                return None, f'message {index} has a "value" that is {_described(value)}, not a string'
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": value})
            continue
        # As apply_chat_template does: a null value is a key left out (content: null beside tool_calls).
        message = {key: value for key, value in item.items() if value is not None}
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return None, f"message {index} has role {json.dumps(role)}, not one of {', '.join(ROLES)}"
        if content is None and "tool_calls" not in message:
            return None, f'message {index} ({role}) has no "content"'
        if content is not None and not isinstance(content, (str, list)):
            return None, f"message {index} ({role}) has content that is {_described(content)}, not a string"
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    if not any(message["role"] == "assistant" for message in messages):
        return None, "no assistant turn: nothing to train on"
    return messages, ""


def template_variables(given: dict) -> tuple[dict | None, str]:
    """A record's template variables (`axgen.data.inputs.TEMPLATE_VARIABLES`) as the template sees them, or None
    and why they cannot be: `tools` and `documents` lists of objects (a JSON string of one is read), and
    `chat_template_kwargs` an object whose keys do not name what apply_chat_template sets itself."""
    variables = {}
    for name, value in given.items():
        if name in ("tools", "documents") and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                return None, f'"{name}" is a string that is not JSON ({err.msg} at column {err.colno})'
        if name in ("tools", "documents"):
            if not (isinstance(value, list) and all(isinstance(item, dict) for item in value)):
                return None, f'"{name}" is {_described(value)}, not an array of objects'
        elif name == "chat_template_kwargs":
            if not isinstance(value, dict):
                return None, f'"chat_template_kwargs" is {_described(value)}, not an object'
            taken = sorted(set(value) & RESERVED_VARIABLES)
            if taken:
                return None, f'"chat_template_kwargs" sets {", ".join(taken)}, which the renderer sets itself'
        variables[name] = value
    return variables, ""


# What apply_chat_template passes itself: a record's chat_template_kwargs may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _described(value: object) -> str:
    if isinstance(value, list) and not value:
        return "an empty array"
    types = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return types.get(type(value), "an object" if isinstance(value, dict) else "null")


# --- conversations as tokens and loss masks -----------------------------------------------------------------


@dataclass
class ConversationCounts:
    """What became of the conversations: trained whole, cut to --max-len, or dropped by it."""

    max_len: int | None = None
    conversations: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    trained_tokens: int = 0
    examples: list[str] = field(default_factory=list)
    # Conversations the template renders differently turn by turn, and the examples (one per assistant turn, each
    # counted in `conversations` too) they were split into.
    per_turn_conversations: int = 0
    per_turn_examples: int = 0

    def manifest_entry(self) -> dict:
        return {
            "conversations": self.conversations,
            "trained_tokens": self.trained_tokens,
            "max_len": self.max_len,
            "truncated": self.truncated,
            "dropped_too_long": self.dropped_too_long,
            "dropped_examples": self.examples,
            "per_turn": {
                "policy": "a conversation whose earlier turns render differently once later ones follow trains as"
                " one example per assistant turn, each rendered up to that turn, training that turn only",
                "conversations": self.per_turn_conversations,
                "examples": self.per_turn_examples,
            },
        }


def loss_mask(encoding: Encoding, spans: Iterable[tuple[int, int]]) -> np.ndarray:
    """1 for each token from the one holding a span's first character to the one holding its last, for each of
    `spans` (start, end), as transformers picks them with `char_to_token`; 0 for the others. A character no token
    holds (one a normalizer removed) gives way to the nearest one inside the span that a token does hold."""
    mask = np.zeros(len(encoding), np.uint8)
    for start, end in spans:
        first = next((t for c in range(start, end) if (t := encoding.char_to_token(c)) is not None), None)
        if first is None:  # an empty span (a turn rendered as nothing), or one no token holds
            continue
        last = next(t for c in range(end - 1, start - 1, -1) if (t := encoding.char_to_token(c)) is not None)
        mask[first : last + 1] = 1
    return mask


def cut_to(ids: np.ndarray, mask: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A conversation longer than `max_len` tokens, cut after the last assistant turn that ends within them, so
    every reply it trains on is whole; None when even the first does not."""
    trained = np.flatnonzero(mask[:max_len])
    # A trained token followed by an untrained one (or by nothing) ends a turn.
    ends = trained[(trained + 1 == len(mask)) | (mask[np.minimum(trained + 1, len(mask) - 1)] == 0)] + 1
    if not len(ends):
        return None
    return ids[: ends[-1]], mask[: ends[-1]]


def encode_conversations(
    conversations: Iterable[tuple[str, object, dict]],
    template: ChatTemplate,
    tokenizer: LoadedTokenizer,
    *,
    sharegpt: bool,
    skipped: Skipped,
    counts: ConversationCounts,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(token ids, loss mask) of each conversation ((where, record value, template variables), in order: what
    `axgen.data.inputs.read_conversations` gives) that renders and trains
    at least one token, cut to `counts.max_len`; the others are bad records, given to `skipped` with their
    reason. Conversations are rendered here while the tokenizer encodes the previous batch on every core."""

    def rendered() -> Iterator[tuple[str, str, list]]:
        for where, conversation, given in conversations:
            messages, why = messages_of(conversation, sharegpt)
            variables, why_not = template_variables(given)
            if messages is None or variables is None:
                skipped.bad(where, why or why_not)
                continue
            try:
                examples, per_turn = template.examples(messages, variables)
            except TemplateRaised as err:
                skipped.bad(where, str(err))
                continue
            printed = parts_printed_as_lists(messages, examples)
            if printed is not None:
                skipped.bad(
                    where,
                    f"message {printed} has its content as a list of parts, which the chat template prints as a"
                    " Python list; give the content as a string",
                )
                continue
            if per_turn:
                counts.per_turn_conversations += 1
                counts.per_turn_examples += len(examples)
            for text, spans in examples:
                yield where, text, spans

    def batches() -> Iterator[list[tuple[str, str, list]]]:
        batch, chars = [], 0
        for item in rendered():
            batch.append(item)
            chars += len(item[1])
            if chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
        if batch:
            yield batch

    def encode(batch):
        return batch, tokenizer.tokenizer.encode_batch(
            [text for _, text, _ in batch], add_special_tokens=False
        )

    for batch, encodings in pipelined(batches(), encode):
        for (where, _, spans), encoding in zip(batch, encodings):
            ids, mask = np.array(encoding.ids, dtype=np.uint32), loss_mask(encoding, spans)
            if not mask.any():
                skipped.bad(
                    where, "the chat template renders the assistant's turns as no tokens: nothing to train"
                )
                continue
            if counts.max_len is not None and len(ids) > counts.max_len:
                cut = cut_to(ids, mask, counts.max_len)
                if cut is None:
                    counts.dropped_too_long += 1
                    if len(counts.examples) < SKIPPED_EXAMPLES:
                        counts.examples.append(
                            f"{where}: {len(ids)} tokens; its first reply ends past --max-len"
                        )
                    continue
                ids, mask = cut
                counts.truncated += 1
            counts.conversations += 1
            counts.trained_tokens += int(mask.sum())
            yield ids, mask
