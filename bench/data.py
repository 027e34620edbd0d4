"""`axgen data` end to end against tokenizers' own batch encoder on the same texts: the share of the
encoder's throughput that reading, encoding and writing shards keeps (the goal is at least 0.8).

    .venv/bin/python bench/data.py [--mb 50] [--tokenizer tokenizer.json] [--vocab-size 16384] [--repeats 3]

The corpus is the demo corpus cut into documents of a few KB (runs of its modules' paragraphs, drawn with a
fixed seed) written as JSON Lines, about --mb MB; without --tokenizer, a byte-level BPE is trained on the demo
corpus.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from axgen.cli import main as axgen
from axgen.data.corpus import module_sources, write_corpus
from axgen.data.datasets import read_manifest
from axgen.data.tokenizer import BATCH_CHARS, train_tokenizer


def write_jsonl_corpus(path: Path, megabytes: float, seed: int = 0) -> list[str]:
    """Documents of 5 to 40 consecutive paragraphs of the demo corpus until there are `megabytes` of them."""
    paragraphs = [p for source in module_sources().values() for p in source.split("\n\n") if p.strip()]
    rng = random.Random(seed)
    documents, size = [], 0
    while size < megabytes * 1e6:
        start = rng.randrange(len(paragraphs))
        documents.append("\n\n".join(paragraphs[start : start + rng.randint(5, 40)]))
        size += len(documents[-1])
    with path.open("w") as file:
        file.writelines(json.dumps({"text": text}) + "\n" for text in documents)
    return documents


def encoder_tokens_per_second(tokenizer_file: Path, texts: list[str]) -> float:
    """tokenizers' encode_batch_fast alone, on batches the size `axgen data` encodes, texts in memory."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    batches, batch, chars = [], [], 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            batches.append(batch)
            batch, chars = [], 0
    batches.append(batch)
    start = time.perf_counter()
    tokens = sum(len(e) for b in batches for e in tokenizer.encode_batch_fast(b, add_special_tokens=False))
    return tokens / (time.perf_counter() - start)


def axgen_data_tokens_per_second(corpus: Path, tokenizer_file: Path, out: Path) -> float:
    """`axgen data` in this process: loading the tokenizer, reading JSON Lines, encoding, writing shards."""
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = axgen(["data", str(corpus), "--tokenizer", str(tokenizer_file), "--out", str(out), "--force"])
    seconds = time.perf_counter() - start
    assert code == 0, f"axgen data exited {code}"
    splits = read_manifest(out)["splits"].values()
    return sum(split["num_tokens"] for split in splits) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=50, help="corpus size in MB (50)")
    parser.add_argument(
        "--tokenizer", type=Path, help="a tokenizer.json (default: train one on the demo corpus)"
    )
    parser.add_argument("--vocab-size", type=int, default=16384, help="of the trained tokenizer (16384)")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="axgen-bench-data-") as tmp:
        tmp = Path(tmp)
        texts = write_jsonl_corpus(tmp / "corpus.jsonl", args.mb)
        tokenizer_file = args.tokenizer
        if tokenizer_file is None:
            tokenizer_file = tmp / "tokenizer" / "tokenizer.json"
            write_corpus(tmp / "demo")
            train_tokenizer([str(tmp / "demo")], args.vocab_size, tokenizer_file)
        print(f"corpus: {len(texts):,} documents, {sum(map(len, texts)) / 1e6:.1f} MB of JSON Lines text")
        # In alternating pairs, so a busy neighbour on a shared machine slows both runs of a pair alike.
        pairs = []
        for run in range(1, args.repeats + 1):
            encoder = encoder_tokens_per_second(tokenizer_file, texts)
            end_to_end = axgen_data_tokens_per_second(tmp / "corpus.jsonl", tokenizer_file, tmp / "dataset")
            pairs.append((encoder, end_to_end))
            ratio = end_to_end / encoder
            print(f"run {run}: (1) {encoder:,.0f}  (2) {end_to_end:,.0f} tokens/s  ratio {ratio:.2f}")
    print(f"cores: {len(os.sched_getaffinity(0))}")
    print(
        f"(1) tokenizers encode_batch_fast, texts in memory, best: {max(e for e, _ in pairs):,.0f} tokens/s"
    )
    print(
        f"(2) axgen data, JSON Lines to shards, best:              {max(d for _, d in pairs):,.0f} tokens/s"
    )
    ratio = statistics.median(d / e for e, d in pairs)
    print(f"ratio (2)/(1), median of the pairs: {ratio:.2f} (goal >= 0.8)")


if __name__ == "__main__":
    main()
