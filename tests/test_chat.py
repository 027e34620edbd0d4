"""Chat templates and conversation datasets: axgen renders, tokenizes and masks conversations as transformers'
apply_chat_template does (expected values in tests/fixtures/chat/expected.json, made by
tests/fixtures/make_chat_expected.py), `axgen data --chat` writes them with their loss masks, and the runtime's
reader gives the masks beside the tokens."""

import hashlib
import json
import re
import shutil
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.conftest import ROOT
from tests.test_data import error_of, run

from axgen.data.chat import (
    ConversationCounts,
    TemplateRaised,
    cut_to,
    encode_conversations,
    load_chat_template,
    loss_mask,
    template_variables,
)
from axgen.data.datasets import read_manifest, write_dataset
from axgen.data.inputs import DataError, Skipped
from axgen.runtime import dataset
from axgen.data.tokenizer import load_tokenizer

FIXTURES = ROOT / "tests/fixtures/chat"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
CONVERSATIONS = json.loads((FIXTURES / "conversations.json").read_text())
NOW = datetime.fromisoformat(EXPECTED["now"])
CASES = [(f, c) for f, fixture in EXPECTED["fixtures"].items() for c in fixture["conversations"]]
# What ends an assistant turn in each template without generation marks.
END_OF_TURN = {
    "meta-llama-3-8b-instruct": "<|eot_id|>",
    "llama-3.2-3b-instruct": "<|eot_id|>",
    "qwen3": "<|im_end|>",
    "qwen2.5-instruct": "<|im_end|>",
    "mistral-7b-instruct-v0.2": "</s>",
    "gemma-2-9b-it": "<end_of_turn>",
    "phi-3.5-mini-instruct": "<|end|>",
}
# Templates that render a turn differently once later ones follow, so a conversation of several assistant turns
# trains as one example per turn: Qwen3 drops a turn's reasoning block, Phi-3.5 writes eos only at the very end.
PER_TURN = {"qwen3", "phi-3.5-mini-instruct"}
# The templates that write each content trimmed.
TRIMS_CONTENT = {"meta-llama-3-8b-instruct", "llama-3.2-3b-instruct", "gemma-2-9b-it"}
# The templates that raise on a system turn (Gemma's "System role not supported"; Mistral's roles must alternate
# from the first message on).
NO_SYSTEM_TURN = {"gemma-2-9b-it", "mistral-7b-instruct-v0.2"}


def tokenizer_dir(tmp_path: Path, fixture: str) -> Path:
    """The fixture's template files beside the tokenizer its expected ids were made with."""
    folder = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, folder, dirs_exist_ok=True)
    tokenizer = EXPECTED["fixtures"][fixture]["tokenizer"]
    if not (folder / "tokenizer.json").exists():
        shutil.copy(FIXTURES / tokenizer, folder / "tokenizer.json")
    return folder


def loaded(tmp_path: Path, fixture: str):
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path, fixture) / "tokenizer.json")
    return tokenizer, load_chat_template(tokenizer, now=NOW)


def encoded(template, tokenizer, conversations, skip_bad=False, max_len=None):
    """(ids, mask) of each conversation, and the Skipped and ConversationCounts that saw them."""
    skipped, counts = Skipped(skip_bad), ConversationCounts(max_len=max_len)
    pairs = list(
        encode_conversations(
            ((f"c{i}", c, {}) for i, c in enumerate(conversations)),
            template,
            tokenizer,
            sharegpt=False,
            skipped=skipped,
            counts=counts,
        )
    )
    return pairs, skipped, counts


def trained_pieces(tokenizer, ids, mask) -> list[str]:
    """The text of each run of trained tokens."""
    pieces, run_ids = [], []
    for token, bit in zip([*ids, 0], [*mask, 0]):
        if bit:
            run_ids.append(int(token))
        elif run_ids:
            pieces.append(tokenizer.tokenizer.decode(run_ids, skip_special_tokens=False))
            run_ids = []
    return pieces


