"""The emitted programs' data loader (numpy memmap windows + a prefetch thread) against grain, at 7B shape,
and whether a training step waits on the loader.

    .venv/bin/python bench/loader.py [--tokens 200_000_000] [--seconds 10] [--dataset DIR]

The loader must feed at least 20x what one H100 consumes training a 7B-width model (~45k tokens/s): >= 1M
tokens/s from one host process at seq_len 4096, global batch 8. Both loaders read the same windows of a
synthetic dataset (uniform random tokens in documents of lognormal length), built once and cached. The
step-time ratio times llama_tiny's train_step fed real batches through the program's loader against a
constant batch already on device; the goal is <= 1.02.
"""

from __future__ import annotations

import os

# Before jax is imported (by the emitted programs): the bench measures host-side loading only.
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np

from axgen.data.datasets import write_dataset
from axgen.interop import load_program
from axgen.runtime import dataset
from axgen.runtime.program import Program

# The runtime's loader, fed as this program's runs are fed (its vocab fits 32000 tokens).
ROOT = Path(__file__).resolve().parent.parent
WIDE_PROGRAM = ROOT / "generated/llama2_7b/cpu_8.py"
TINY_PROGRAM = ROOT / "generated/llama_tiny/cpu_1.py"
SEQ_LEN, GLOBAL_BATCH, SEED = 4096, 8, 0
VOCAB, EOS = 32000, 0
MEAN_DOCUMENT_TOKENS = 1000
H100_7B_TOKENS_PER_S = 45_000
GOAL_TOKENS_PER_S = 1_000_000  # 20x H100_7B_TOKENS_PER_S, rounded up
GRAIN_THREADS = (0, 2, 8)
TINY_DATASET_TOKENS = 2_000_000
STEP_PAIRS, WARMUP_STEPS = 60, 3


# Datasets ---------------------------------------------------------------------------------------------------


def synthetic_documents(total_tokens, vocab, seed=0):
    """Documents of uniform random tokens (none of them EOS) with lognormal lengths of mean about
    MEAN_DOCUMENT_TOKENS and a long tail, until they hold about `total_tokens`. Made a thousand at a time, as
    views of one draw, so 200M tokens take seconds."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    mu = np.log(MEAN_DOCUMENT_TOKENS) - sigma**2 / 2  # the lognormal's mean is exp(mu + sigma^2 / 2)
    made = 0
    while made < total_tokens:
        lengths = np.maximum(1, rng.lognormal(mu, sigma, 1000).astype(np.int64))
        tokens = rng.integers(EOS + 1, vocab, lengths.sum(), dtype=np.uint16)
        yield from np.split(tokens, np.cumsum(lengths)[:-1])
        made += int(lengths.sum())


def cached_dataset(directory, total_tokens, vocab):
    """An `axgen data` directory of about `total_tokens` tokens in about 8 train shards, written unless it is
    there."""
    directory = Path(directory)
    if not (directory / "manifest.json").is_file():
        print(f"writing {total_tokens:,} tokens to {directory}", flush=True)
        write_dataset(
            directory,
            synthetic_documents(total_tokens, vocab),
            vocab_size=vocab,
            bos_id=None,
            eos_id=EOS,
            eval_fraction=0.0,
            shard_tokens=max(1, total_tokens // 8),
        )
    return directory


# Throughput -------------------------------------------------------------------------------------------------


def batches_per_second(batches, seconds):
    """How fast an iterator of batches yields, over `seconds`, after a first batch that starts its threads."""
    next(batches)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(batches)
        count += 1
    return count / (time.perf_counter() - start)


class Windows:
    """A grain random-access source: window i of a PackedSplit, as (tokens, segment ids)."""

    def __init__(self, split):
        self.split = split

    def __len__(self):
        return len(self.split)

    def __getitem__(self, index):
        return self.split.window(index)


def grain_batches(split):
    """grain's own shuffled order: a fresh permutation each epoch, seeded; batches of GLOBAL_BATCH windows."""
    windows = grain.MapDataset.source(Windows(split)).shuffle(seed=SEED).repeat()
    return windows.batch(GLOBAL_BATCH, drop_remainder=True)


