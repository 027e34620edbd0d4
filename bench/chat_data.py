"""Conversations per second through axgen's chat renderer, tokenizer and loss mask against transformers'
`apply_chat_template` on the same conversations, template and tokenizer.

    .venv/bin/python bench/chat_data.py [--conversations 4000] [--hf-python /work/hfenv/bin/python] [--repeats 3]

The conversations (1 to 4 user/assistant turns, half with a system turn, contents of 1 to 6 paragraphs of the demo
corpus, drawn with a fixed seed) are rendered with two templates of tests/fixtures/chat/ and the tokenizer its
expected ids were made with:

* meta-llama-3-8b-instruct, which has no `{% generation %}` marks: axgen renders each conversation once per
  assistant turn twice more to find the assistant's text (its docstring says why); transformers renders it once
  and cannot give a mask;
* chatml-generation, which marks the assistant's text: both render once, and both give the mask
  (`return_assistant_tokens_mask=True`).

axgen's side is `axgen.data.chat.encode_conversations` (rendering, encoding on every core, masks, as `axgen data --chat`
runs it, without the file reading and writing). transformers' side runs in the Python of --hf-python (which needs
transformers; axgen never imports it) as `apply_chat_template(batch, tokenize=True, return_dict=True)` over
batches of 256 conversations, its fastest use. Each side is timed in its own process, after start-up and a warm-up
batch, in alternating pairs.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from axgen.data.chat import ConversationCounts, encode_conversations, load_chat_template
from axgen.data.corpus import module_sources
from axgen.data.inputs import Skipped
from axgen.data.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures/chat"
TEMPLATES = ("meta-llama-3-8b-instruct", "chatml-generation")
HF_BATCH = 256
TRANSFORMERS_SIDE = r"""
import json, os, re, sys, time
from transformers import PreTrainedTokenizerFast

folder, conversations_file, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
config_file, jinja = os.path.join(folder, "tokenizer_config.json"), os.path.join(folder, "chat_template.jinja")
config = json.load(open(config_file)) if os.path.exists(config_file) else {}
template = open(jinja).read() if os.path.exists(jinja) else config["chat_template"]
named = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
tokenizer = PreTrainedTokenizerFast(
    tokenizer_file=os.path.join(folder, "tokenizer.json"), chat_template=template, **named
)
marks = bool(re.search(r"\{%-?\s*generation\s*-?%\}", template))
conversations = json.load(open(conversations_file))


def run(items):
    for start in range(0, len(items), batch):
        tokenizer.apply_chat_template(
            items[start : start + batch], tokenize=True, return_dict=True, return_assistant_tokens_mask=marks
        )


run(conversations[:batch])
start = time.perf_counter()
run(conversations)
print(len(conversations) / (time.perf_counter() - start))
"""


def make_conversations(count: int, seed: int = 0) -> list[list[dict]]:
    paragraphs = [p for source in module_sources().values() for p in source.split("\n\n") if p.strip()]
    rng = random.Random(seed)

    def text() -> str:
        start = rng.randrange(len(paragraphs))
        return "\n\n".join(paragraphs[start : start + rng.randint(1, 6)])

    conversations = []
    for _ in range(count):
        messages = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 4)):
            messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        conversations.append(messages)
    return conversations


def axgen_per_second(folder: Path, conversations: list[list[dict]]) -> float:
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    template = load_chat_template(tokenizer)

    def run(items) -> int:
        counts = ConversationCounts()
        pairs = encode_conversations(
            ((str(i), c, {}) for i, c in enumerate(items)),
            template,
            tokenizer,
            sharegpt=False,
            skipped=Skipped(False),
            counts=counts,
        )
        return sum(1 for _ in pairs)

    run(conversations[:HF_BATCH])
    start = time.perf_counter()
    done = run(conversations)
    assert done == len(conversations)
    return done / (time.perf_counter() - start)


def transformers_per_second(hf_python: str, folder: Path, conversations_file: Path) -> float:
    result = subprocess.run(
        [
            hf_python,
            "-c",
            TRANSFORMERS_SIDE,
            str(folder),
            str(conversations_file),
            str(HF_BATCH),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=4000, help="how many (4000)")
    parser.add_argument("--hf-python", default="/work/hfenv/bin/python", help="a Python with transformers")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs per template (3)")
    args = parser.parse_args()
    conversations = make_conversations(args.conversations)
    expected = json.loads((FIXTURES / "expected.json").read_text())["fixtures"]
    with tempfile.TemporaryDirectory(prefix="axgen-bench-chat-") as tmp:
        tmp = Path(tmp)
        conversations_file = tmp / "conversations.json"
        conversations_file.write_text(json.dumps(conversations))
        chars = sum(len(m["content"]) for c in conversations for m in c)
        print(f"{len(conversations):,} conversations, {chars / 1e6:.1f} MB of content")
        for name in TEMPLATES:
            folder = tmp / name
            shutil.copytree(FIXTURES / name, folder)
            shutil.copy(FIXTURES / expected[name]["tokenizer"], folder / "tokenizer.json")
            pairs = []
            for _ in range(args.repeats):
                theirs = transformers_per_second(args.hf_python, folder, conversations_file)
                ours = axgen_per_second(folder, conversations)
                pairs.append((ours, theirs))
            ratio = statistics.median(ours / theirs for ours, theirs in pairs)
            print(
                f"{name}: axgen {max(o for o, _ in pairs):,.0f} conversations/s, transformers"
                f" {max(t for _, t in pairs):,.0f} conversations/s (best of {args.repeats}); ratio axgen/transformers,"
                f" median of the pairs: {ratio:.2f}"
            )


if __name__ == "__main__":
    main()