@pytest.mark.parametrize(("fixture", "name"), CASES)
def test_text_and_ids_equal_transformers(tmp_path, fixture, name):
    tokenizer, template = loaded(tmp_path, fixture)
    want = EXPECTED["fixtures"][fixture]["conversations"][name]
    if "error" in want:
        with pytest.raises(TemplateRaised, match=want["error"]):
            template.render(CONVERSATIONS[name])
        return
    text = template.render(CONVERSATIONS[name])
    assert text == want["text"]
    assert tokenizer.tokenizer.encode(text, add_special_tokens=False).ids == want["ids"]


@pytest.mark.parametrize(
    ("fixture", "name"), [(f, c) for f, c in CASES if EXPECTED["fixtures"][f]["generation_marks"]]
)
def test_generation_marked_masks_equal_transformers(tmp_path, fixture, name):
    tokenizer, template = loaded(tmp_path, fixture)
    want = EXPECTED["fixtures"][fixture]["conversations"][name]
    pairs, _, _ = encoded(template, tokenizer, [CONVERSATIONS[name]])
    ids, mask = pairs[0]
    assert list(ids) == want["ids"]
    assert list(mask) == want["assistant_masks"]


RECORDS = json.loads((FIXTURES / "records.json").read_text())
RECORD_CASES = [(f, r) for f, fixture in EXPECTED["fixtures"].items() for r in fixture["records"]]


def variables_of(record: dict) -> dict:
    return {key: value for key, value in record.items() if key != "messages"}


@pytest.mark.parametrize(("fixture", "name"), RECORD_CASES)
def test_a_records_tools_documents_and_template_kwargs_render_as_in_transformers(tmp_path, fixture, name):
    """Tools (a list, or a JSON string of one), documents and chat_template_kwargs reach the template as TRL passes
    them to apply_chat_template; the text, ids and (with generation marks) masks are transformers'."""
    tokenizer, template = loaded(tmp_path, fixture)
    record, want = RECORDS[name], EXPECTED["fixtures"][fixture]["records"][name]
    messages, variables = record["messages"], template_variables(variables_of(record))[0]
    if "error" in want:
        with pytest.raises(TemplateRaised, match=re.escape(want["error"])):
            template.render(messages, variables=variables)
        return
    assert template.render(messages, variables=variables) == want["text"]
    skipped, counts = Skipped(False), ConversationCounts(max_len=None)
    item = ("r", messages, variables_of(record))
    pairs = list(
        encode_conversations([item], template, tokenizer, sharegpt=False, skipped=skipped, counts=counts)
    )
    if fixture in PER_TURN and sum(m["role"] == "assistant" for m in messages) > 1:
        # As test_prefix_masks_cover_each_assistant_turn_and_its_end: one example per assistant turn.
        assert [list(ids) for ids, _ in pairs] == [turn["ids"] for turn in want["turns"]]
        assert [len(trained_pieces(tokenizer, ids, mask)) for ids, mask in pairs] == [1, 1]
        return
    ids, mask = pairs[0]
    assert list(ids) == want["ids"]
    if "assistant_masks" in want:
        assert list(mask) == want["assistant_masks"]
    else:  # every assistant turn trains, the tool call included, and the tool's answer does not
        pieces = trained_pieces(tokenizer, ids, mask)
        assert len(pieces) == sum(m["role"] == "assistant" for m in messages)
        assert not any("temperature_c" in piece for piece in pieces)


@pytest.mark.parametrize(
    ("variables", "why"),
    [
        ({"tools": {"type": "function"}}, '"tools" is an object, not an array of objects'),
        ({"tools": "[1, 2"}, '"tools" is a string that is not JSON'),
        ({"documents": ["text"]}, '"documents" is an array, not an array of objects'),
        ({"chat_template_kwargs": ["x"]}, '"chat_template_kwargs" is an array, not an object'),
        ({"chat_template_kwargs": {"messages": []}}, "sets messages, which the renderer sets itself"),
    ],
)
def test_bad_template_variables_are_a_bad_record(variables, why):
    assert template_variables(variables)[0] is None and why in template_variables(variables)[1]


