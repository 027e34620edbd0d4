"""`axgen report`: metrics.jsonl drawn as a PNG and summed up as a table; resumed runs; one-line errors."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

from axgen.analysis import report
from axgen.files import OutputError
from axgen.analysis.report import ReportError, load_metrics, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def loss_at(step: int) -> float:
    return 5 * math.exp(-step / 100)


def eval_loss_at(step: int) -> float:
    # Lowest at step 300, so the best eval is not simply the last one.
    return 1.0 + (step - 300) ** 2 / 1e5


def tokens_per_second_at(step: int) -> float:
    return 10_000 + 37 * (step % 7) - step


def train_record(step: int, elapsed_s: float, loss: float | None = None) -> dict:
    record = {
        "step": step,
        "elapsed_s": elapsed_s,
        "loss": loss_at(step) if loss is None else loss,
        "cross_entropy": loss_at(step),
        "grad_norm": 0.5,
        "lr": 1e-3 * min(1.0, step / 50),
        "tokens": 4096 * step,
        "load_balance": 1.02,
    }
    if step > 0:  # the first step's record includes compilation, so it carries no throughput
        record |= {
            "tokens_per_second": tokens_per_second_at(step),
            "mfu": tokens_per_second_at(step) / 1e6,
            "memory_bytes": 2**30 + 1000 * step,
        }
    return record


def eval_record(step: int, elapsed_s: float, eval_loss: float | None = None) -> dict:
    eval_loss = eval_loss_at(step) if eval_loss is None else eval_loss
    return {
        "step": step,
        "elapsed_s": elapsed_s,
        "eval_loss": eval_loss,
        "eval_perplexity": math.exp(eval_loss),
        "eval_tokens": 40960,
    }


def segment(first: int, last: int, clock_offset: float = 0.0, loss_scale: float = 1.0) -> list[dict]:
    """One run of the program from `first` to `last`, evaluating every 100 steps; its clock starts at zero."""
    records = []
    for step in range(first, last + 1, 10):
        elapsed = step - first + clock_offset
        records.append(train_record(step, elapsed, loss_scale * loss_at(step)))
        if step % 100 == 0 and step > 0:
            records.append(eval_record(step, elapsed + 0.25, loss_scale * eval_loss_at(step)))
    return records


def write_metrics(run_dir: Path, records: list, raw_lines: dict[int, str] | None = None) -> Path:
    """Writes the records one per line; `raw_lines` puts verbatim text at given (1-based) line numbers."""
    lines = [json.dumps(r) for r in records]
    for number, text in sorted((raw_lines or {}).items()):
        lines.insert(number - 1, text)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def table_rows(table: str) -> dict[str, str]:
    """{label: value}; labels and values are separated by at least two spaces."""
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in table.splitlines())


def numbers(text: str) -> list[float]:
    return [float(n) for n in NUMBER.findall(text.replace(",", ""))]


def test_plain_run_draws_a_png_and_sums_up_the_run(tmp_path):
    run_dir = tmp_path / "llama-cpu8"
    records = segment(0, 500)
    write_metrics(run_dir, records)

    png, table = write_report(run_dir)

    assert png == run_dir / "report.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    pixels = imread(png)
    assert pixels.shape[0] >= 600 and pixels.shape[1] >= 600
    assert np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0).shape[0] > 20  # curves, not a blank page
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "report.png"]  # no temp file left

    rows = table_rows(table)
    steps = list(range(0, 501, 10))
    assert numbers(rows["steps"]) == [0, 500]
    first, last, lowest = numbers(rows["loss"])
    assert first == pytest.approx(loss_at(0), rel=1e-3)
    assert last == pytest.approx(loss_at(500), rel=1e-3)
    assert lowest == pytest.approx(min(loss_at(s) for s in steps), rel=1e-3)
    best_loss, best_step = numbers(rows["best eval loss"])
    assert (best_loss, best_step) == (pytest.approx(1.0, rel=1e-3), 300)
    assert numbers(rows["final eval perplexity"])[0] == pytest.approx(math.exp(eval_loss_at(500)), rel=1e-3)
    median_speed = float(np.median([tokens_per_second_at(s) for s in steps if s > 0]))
    assert numbers(rows["median tokens/s"])[0] == pytest.approx(median_speed, abs=0.5)
    assert numbers(rows["median MFU"])[0] == pytest.approx(100 * median_speed / 1e6, abs=0.005)
    assert numbers(rows["peak memory"])[0] == pytest.approx((2**30 + 1000 * 500) / 2**30, abs=0.005)
    assert rows["wall time"] == "8m 20s"  # the last record's elapsed_s: 500.25 s
    assert rows["resumes"] == "0"


def test_the_table_columns_line_up(tmp_path):
    write_metrics(tmp_path, segment(0, 200))
    _, table = write_report(tmp_path)
    value_columns = {len(line) - len(re.split(r"\s{2,}", line, maxsplit=1)[1]) for line in table.splitlines()}
    assert len(value_columns) == 1


def test_resumed_run_keeps_the_last_record_of_each_step_and_sums_its_segments(tmp_path):
    # Crashed after step 300; resumed from the step-200 checkpoint, crashed after 400; resumed from 400 to 500.
    first = segment(0, 300, loss_scale=1.0)
    second = segment(200, 400, clock_offset=3.0, loss_scale=0.9)
    third = segment(400, 500, clock_offset=2.5, loss_scale=0.8)
    write_metrics(tmp_path, first + second + third)

    train, evals = load_metrics(tmp_path)
    assert [r["step"] for r in train] == list(range(0, 501, 10))
    assert [r["step"] for r in evals] == [100, 200, 300, 400, 500]
    by_step = {r["step"]: r["loss"] for r in train}
    assert by_step[100] == pytest.approx(loss_at(100))
    assert by_step[300] == pytest.approx(
        0.9 * loss_at(300)
    )  # the resumed run's step 300, not the first run's
    assert by_step[400] == pytest.approx(0.8 * loss_at(400))
    assert {r["step"]: r["eval_loss"] for r in evals}[300] == pytest.approx(0.9 * eval_loss_at(300))

    _, table = write_report(tmp_path)
    rows = table_rows(table)
    assert rows["resumes"] == "2"
    wall_seconds = (300 + 0.25) + (200 + 3.0 + 0.25) + (100 + 2.5 + 0.25)  # each segment ends on an eval
    assert wall_seconds == 606.25
    assert rows["wall time"] == "10m 06s"
    assert numbers(rows["loss"])[1] == pytest.approx(0.8 * loss_at(500), rel=1e-3)


def test_records_come_back_in_step_order_whatever_the_file_order(tmp_path):
    write_metrics(tmp_path, list(reversed(segment(0, 300))))
    train, evals = load_metrics(tmp_path)
    assert [r["step"] for r in train] == list(range(0, 301, 10))
    assert [r["step"] for r in evals] == [100, 200, 300]


def test_what_the_log_lacks_reads_as_a_dash(tmp_path):
    # A CPU run with only step records: no throughput, no MFU, no memory, no evaluation.
    bare = [{"step": s, "elapsed_s": 0.1 * s, "loss": loss_at(s), "lr": 1e-3} for s in range(0, 50, 10)]
    write_metrics(tmp_path, bare)
    png, table = write_report(tmp_path, tmp_path / "plots" / "run.png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    rows = table_rows(table)
    for label in ("best eval loss", "final eval perplexity", "median tokens/s", "median MFU", "peak memory"):
        assert rows[label] == "-", label
    assert rows["wall time"] == "4.0s"


def test_null_throughput_fields_are_skipped(tmp_path):
    records = segment(0, 100)
    for record in records:
        record.setdefault("tokens_per_second", None)
        record.setdefault("mfu", None)
        record.setdefault("memory_bytes", None)
    write_metrics(tmp_path, records)
    _, table = write_report(tmp_path)
    speeds = [tokens_per_second_at(s) for s in range(10, 101, 10)]
    assert numbers(table_rows(table)["median tokens/s"])[0] == pytest.approx(np.median(speeds), abs=0.5)


def test_report_is_deterministic(tmp_path):
    write_metrics(tmp_path, segment(0, 300))
    first, _ = write_report(tmp_path, tmp_path / "a.png")
    second, _ = write_report(tmp_path, tmp_path / "b.png")
    assert first.read_bytes() == second.read_bytes()


@pytest.mark.parametrize(
    ("losses", "scale"),
    [([5.0 * math.exp(-s / 100) for s in range(0, 500, 10)], "log"), ([3.0, 2.5, 2.2, 2.1], "linear")],
)
def test_loss_axis_is_logarithmic_only_when_the_loss_spans_more_than_ten_times(losses, scale):
    train = [{"step": i, "loss": loss} for i, loss in enumerate(losses)]
    figure = report._figure("run", train, [])
    assert figure.axes[0].get_yscale() == scale


BAD_LINES = [
    ("not json", '{"step": 20, "loss": 3.0', "not valid JSON"),
    ("not an object", "[20, 3.0]", 'expected a JSON object with an integer "step"'),
    ("no step", '{"loss": 3.0, "elapsed_s": 1.0}', 'expected a JSON object with an integer "step"'),
    ("step not an integer", '{"step": "20", "loss": 3.0}', 'expected a JSON object with an integer "step"'),
    ("step a float", '{"step": 20.0, "loss": 3.0}', 'expected a JSON object with an integer "step"'),
    ("loss not a number", '{"step": 20, "loss": "3.0"}', '"loss" must be a number or null'),
]


@pytest.mark.parametrize(("name", "line", "message"), BAD_LINES, ids=[b[0] for b in BAD_LINES])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, name, line, message):
    path = write_metrics(tmp_path, segment(0, 100), raw_lines={4: line})
    for call in (load_metrics, write_report):
        with pytest.raises(ReportError) as caught:
            call(tmp_path)
        text = str(caught.value)
        assert text.startswith(f"{path}:4: ") and message in text
        assert "\n" not in text
    assert not (tmp_path / "report.png").exists()


def test_missing_run_directory(tmp_path):
    with pytest.raises(ReportError, match=re.escape(f"{tmp_path / 'nowhere'}: no such run directory")):
        write_report(tmp_path / "nowhere")


def test_missing_metrics_file(tmp_path):
    with pytest.raises(ReportError, match=re.escape(f"{tmp_path / 'metrics.jsonl'}: no such file")):
        write_report(tmp_path)


def test_no_training_records(tmp_path):
    path = write_metrics(tmp_path, [eval_record(100, 10.0)], raw_lines={1: ""})
    with pytest.raises(ReportError, match=re.escape(f"{path}: no training records")):
        write_report(tmp_path)
    assert not (tmp_path / "report.png").exists()


def test_a_failed_draw_leaves_no_file_behind(tmp_path, monkeypatch):
    write_metrics(tmp_path, segment(0, 100))

    def half_written(figure, f, **kwargs):
        f.write(b"\x89PNG half")
        raise RuntimeError("renderer died")

    monkeypatch.setattr(Figure, "savefig", half_written)
    with pytest.raises(RuntimeError, match="renderer died"):
        write_report(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_an_unwritable_output_is_an_output_error(tmp_path):
    write_metrics(tmp_path, segment(0, 100))
    (tmp_path / "taken").mkdir()
    with pytest.raises(OutputError, match=re.escape(f"{tmp_path / 'taken'}: cannot write")):
        write_report(tmp_path, tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "taken"]


def start_record(step: int, began: str) -> dict:
    schedule = [[s, 1e-3 * min(1.0, s / 20)] for s in range(0, 1001)]
    run = {
        "model": "llama-tiny",
        "target": "gpu-h100-8",
        "devices": 8,
        "began": began,
        "lr_schedule": schedule,
    }
    return {"step": step, "run": run}


def test_the_report_names_the_run_draws_its_schedule_and_marks_each_resume(tmp_path):
    records = [start_record(0, "initialised from seed"), *segment(0, 200)]
    records += [start_record(200, "resumed from step 200"), *segment(200, 500)]
    write_metrics(tmp_path, records)
    train, evals = report.load_metrics(tmp_path)

    starts = [r for r in records if "run" in r]
    figure = report._figure(report._title(starts[-1]["run"]), train, evals, starts)
    assert figure._suptitle.get_text() == "llama-tiny on gpu-h100-8 (8 devices)"
    titles = [axes.get_title() for axes in figure.axes]
    assert titles == [
        "loss",
        "throughput",
        "model FLOPs utilisation",
        "learning rate",
    ], "MFU has its own panel"
    for axes in figure.axes:  # the resume, across every panel
        assert any(list(line.get_xdata()) == [200, 200] for line in axes.get_lines()), axes.get_title()
    schedule = next(line for line in figure.axes[-1].get_lines() if line.get_label() == "schedule")
    assert list(schedule.get_xdata()) == list(range(0, 501)), "every step of the schedule the run reached"
    assert schedule.get_ydata()[20] == pytest.approx(1e-3) and schedule.get_ydata()[10] == pytest.approx(5e-4)

    png, table = write_report(tmp_path)
    assert table_rows(table)["resumes"] == "1"


def test_a_run_without_mfu_has_no_mfu_panel():
    train = [{"step": s, "loss": 3.0 - s / 100, "tokens_per_second": 1000.0} for s in range(1, 50)]
    figure = report._figure("run", train, [], [])
    assert [axes.get_title() for axes in figure.axes] == ["loss", "throughput", "learning rate"]
