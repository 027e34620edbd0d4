"""`axgen report`: a training run's metrics log drawn as a PNG, and summed up as a plain-text table.

Every emitted program appends one JSON object per line to RUN_DIR/metrics.jsonl: training records (with "loss")
and evaluation records (with "eval_loss"). A resumed run appends to the same file and logs again the steps after
its checkpoint, and restarts its clock; so the last record of a step wins, and each drop of "elapsed_s" marks a
new run segment whose time adds to the total.
"""

from __future__ import annotations

import io
import json
import math
import statistics
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from axgen.files import write_atomically

METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.png"
# Numeric fields the report reads; each may be absent or null (no throughput on the first step, no memory on CPUs).
NUMERIC_FIELDS = (
    "elapsed_s",
    "loss",
    "lr",
    "tokens_per_second",
    "mfu",
    "memory_bytes",
    "eval_loss",
    "eval_perplexity",
)
# A loss curve spanning more than this ratio is drawn on a log scale, where its late, slow descent stays visible.
LOG_SCALE_RATIO = 10.0
MISSING = "-"


class ReportError(ValueError):
    """A run directory or metrics log that cannot be reported on; the message is one line naming the file."""


def load_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records), each with one record per step (the last logged) in step order."""
    return _latest_per_step(_read_records(_metrics_path(run_dir)))


def write_report(run_dir: Path, out: Path | None = None) -> tuple[Path, str]:
    """Draws the run's curves into `out` (default RUN_DIR/report.png); returns (that path, the summary table)."""
    path = _metrics_path(run_dir)
    records = _read_records(path)
    train, evals = _latest_per_step(records)
    if not train:
        raise ReportError(f'{path}: no training records (no line has a "loss")')
    out = Path(out) if out is not None else Path(run_dir) / REPORT_FILE
    _save_png(_figure(Path(run_dir).resolve().name, train, evals), out)
    return out, _summary_table(train, evals, _segment_seconds(records))