def assistant_pieces(fixture: str, conversation: list[dict]) -> list[str]:
    """What each assistant turn of `conversation` must train: its content as the template writes it, and its
    end-of-turn token."""
    end, contents = END_OF_TURN[fixture], [m["content"] for m in conversation if m["role"] == "assistant"]
    if fixture in TRIMS_CONTENT:
        return [content.strip() + end for content in contents]
    if fixture == "mistral-7b-instruct-v0.2":
        # Trained as written (" leading space" as ▁leading ▁space), but its sentencepiece decoder drops the one
        # space that a decoded text starts with.
        return [content.removeprefix(" ") + end for content in contents]
    if fixture == "phi-3.5-mini-instruct":  # the end of a conversation is the end of the text: eos trains too
        return [content + end + "\n<|endoftext|>" for content in contents]
    if fixture != "qwen3":
        return [content + end for content in contents]
    # Qwen3 writes an empty reasoning block before the reply that ends the conversation.
    return [*(c + end for c in contents[:-1]), "<think>\n\n</think>\n\n" + contents[-1] + end]


@pytest.mark.parametrize(
    ("fixture", "name"),
    # A conversation the template raises on is refused whole (test_text_and_ids_equal_transformers).
    [
        (f, c)
        for f, c in CASES
        if f in END_OF_TURN and "error" not in EXPECTED["fixtures"][f]["conversations"][c]
    ],
)
def test_prefix_masks_cover_each_assistant_turn_and_its_end(tmp_path, fixture, name):
    tokenizer, template = loaded(tmp_path, fixture)
    conversation = CONVERSATIONS[name]
    if fixture in PER_TURN and sum(m["role"] == "assistant" for m in conversation) > 1:
        # The rendering of a prefix is not a prefix of the whole: the conversation trains one example per
        # assistant turn, each transformers' rendering of the conversation up to that turn, training that turn.
        pairs, _, counts = encoded(template, tokenizer, [conversation])
        turns = EXPECTED["fixtures"][fixture]["conversations"][name]["turns"]
        assert [list(ids) for ids, _ in pairs] == [turn["ids"] for turn in turns]
        pieces = [trained_pieces(tokenizer, ids, mask) for ids, mask in pairs]
        ends = [i + 1 for i, m in enumerate(conversation) if m["role"] == "assistant"]
        assert pieces == [assistant_pieces(fixture, conversation[:end])[-1:] for end in ends]
        assert (counts.per_turn_conversations, counts.per_turn_examples) == (1, len(turns))
        assert counts.conversations == len(turns)
        return
    pairs, _, _ = encoded(template, tokenizer, [conversation])
    ids, mask = pairs[0]
    assert list(ids) == EXPECTED["fixtures"][fixture]["conversations"][name]["ids"]
    assert trained_pieces(tokenizer, ids, mask) == assistant_pieces(fixture, conversation)


@pytest.mark.parametrize("fixture", sorted(EXPECTED["fixtures"]))
def test_a_user_token_is_never_trained(tmp_path, fixture):
    """Every character of a user or system turn lies in tokens whose mask is 0."""
    tokenizer, template = loaded(tmp_path, fixture)
    conversation = [
        {"role": "system", "content": "SYSTEMWORD rules"},
        {"role": "user", "content": "USERWORD one"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "USERWORD two"},
    ]
    if fixture == "qwen3":
        conversation = conversation[:3]
    if fixture in NO_SYSTEM_TURN:
        conversation = conversation[1:]
    examples, _ = template.examples(conversation)
    for text, spans in examples:
        encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
        mask = loss_mask(encoding, spans)
        for word in ("SYSTEMWORD", "USERWORD"):
            start = 0
            while (start := text.find(word, start)) >= 0:
                touching = [
                    i for i, (s, e) in enumerate(encoding.offsets) if s < start + len(word) and e > start
                ]
                assert touching and not mask[touching].any()
                start += len(word)
        assert mask.any()


