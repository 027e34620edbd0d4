"""The run's log: the terminal's progress line, RUN_DIR/metrics.jsonl and TensorBoard."""

import json
import math
import os
import time

import jax
import jax.numpy as jnp
import tensorboardX


class MetricsLog:
    """Records for RUN_DIR/metrics.jsonl (appended to, so a resumed run continues it) and for TensorBoard, from
    process 0 only; `axgen report RUN_DIR` draws them. The files open with the first record, and close when the
    context ends, however it ends: TensorBoard's writer thread must stop before the interpreter does."""

    def __init__(self, run_dir):
        self.run_dir, self.jsonl, self.tensorboard = run_dir, None, None

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        if self.jsonl is not None:
            self.jsonl.close()
            self.tensorboard.close()

    def start(self, step, **run):
        """One record as a run starts or resumes (`{"step": N, "run": {...}}`): what ran and how it began, and
        its learning-rate schedule, so a report draws the rate at every step, not only at the logged ones."""
        if jax.process_index() == 0:
            self._append({"step": step, "run": run})

    def write(self, step, **values):
        if jax.process_index() != 0:
            return
        record = {"step": step, **{name: value for name, value in values.items() if value is not None}}
        self._append(record)
        for name, value in record.items():
            if name != "step":
                self.tensorboard.add_scalar(name, value, step)

    def _append(self, record):
        if self.jsonl is None:
            self.jsonl = open(os.path.join(self.run_dir, "metrics.jsonl"), "a")
            self.tensorboard = tensorboardX.SummaryWriter(os.path.join(self.run_dir, "tensorboard"))
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()


# Points of the learning-rate schedule a run's start record holds: every step up to this many, else evenly spaced
# ones with the end of warmup among them.
SCHEDULE_POINTS = 1000


def schedule_points(learning_rate, steps, warmup_steps):
    """[[step, rate], ...] of the schedule over the run's steps (the rate a step trains with is at its index)."""
    stride = max(1, steps // SCHEDULE_POINTS)
    points = sorted({*range(0, steps + 1, stride), min(warmup_steps, steps), steps})
    rates = jax.device_get(learning_rate(jnp.asarray(points)))
    return [[step, float(rate)] for step, rate in zip(points, rates)]


class Progress:
    """The progress line (loss, learning rate, gradient norm, tokens/s, MFU, time left, the targets the step
    trained) and the metrics log's records. Throughput counts from the first step's end; MFU is against `peak_flops_per_device`.
    """

    def __init__(
        self, log, start, end, tokens_per_step, flops_per_token, peak_flops_per_device, logged_metrics
    ):
        self.log, self.end, self.tokens_per_step = log, end, tokens_per_step
        self.flops_per_token, self.peak_flops_per_device = flops_per_token, peak_flops_per_device
        self.logged_metrics = logged_metrics
        self.began = self.last_time = time.perf_counter()
        self.first = self.last_step = start

    def train(self, step, metrics):
        now = time.perf_counter()
        if step == self.first + 1:
            throughput, speed = f"first step in {now - self.began:.1f}s", {}
        else:
            seconds_per_step = (now - self.last_time) / (step - self.last_step)
            tokens_per_second = self.tokens_per_step / seconds_per_step
            left = (self.end - step) * seconds_per_step
            throughput, speed = f"tokens/s {tokens_per_second:.0f}", {"tokens_per_second": tokens_per_second}
            if (
                self.peak_flops_per_device is not None
            ):  # None: no chip's published peak (a CPU) to measure against
                mfu = (
                    tokens_per_second
                    * self.flops_per_token
                    / (jax.device_count() * self.peak_flops_per_device)
                )
                throughput, speed["mfu"] = f"{throughput} | mfu {mfu:.2%}", mfu
            throughput += f" | {left:.0f}s left"
        self.last_time, self.last_step = now, step
        print(
            f"step {step} | loss {metrics['loss']:.4f} | grad_norm {metrics['grad_norm']:.3f}"
            f" | lr {metrics['lr']:.2e} | {throughput}"
            + "".join(f" | {name} {metrics[name]:.4f}" for name in self.logged_metrics)
            + f" | targets {int(metrics['targets'])}",
            flush=True,
        )
        values = {name: float(value) for name, value in metrics.items()}
        self.log.write(
            step,
            elapsed_s=now - self.began,
            tokens=step * self.tokens_per_step,
            memory_bytes=device_memory(),
            **values,
            **speed,
        )

    def eval(self, step, loss, targets, pairs=False):
        """An evaluation's mean loss over its targets, or over its preference `pairs` (a loss of no perplexity)."""
        elapsed = time.perf_counter() - self.began
        if pairs:
            print(f"eval step {step} | loss {loss:.4f} | pairs {targets}", flush=True)
            self.log.write(step, elapsed_s=elapsed, eval_loss=loss, eval_pairs=targets)
            return
        print(
            f"eval step {step} | loss {loss:.4f} | perplexity {math.exp(loss):.2f} | targets {targets}",
            flush=True,
        )
        self.log.write(
            step, elapsed_s=elapsed, eval_loss=loss, eval_perplexity=math.exp(loss), eval_tokens=targets
        )


def device_memory():
    """Peak bytes in use on this process's first device, or None where the platform does not say (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return stats.get("peak_bytes_in_use") if stats else None