def read_options(threads):
    # A buffer of a few batches per thread, as the memmap reader's prefetch keeps two: a large one would only
    # add a burst at the start of a measurement.
    return grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4 * threads)


def loader_rates(program, directory, seconds):
    """tokens/s of each loader at SEQ_LEN x GLOBAL_BATCH, by name."""
    split = dataset.PackedSplit(str(directory), "train", SEQ_LEN)
    batches = dataset.Batches(split, GLOBAL_BATCH, SEED, vocab_size=program.CONFIG["vocab_size"])
    loaders = {
        "memmap Batches.local_batch": lambda: map(batches.local_batch, itertools.count()),
        "memmap + prefetched": lambda: dataset.prefetched(batches.local_batch, itertools.count()),
    }
    for threads in GRAIN_THREADS:
        options = read_options(threads)
        loaders[f"grain threads={threads}"] = lambda o=options: iter(grain_batches(split).to_iter_dataset(o))
    rates = {}
    for name, make in loaders.items():
        iterator = make()
        rates[name] = batches_per_second(iterator, seconds) * GLOBAL_BATCH * SEQ_LEN
        getattr(iterator, "close", lambda: None)()  # stops prefetched's thread
        print(f"  {name}: {rates[name]:,.0f} tokens/s", flush=True)
    return rates


# Same work, determinism, checkpoints ------------------------------------------------------------------------