def test_loss_mask_takes_each_token_a_span_touches():
    class Encoding:
        """Tokens of characters [0, 3), [3, 5), none (5 is dropped, as a normalizer may), [6, 9), [9, 12)."""

        offsets = [(0, 3), (3, 5), (6, 9), (9, 12)]

        def __len__(self):
            return len(self.offsets)

        def char_to_token(self, char):
            return next((i for i, (s, e) in enumerate(self.offsets) if s <= char < e), None)

    assert list(loss_mask(Encoding(), [(4, 7)])) == [0, 1, 1, 0]
    assert list(loss_mask(Encoding(), [(3, 5), (9, 12)])) == [0, 1, 0, 1]
    assert list(loss_mask(Encoding(), [(5, 6)])) == [0, 0, 0, 0]
    assert list(loss_mask(Encoding(), [(5, 8)])) == [0, 0, 1, 0]
    assert list(loss_mask(Encoding(), [(2, 2)])) == [0, 0, 0, 0]


def test_cut_to_keeps_whole_replies():
    ids, mask = np.arange(10), np.array([0, 0, 1, 1, 0, 0, 1, 1, 1, 0], np.uint8)
    assert [list(part) for part in cut_to(ids, mask, 8)] == [[0, 1, 2, 3], [0, 0, 1, 1]]
    assert [list(part) for part in cut_to(ids, mask, 9)] == [list(range(9)), list(mask[:9])]
    assert cut_to(ids, mask, 3) is None


# --- templates: where they come from -------------------------------------------------------------------------


def test_chat_template_jinja_beside_the_tokenizer_wins_as_in_transformers(tmp_path):
    folder = tokenizer_dir(tmp_path, "qwen3")
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}|{{ eos_token }}")
    template = load_chat_template(load_tokenizer(folder / "tokenizer.json"))
    assert template.source == str(folder / "chat_template.jinja")
    assert template.render([{"role": "user", "content": "hi"}]) == "hi|<|im_end|>"


def test_named_templates_and_the_builtin(tmp_path):
    folder = tokenizer_dir(tmp_path, "qwen3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ bos_token }}"},
        {"name": "tool_use", "template": "T"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(folder / "tokenizer.json", bos="<|endoftext|>")
    assert load_chat_template(tokenizer, bos="<|endoftext|>").render([]) == "D<|endoftext|>"
    assert load_chat_template(tokenizer, "tool_use").render([]) == "T"
    # Given tools, transformers' get_chat_template picks "tool_use" over "default"; so does a record's `tools`.
    default = load_chat_template(tokenizer, bos="<|endoftext|>")
    assert default.render([], variables={"tools": [{"type": "function"}]}) == "T"
    assert default.manifest_entry()["with_tools"]["source"].endswith("(tool_use)")
    chatml = load_chat_template(tokenizer, "chatml").render([{"role": "user", "content": "x"}], True)
    assert chatml == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_template_errors_are_one_line(tmp_path):
    folder = tokenizer_dir(tmp_path, "qwen3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    with pytest.raises(DataError, match="no chat template .* pass --chat-template chatml"):
        load_chat_template(tokenizer)
    (folder / "bad.jinja").write_text("{% for x in %}")
    with pytest.raises(DataError, match=r"bad.jinja: the chat template does not parse: line 1"):
        load_chat_template(tokenizer, str(folder / "bad.jinja"))
    with pytest.raises(DataError, match="--chat-template nope: no such file, and not a template name"):
        load_chat_template(tokenizer, "nope")


def test_the_builtin_needs_its_tokens(tmp_path):
    words = {"type": "WordLevel", "vocab": {"</s>": 0, "x": 1}, "unk_token": "x"}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": words}))
    with pytest.raises(
        DataError, match=r"no <\|im_start\|> or <\|im_end\|> in the vocabulary, which the built-in"
    ):
        load_chat_template(load_tokenizer(tmp_path / "tokenizer.json"), "chatml")


def test_the_sandbox_holds(tmp_path):
    tokenizer, _ = loaded(tmp_path, "qwen3")
    (tmp_path / "escape.jinja").write_text("{{ messages.__class__.__mro__ }}{% set ns = namespace(_x=1) %}")
    template = load_chat_template(tokenizer, str(tmp_path / "escape.jinja"))
    with pytest.raises(TemplateRaised):
        template.render([{"role": "user", "content": "x"}])


# --- axgen data --chat ----------------------------------------------------------------------------------------


def chat_data(capsys, tmp_path, records, *args, fixture="chatml-generation", name="c.jsonl"):
    folder = tokenizer_dir(tmp_path, fixture)
    source = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"messages": records}), source)
    else:
        source.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "ds"
    argv = ["data", source, "--chat", "--tokenizer", folder / "tokenizer.json", "--out", out, *args]
    return run(capsys, *argv), out, folder