def _metrics_path(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ReportError(f"{path}: no such file (training programs write it into their run directory)")
    return path


def _read_records(path: Path) -> list[dict]:
    """Every record in file order, checked; blank lines are skipped."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as err:
        raise ReportError(f"{path}: cannot read ({err.strerror})") from None
    return [_parse_line(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]


def _parse_line(path: Path, number: int, line: bytes) -> dict:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except UnicodeDecodeError:
        raise ReportError(f"{where}: not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise ReportError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict) or not _is_int(record.get("step")):
        raise ReportError(f'{where}: expected a JSON object with an integer "step"')
    for field in NUMERIC_FIELDS:
        value = record.get(field)
        if value is not None and not _is_number(value):
            raise ReportError(f'{where}: "{field}" must be a number or null, not {json.dumps(value)}')
    return record


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _latest_per_step(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """Records that are neither kind (a field a later program may log on its own line) are left out."""
    train, evals = {}, {}
    for record in records:
        if "eval_loss" in record:
            evals[record["step"]] = record
        elif "loss" in record:
            train[record["step"]] = record
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def _segment_seconds(records: list[dict]) -> list[float]:
    """Wall seconds of each run segment, in file order; a segment starts where the clock goes back."""
    segments: list[float] = []
    previous = None
    for record in records:
        elapsed = record.get("elapsed_s")
        if elapsed is None:
            continue
        if previous is None or elapsed < previous:
            segments.append(elapsed)
        segments[-1] = elapsed
        previous = elapsed
    return segments


def _summary_table(train: list[dict], evals: list[dict], segment_seconds: list[float]) -> str:
    """Two aligned columns, label and value; what the log lacks reads "-"."""
    losses = _finite(_column(train, "loss"))
    best_eval = min(
        (r for r in evals if _is_finite(r["eval_loss"])), key=lambda r: r["eval_loss"], default=None
    )
    memory = _finite(_column(train, "memory_bytes"))
    rows = [
        ("steps", f"{train[0]['step']} → {train[-1]['step']}"),
        ("loss", f"{_g(train[0]['loss'])} → {_g(train[-1]['loss'])} (min {_g(min(losses, default=None))})"),
        (
            "best eval loss",
            f"{_g(best_eval['eval_loss'])} at step {best_eval['step']}" if best_eval else MISSING,
        ),
        ("final eval perplexity", _g(evals[-1].get("eval_perplexity")) if evals else MISSING),
        ("median tokens/s", _median(_column(train, "tokens_per_second"), "{:,.0f}")),
        ("median MFU", _median(_column(train, "mfu"), "{:.2%}")),
        ("peak memory", f"{max(memory) / 2**30:.2f} GiB" if memory else MISSING),
        ("wall time", _duration(sum(segment_seconds)) if segment_seconds else MISSING),
        ("resumes", str(len(segment_seconds) - 1) if segment_seconds else MISSING),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows) + "\n"


def _column(records: list[dict], field: str) -> list:
    return [r[field] for r in records if r.get(field) is not None]


def _finite(values: list) -> list:
    """A diverged run logs NaN or Infinity, which would poison a min or a median."""
    return [v for v in values if _is_finite(v)]


def _is_finite(value) -> bool:
    return value is not None and math.isfinite(value)


def _g(value) -> str:
    return MISSING if value is None else f"{value:#.4g}"


def _median(values: list, template: str) -> str:
    finite = _finite(values)
    return template.format(statistics.median(finite)) if finite else MISSING


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _figure(title: str, train: list[dict], evals: list[dict]) -> Figure:
    # A bare Figure with its own Agg canvas: no pyplot, so no global backend switch and no figure registry.
    figure = Figure(figsize=(10, 11), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, speed_axes, lr_axes = figure.subplots(3, 1, sharex=True)
    _draw_loss(loss_axes, train, evals)
    _draw_throughput(speed_axes, train)
    _draw_learning_rate(lr_axes, train)
    lr_axes.set_xlabel("step")
    figure.suptitle(title, fontsize=14)
    return figure


def _draw_loss(axes: Axes, train: list[dict], evals: list[dict]) -> None:
    axes.plot(*_series(train, "loss"), label="training loss", linewidth=1.2)
    if evals:
        axes.plot(*_series(evals, "eval_loss"), "o-", label="eval loss", markersize=4)
    losses = _finite(_column(train, "loss") + _column(evals, "eval_loss"))
    if losses and min(losses) > 0 and max(losses) / min(losses) > LOG_SCALE_RATIO:
        axes.set_yscale("log")
    axes.set_title("loss")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    axes.legend()


def _draw_throughput(axes: Axes, train: list[dict]) -> None:
    axes.set_title("throughput")
    axes.set_ylabel("tokens/s")
    axes.grid(alpha=0.3)
    steps, speeds = _series(train, "tokens_per_second")
    if not steps:
        _say_none_logged(axes, "no throughput logged")
        return
    lines = axes.plot(steps, speeds, label="tokens/s", color="tab:blue")
    mfu_steps, mfus = _series(train, "mfu")
    if mfu_steps:
        mfu_axes = axes.twinx()
        lines += mfu_axes.plot(mfu_steps, [100 * m for m in mfus], label="MFU", color="tab:orange")
        mfu_axes.set_ylabel("MFU (%)")
    axes.legend(lines, [line.get_label() for line in lines], loc="lower right")


def _draw_learning_rate(axes: Axes, train: list[dict]) -> None:
    axes.set_title("learning rate")
    axes.set_ylabel("lr")
    axes.grid(alpha=0.3)
    steps, rates = _series(train, "lr")
    if not steps:
        _say_none_logged(axes, "no learning rate logged")
        return
    axes.plot(steps, rates, color="tab:green")
    axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))


def _series(records: list[dict], field: str) -> tuple[list, list]:
    present = [r for r in records if r.get(field) is not None]
    return [r["step"] for r in present], [r[field] for r in present]


def _say_none_logged(axes: Axes, text: str) -> None:
    axes.text(0.5, 0.5, text, transform=axes.transAxes, ha="center", va="center", color="gray")


def _save_png(figure: Figure, out: Path) -> None:
    """Renders the whole PNG first, then writes it atomically: a failure in either never leaves half a PNG."""
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=100)
    write_atomically(out, png.getvalue())
