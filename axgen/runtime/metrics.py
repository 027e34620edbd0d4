"""The run's log: the terminal's progress line, RUN_DIR/metrics.jsonl and TensorBoard."""

import json
import math
import os
import time

import jax
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

    def write(self, step, **values):
        if jax.process_index() != 0:
            return
        if self.jsonl is None:
            self.jsonl = open(os.path.join(self.run_dir, "metrics.jsonl"), "a")
            self.tensorboard = tensorboardX.SummaryWriter(os.path.join(self.run_dir, "tensorboard"))
        record = {"step": step, **{name: value for name, value in values.items() if value is not None}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for name, value in record.items():
            if name != "step":
                self.tensorboard.add_scalar(name, value, step)


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
            mfu = tokens_per_second * self.flops_per_token / (jax.device_count() * self.peak_flops_per_device)
            left = (self.end - step) * seconds_per_step
            throughput = f"tokens/s {tokens_per_second:.0f} | mfu {mfu:.2%} | {left:.0f}s left"
            speed = {"tokens_per_second": tokens_per_second, "mfu": mfu}
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

    def eval(self, step, loss, targets):
        print(
            f"eval step {step} | loss {loss:.4f} | perplexity {math.exp(loss):.2f} | targets {targets}",
            flush=True,
        )
        elapsed = time.perf_counter() - self.began
        self.log.write(
            step, elapsed_s=elapsed, eval_loss=loss, eval_perplexity=math.exp(loss), eval_tokens=targets
        )


def device_memory():
    """Peak bytes in use on this process's first device, or None where the platform does not say (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return stats.get("peak_bytes_in_use") if stats else None