def test_axgen_data_chat_writes_masks_beside_the_shards(capsys, tmp_path):
    records = [{"messages": CONVERSATIONS[name]} for name in CONVERSATIONS]
    (code, stdout, _), out, _ = chat_data(capsys, tmp_path, records, "--eval-fraction", "0")
    assert code == 0 and "4 conversations" in stdout and "trained" in stdout
    manifest = read_manifest(out)
    assert manifest["format"] == dataset.MASKED_FORMAT
    chat = manifest["conversations"]
    assert chat["form"] == "messages" and chat["conversations"] == 4
    assert chat["chat_template"]["assistant_text"] == "generation marks"
    shard = manifest["splits"]["train"]["shards"][0]
    tokens, mask = np.load(out / shard["tokens"]), np.load(out / shard["mask"])
    assert mask.dtype == np.uint8 and mask.shape == tokens.shape
    want = EXPECTED["fixtures"]["chatml-generation"]["conversations"]
    assert list(tokens) == [i for name in CONVERSATIONS for i in want[name]["ids"]]
    assert list(mask) == [m for name in CONVERSATIONS for m in want[name]["assistant_masks"]]
    assert shard["num_trained_tokens"] == chat["trained_tokens"] == int(mask.sum())
    assert manifest["splits"]["train"]["num_trained_tokens"] == int(mask.sum())


@pytest.mark.parametrize("seq_len", [255, 16])
def test_the_reader_packs_whole_conversations_with_their_masks(capsys, tmp_path, seq_len):
    """Each window starts at a conversation and holds whole ones (a reply never trains without its prompt); one
    that does not fit the rest of a window starts the next, the rest padding (segment 0, mask 0); one longer than
    a window keeps its first seq_len + 1 tokens, and the reader counts it."""
    records = [{"messages": CONVERSATIONS[name]} for name in CONVERSATIONS] * 3
    (code, _, _), out, _ = chat_data(capsys, tmp_path, records, "--eval-fraction", "0")
    assert code == 0
    split = dataset.PackedSplit(out, "train", seq_len=seq_len)
    assert split.masked
    shard = read_manifest(out)["splits"]["train"]["shards"][0]
    tokens, mask, ends = (np.load(out / shard[key]) for key in ("tokens", "mask", "docs"))
    starts, span = [0, *ends[:-1]], seq_len + 1
    conversations = [(s, e) for s, e in zip(starts, ends)]
    seen = []
    for index in range(len(split)):
        window, segments = split.window(index)
        got = split.mask_window(index)
        inside = [(s, e) for s, e in conversations if split._bounds(index)[1] <= s < split._bounds(index)[2]]
        first = inside[0][0]
        assert first == split._bounds(index)[1], "a window starts where a conversation does"
        length = min(inside[-1][1], first + span) - first
        assert list(window[:length]) == list(tokens[first : first + length])
        assert list(got[:length]) == list(mask[first : first + length])
        assert not got[length:].any() and not segments[length:].any() and not window[length:].any()
        assert list(np.unique(segments[:length])) == list(range(1, len(inside) + 1))
        seen += inside
    assert seen == conversations, "every conversation once, in order"
    assert split.cut_conversations == sum(e - s > span for s, e in conversations)
    assert (split.cut_conversations > 0) == (seq_len == 16)
    batch_tokens, segment_ids, batch_mask = dataset.Batches(split, 4, seed=1, vocab_size=1000).local_batch(2)
    assert batch_mask.shape == batch_tokens.shape and batch_mask.dtype == np.int32
    rows = [index for index in dataset.Batches(split, 4, seed=1, vocab_size=1000)._indices(2)]
    np.testing.assert_array_equal(batch_mask, np.stack([split.mask_window(i) for i in rows]))


