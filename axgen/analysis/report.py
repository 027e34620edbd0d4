"""`axgen report`: a training run's metrics log drawn as a PNG, and summed up as a plain-text table.

Every emitted program appends one JSON object per line to RUN_DIR/metrics.jsonl: a start record as it starts or
resumes (with "run": the model, the target, how it began, its learning-rate schedule), training records (with
"loss") and evaluation records (with "eval_loss"). A resumed run appends to the same file and logs again the steps
after its checkpoint, and restarts its clock; so the last record of a step wins, and each drop of "elapsed_s"
marks a new run segment whose time adds to the total.
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
    starts = [r for r in records if "run" in r]
    title = _title(starts[-1]["run"]) if starts else Path(run_dir).resolve().name  # a log from before 0.8
    _save_png(_figure(title, train, evals, starts), out)
    return out, _summary_table(train, evals, _segment_seconds(records))


def _title(run: dict) -> str:
    return f"{run.get('model', '?')} on {run.get('target', '?')} ({run.get('devices', '?')} devices)"


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
    if "run" in record and not isinstance(record["run"], dict):
        raise ReportError(f'{where}: "run" must be a JSON object, not {json.dumps(record["run"])[:60]}')
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


def _figure(title: str, train: list[dict], evals: list[dict], starts: list[dict] = ()) -> Figure:
    """Loss, throughput, MFU (where the run logged one: a chip with a published peak) and the learning rate, one
    panel each over the same steps; each start after the first (a resume) is a dashed line across all of them.
    """
    # A bare Figure with its own Agg canvas: no pyplot, so no global backend switch and no figure registry.
    with_mfu = bool(_series(train, "mfu")[0])
    figure = Figure(figsize=(10, 14 if with_mfu else 11), layout="constrained")
    FigureCanvasAgg(figure)
    panels = list(figure.subplots(4 if with_mfu else 3, 1, sharex=True))
    _draw_loss(panels[0], train, evals)
    _draw_throughput(panels[1], train)
    if with_mfu:
        _draw_mfu(panels[2], train)
    _draw_learning_rate(panels[-1], train, starts[-1]["run"].get("lr_schedule") if starts else None)
    for start in starts[1:]:
        for axes in panels:
            axes.axvline(start["step"], color="gray", linestyle="--", linewidth=1)
        panels[0].annotate(
            f"resumed at {start['step']}",
            (start["step"], 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            color="gray",
            fontsize=8,
        )
    panels[-1].set_xlabel("step")
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
    axes.plot(steps, speeds, color="tab:blue")


def _draw_mfu(axes: Axes, train: list[dict]) -> None:
    axes.set_title("model FLOPs utilisation")
    axes.set_ylabel("MFU (%)")
    axes.grid(alpha=0.3)
    steps, mfus = _series(train, "mfu")
    axes.plot(steps, [100 * m for m in mfus], color="tab:orange")


def _draw_learning_rate(axes: Axes, train: list[dict], schedule: list | None) -> None:
    """The schedule the run trained with, at every step (from its start record), with the logged rates on it;
    only the logged rates for a log that has no schedule."""
    axes.set_title("learning rate")
    axes.set_ylabel("lr")
    axes.grid(alpha=0.3)
    steps, rates = _series(train, "lr")
    if schedule:
        last = max(steps, default=schedule[-1][0])
        drawn = [(step, rate) for step, rate in schedule if step <= last]
        axes.plot(*zip(*drawn), color="tab:green", label="schedule")
    if steps:
        axes.plot(steps, rates, "o", color="tab:green", markersize=3, label="logged")
    if not steps and not schedule:
        _say_none_logged(axes, "no learning rate logged")
        return
    axes.legend(loc="upper right")
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