def same_batches(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def check_same_windows(program, directory):
    """grain made to read the memmap reader's order (its epoch-0 permutation as the source of window indices)
    returns the batches Batches.local_batch does: both do the same work."""
    split = dataset.PackedSplit(str(directory), "train", SEQ_LEN)
    batches = dataset.Batches(split, GLOBAL_BATCH, SEED, vocab_size=program.CONFIG["vocab_size"])
    in_order = grain.MapDataset.source(batches.order(0)).map(split.window).batch(GLOBAL_BATCH)
    iterator = iter(in_order.to_iter_dataset(read_options(2)))
    for step in range(3):
        # grain reads the windows; the loss mask (all ones for plain text) is the memmap reader's own third array.
        assert same_batches(next(iterator), batches.local_batch(step)[:2]), f"step {step} differs"
    last = len(split) // GLOBAL_BATCH - 1
    assert same_batches(in_order[last], batches.local_batch(last)[:2]), f"step {last} differs"


def check_resume(program, directory):
    """Each loader, started again from its checkpoint, returns the batch the first run would have: the memmap
    reader's checkpoint is the step; grain's is its iterator's get_state()."""
    split = dataset.PackedSplit(str(directory), "train", SEQ_LEN)
    step = 5
    first_run = dataset.Batches(split, GLOBAL_BATCH, SEED, vocab_size=program.CONFIG["vocab_size"])
    expected = [first_run.local_batch(s) for s in range(step + 1)][step]
    resumed = dataset.Batches(split, GLOBAL_BATCH, SEED, vocab_size=program.CONFIG["vocab_size"])
    assert same_batches(
        resumed.local_batch(step), expected
    ), f"memmap reader resumed at {step} to another batch"

    dataset = grain_batches(split).to_iter_dataset(read_options(2))
    iterator = iter(dataset)
    for _ in range(step):
        next(iterator)
    state = iterator.get_state()
    expected = next(iterator)
    resumed_iterator = iter(dataset)
    resumed_iterator.set_state(state)
    assert same_batches(next(resumed_iterator), expected), f"grain resumed from {state} to another batch"
    return state


# Does a training step wait on the loader? -------------------------------------------------------------------


def timed_step(step_fn, state, batches):
    """One step, from asking for its batch to its new state being ready: blocking each step puts any wait for
    the loader in series with the step, where it shows (training overlaps it with the step before: this is an
    upper bound)."""
    start = time.perf_counter()
    state, _ = step_fn(state, *next(batches))
    jax.block_until_ready(state)
    return state, time.perf_counter() - start


def step_time_ratio(program, directory):
    """Median step time fed by prefetched(Batches.local_batch) over median step time on a constant batch
    already on device, for llama_tiny on CPU. The two kinds of step alternate, one each at a time, so the load
    of a busy machine falls on both alike; medians drop the steps another process interrupted."""
    batches = dataset.Batches(
        dataset.PackedSplit(str(directory), "train", program.CONFIG["seq_len"]),
        program.CONFIG["global_batch"],
        SEED,
        vocab_size=program.CONFIG["vocab_size"],
    )
    constant = itertools.repeat(tuple(jnp.asarray(x) for x in batches.local_batch(0)))
    loaded = dataset.prefetched(batches.local_batch, itertools.count())
    feeds = {
        "synthetic": constant,
        "real": (tuple(jnp.asarray(x) for x in batch) for batch in loaded),
    }
    times = {name: [] for name in feeds}
    runnable = Program.from_module(program)
    with jax.set_mesh(runnable.make_mesh()):
        step_fn = jax.jit(program.train_step, donate_argnums=0)
        state = jax.jit(runnable.init_state)(jax.random.key(SEED))
        for _ in range(WARMUP_STEPS):  # compiles; starts the prefetch thread
            for feed in feeds.values():
                state, _ = timed_step(step_fn, state, feed)
        for pair in range(STEP_PAIRS):
            for name in ("synthetic", "real") if pair % 2 else ("real", "synthetic"):
                state, seconds = timed_step(step_fn, state, feeds[name])
                times[name].append(seconds)
    loaded.close()  # stops the prefetch thread
    synthetic = statistics.median(times["synthetic"])
    return statistics.median(times["real"]) / synthetic, synthetic


# Main -------------------------------------------------------------------------------------------------------


def print_table(rates, ratio, synthetic_seconds, grain_state):
    cores = len(os.sched_getaffinity(0))
    print(f"\nseq_len {SEQ_LEN}, batch {GLOBAL_BATCH}, {cores} cores, goal {GOAL_TOKENS_PER_S:,} tokens/s")
    print(f"{'loader':<28} {'tokens/s':>12} {'x H100 7B (45k/s)':>18}  meets goal")
    for name, rate in rates.items():
        meets = "yes" if rate >= GOAL_TOKENS_PER_S else "NO"
        print(f"{name:<28} {rate:>12,.0f} {rate / H100_7B_TOKENS_PER_S:>18.1f}  {meets}")
    print(
        f"step time real/synthetic (llama_tiny cpu_1, medians of {STEP_PAIRS} steps each,"
        f" synthetic {synthetic_seconds * 1e3:.1f} ms): {ratio:.3f} (goal <= 1.02)"
    )
    print(f"same windows as grain: yes; resume: memmap by step, grain by get_state() = {grain_state}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200_000_000, help="synthetic dataset size")
    parser.add_argument("--seconds", type=float, default=10, help="measured per loader")
    parser.add_argument("--dataset", help="where the synthetic dataset is cached (default: a temp dir)")
    args = parser.parse_args()
    cache = Path(tempfile.gettempdir())
    wide = cached_dataset(args.dataset or cache / f"axgen-bench-loader-{args.tokens}", args.tokens, VOCAB)
    tiny = load_program(TINY_PROGRAM)
    tiny_data = cached_dataset(
        cache / f"axgen-bench-loader-tiny-{TINY_DATASET_TOKENS}",
        TINY_DATASET_TOKENS,
        tiny.CONFIG["vocab_size"],
    )
    program = load_program(WIDE_PROGRAM)
    check_same_windows(program, wide)
    grain_state = check_resume(program, wide)
    print("tokens/s:", flush=True)
    rates = loader_rates(program, wide, args.seconds)
    print("step time:", flush=True)
    ratio, synthetic_seconds = step_time_ratio(tiny, tiny_data)
    print_table(rates, ratio, synthetic_seconds, grain_state)


if __name__ == "__main__":
    main()