def test_a_plain_dataset_reads_as_all_ones(tmp_path):
    write_dataset(tmp_path / "d", [np.arange(1, 30)], vocab_size=64, bos_id=None, eos_id=0, eval_fraction=0)
    split = dataset.PackedSplit(tmp_path / "d", "train", seq_len=8)
    assert not split.masked and read_manifest(tmp_path / "d")["format"] == dataset.FORMAT
    tokens, segments, mask = dataset.Batches(split, 4, 0, 64, shuffle=False).local_batch(0)
    assert ((mask == 1) == (segments > 0)).all()


def test_a_masked_shard_that_disagrees_is_refused(capsys, tmp_path):
    (code, _, _), out, _ = chat_data(
        capsys, tmp_path, [{"messages": CONVERSATIONS["one_turn"]}], "--eval-fraction", "0"
    )
    assert code == 0
    np.save(out / "train-00000.mask.npy", np.zeros(3, np.uint8))
    with pytest.raises(
        dataset.DatasetError, match="holds 3 uint8 values; a loss mask holds one uint8 for each"
    ):
        dataset.PackedSplit(out, "train", seq_len=8)


def test_max_len_cuts_after_a_whole_reply_or_drops(capsys, tmp_path):
    conversation = CONVERSATIONS["three_turns_with_spaces"]
    ids = EXPECTED["fixtures"]["chatml-generation"]["conversations"]["three_turns_with_spaces"]["ids"]
    short = [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "y"}]
    records = [{"messages": conversation}, {"messages": short}]
    (code, stdout, _), out, _ = chat_data(
        capsys, tmp_path, records, "--eval-fraction", "0", "--max-len", "40"
    )
    assert code == 0 and "1 cut and 1 dropped by --max-len" in stdout
    chat = read_manifest(out)["conversations"]
    assert (chat["truncated"], chat["dropped_too_long"], chat["max_len"]) == (1, 1, 40)
    tokens = np.load(out / "train-00000.tokens.npy")
    mask = np.load(out / "train-00000.mask.npy")
    assert len(tokens) <= 40 and list(tokens) == ids[: len(tokens)] and mask[-1] == 1


def test_sharegpt_and_parquet(capsys, tmp_path):
    sharegpt = [
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
    ]
    folder = tokenizer_dir(tmp_path, "chatml-generation")
    (tmp_path / "s.jsonl").write_text(json.dumps(sharegpt[0]) + "\n")
    code, _, err = run(
        capsys,
        "data",
        tmp_path / "s.jsonl",
        "--sharegpt",
        "--eval-fraction",
        "0",
        "--tokenizer",
        folder / "tokenizer.json",
        "--out",
        tmp_path / "sg",
    )
    assert code == 0, err
    assert read_manifest(tmp_path / "sg")["conversations"]["form"] == "sharegpt"
    records = [CONVERSATIONS["one_turn"], CONVERSATIONS["empty_contents"]]
    (code, _, err), out, _ = chat_data(capsys, tmp_path, records, "--eval-fraction", "0", name="c.parquet")
    assert code == 0, err
    want = EXPECTED["fixtures"]["chatml-generation"]["conversations"]
    tokens = np.load(out / "train-00000.tokens.npy")
    assert list(tokens) == want["one_turn"]["ids"] + want["empty_contents"]["ids"]


@pytest.mark.parametrize("source_name", ["r.jsonl", "r.parquet"])
def test_axgen_data_chat_passes_each_records_tools_and_kwargs_to_the_template(capsys, tmp_path, source_name):
    """A JSON Lines record's, or a Parquet row's, `tools` (a JSON string, as datasets often store them) and
    `chat_template_kwargs` reach the template: the dataset holds transformers' rendering of each."""
    names = ["tools_offered_not_called", "thinking_switched_off"]
    folder = tokenizer_dir(tmp_path, "qwen3")
    source = tmp_path / source_name
    if source_name.endswith(".parquet"):  # a tools column of JSON strings
        names = names[:1]
        record = RECORDS[names[0]]
        pq.write_table(pa.table({"messages": [record["messages"]], "tools": [record["tools"]]}), source)
    else:
        source.write_text("".join(json.dumps(RECORDS[name]) + "\n" for name in names))
    argv = ["data", source, "--chat", "--tokenizer", folder / "tokenizer.json", "--eval-fraction", "0"]
    code, _, err = run(capsys, *argv, "--out", tmp_path / "ds")
    assert code == 0, err
    want = EXPECTED["fixtures"]["qwen3"]["records"]
    tokens = np.load(tmp_path / "ds" / "train-00000.tokens.npy")
    assert list(tokens) == [i for name in names for i in want[name]["ids"]]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"text": "hi"}, 'no field "messages" (keys: text); pass --field'),
        ({"messages": [{"role": "robot", "content": "x"}]}, 'message 0 has role "robot", not one of system'),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn: nothing to train on"),
        (
            {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
            "content that is",
        ),
        ({"messages": []}, "not a non-empty array of messages"),
    ],
)
def test_bad_records_are_one_line_naming_file_and_line(capsys, tmp_path, record, reason):
    good = {"messages": CONVERSATIONS["one_turn"]}
    folder = tokenizer_dir(tmp_path, "chatml-generation")
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    argv = ["data", source, "--chat", "--tokenizer", folder / "tokenizer.json", "--out", tmp_path / "ds"]
    message = error_of(capsys, *argv)
    assert message.startswith(f"{source}:2: ") and reason in message
    assert not (tmp_path / "ds").exists()
    code, _, _ = run(capsys, *argv, "--skip-bad", "--eval-fraction", "0")
    skipped = read_manifest(tmp_path / "ds")["skipped"]
    assert code == 0 and skipped["count"] == 1 and reason in skipped["examples"][0]


def test_a_template_that_raises_or_is_not_prefix_stable_names_the_record(capsys, tmp_path):
    folder = tokenizer_dir(tmp_path, "qwen3")
    (folder / "strict.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps({"messages": CONVERSATIONS["system_and_two_turns"]}) + "\n")
    base = ["data", source, "--chat", "--tokenizer", folder / "tokenizer.json", "--out", tmp_path / "ds"]
    message = error_of(capsys, *base, "--chat-template", folder / "strict.jinja")
    assert message == f"{source}:1: the chat template raises: System role not supported"
    # A template whose turn does not begin with the generation prompt cannot say what the assistant wrote.
    (folder / "late.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    message = error_of(capsys, *base, "--chat-template", folder / "late.jinja")
    assert message == (
        f"{source}:1: message 2 (assistant) does not render after the generation prompt before it, so the"
        " generation prompt is not how this template starts an assistant turn"
    )


def test_chat_flags_need_chat(capsys, tmp_path):
    folder = tokenizer_dir(tmp_path, "qwen3")
    (tmp_path / "c.txt").write_text("plain\n")
    base = ["--tokenizer", folder / "tokenizer.json", "--out", tmp_path / "ds"]
    message = error_of(capsys, "data", tmp_path / "c.txt", *base, "--max-len", "5")
    assert message == "--max-len is for conversations: pass --chat (or --sharegpt) too"
    message = error_of(capsys, "data", tmp_path / "c.txt", *base, "--chat")
    assert (
        message
        == f"{tmp_path / 'c.txt'}: plain text holds no conversations (pass JSON Lines or Parquet records)"
    )


def test_the_fixtures_are_what_sources_json_says():
    sources = json.loads((FIXTURES / "sources.json").read_text())
    for path, entry in sources.items():
        data = (FIXTURES / path).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (entry["sha256"], entry["bytes"]), path
    assert {f for f in EXPECTED["fixtures"]} == {path.split("/")[0] for path in sources if "/" in path}


def test_content_parts_a_template_prints_as_a_python_list_are_refused(capsys, tmp_path):
    """OpenAI-style parts, common in published SFT sets: a text-only template prints the list's repr (so does
    transformers), which would be trained on; a template that reads the parts renders them."""
    folder = tokenizer_dir(tmp_path, "meta-llama-3-8b-instruct")  # `content | trim`: the list's repr, trimmed
    parts = [{"type": "text", "text": "Hi there"}]
    record = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "Hello"}]}
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps(record) + "\n")
    base = ["data", source, "--chat", "--tokenizer", folder / "tokenizer.json", "--out", tmp_path / "ds"]
    assert error_of(capsys, *base) == (
        f"{source}:1: message 0 has its content as a list of parts, which the chat template prints as a Python"
        " list; give the content as a string"
    )
    (folder / "parts.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    code, _, err = run(capsys, *base, "--chat-template", folder / "parts.jinja", "--eval-fraction", "0")
    assert code == 0, err


def test_a_chat_dataset_whose_masks_are_not_what_its_manifest_says_is_refused(capsys, tmp_path):
    records = [{"messages": CONVERSATIONS[name]} for name in CONVERSATIONS]
    (code, _, err), out, _ = chat_data(capsys, tmp_path, records, "--eval-fraction", "0")
    assert code == 0, err
    manifest_path = out / dataset.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    shard = manifest["splits"]["train"]["shards"][0]
    assert len(dataset.PackedSplit(out, "train", 16)) > 0

    # Format 1 trains every token: a masked dataset labelled so would train the prompts.
    manifest_path.write_text(json.dumps(dict(manifest, format=dataset.FORMAT)))
    with pytest.raises(
        dataset.DatasetError, match=f"format {dataset.FORMAT} trains every token, but its shard"
    ):
        dataset.PackedSplit(out, "train", 16)
    manifest_path.write_text(json.dumps(manifest))

    # A mask of zeros while the manifest counts trained tokens: a run that would train nothing at loss 0.
    mask_file = out / shard["mask"]
    np.save(mask_file, np.zeros_like(np.load(mask_file)))
    with pytest.raises(
        dataset.DatasetError, match=f"trains 0 tokens; its manifest says {shard['num_trained_tokens']}"
    ):
        dataset.PackedSplit(out, "train", 16)


def test_sigterm_stops_axgen_data_chat_and_leaves_nothing_beside_its_output(tmp_path):
    """A scheduler's SIGTERM ends `axgen data --chat` as Ctrl-C does: one line, exit 130, no staging folder."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import PROGRAM_ENV

    folder = tokenizer_dir(tmp_path, "chatml-generation")
    source = tmp_path / "many.jsonl"
    record = json.dumps({"messages": CONVERSATIONS["system_and_two_turns"]}) + "\n"
    source.write_text(record * 200_000)  # long enough to be stopped while it encodes
    out = tmp_path / "ds"
    argv = ["data", source, "--chat", "--tokenizer", folder / "tokenizer.json", "--out", out]
    code = "import sys; from axgen.cli import main; sys.exit(main(sys.argv[1:]))"
    process = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, argv)], env=PROGRAM_ENV, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".ds") for p in tmp_path.iterdir()) and time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert (process.returncode, stderr) == (130, "axgen: interrupted\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chatml-generation", "many.jsonl"]
