"""`axgen build | graph | explain | aot | plan | targets | corpus | data | tokenizer train | report | import-hf |
convert-hf | export-hf`: the command line.
Errors are one line and exit 2."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import re
import shutil
import signal
import sys
import threading
import time
import typing
from datetime import date
from pathlib import Path

import axgen
from axgen import progress
from axgen.files import (
    check_not_stopped,
    check_output_dir,
    check_output_file,
    forget_signals,
    publish_dir,
    staging_dir,
    stop_on_signal,
    write_atomically,
)
from axgen.loader import bundled_specs, load_spec, spec_path
from axgen.spec import MESH_AXES, Model, SpecError

# A command imports what it needs when it runs (jax, the compiler's templates, the data tools take seconds to
# import), so `axgen --help` and `axgen targets` answer at once.

GENERATED = Path("generated")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    progress.enabled = not getattr(args, "quiet", False)
    # SIGTERM (a scheduler's or `kill`'s stop) ends a command as Ctrl-C does: what it was writing is staged and
    # removed on the way out, never left half-made beside its output. Only the main thread may set a handler.
    main_thread = threading.current_thread() is threading.main_thread()
    stops = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
    previous = {number: signal.signal(number, stop_on_signal) for number in stops}
    forget_signals()
    # A stop's KeyboardInterrupt raised while a garbage-collection callback runs is dropped, and Python's hook would
    # print it as a traceback ("Exception ignored in: <function _xla_gc_callback ...>"); the stop is recorded and
    # raised again (check_not_stopped), so it is not printed.
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: (
        None if isinstance(unraisable.exc_value, KeyboardInterrupt) else hook(unraisable)
    )
    try:
        result = args.run(args)
        check_not_stopped()  # a stop whose KeyboardInterrupt was dropped still ends the command as one
        return result
    except _user_errors() as err:
        _print_error(err)
        return 2
    except KeyboardInterrupt:
        print("axgen: interrupted", file=sys.stderr)
        return 130
    finally:
        # A process that goes on (a test, a notebook) gets its own handlers back, and writes after this command
        # are not stopped by the stop that ended it.
        for number, handler in previous.items():
            signal.signal(number, handler)
        sys.unraisablehook = hook
        forget_signals()


# The errors a command reports as one line (exit 2), by module. Only a module a command has imported can have
# raised one, so the others are not imported to be caught.
USER_ERRORS = {
    "axgen.spec.validation": "SpecError",
    "axgen.ir.graph": "GraphError",
    "axgen.passes.manager": "PassError",
    "axgen.analysis.aot": "AotError",
    "axgen.analysis.extras": "MissingExtra",
    "axgen.analysis.plan": "PlanError",
    "axgen.analysis.report": "ReportError",
    "axgen.data.inputs": "DataError",
    "axgen.files": "OutputError",
    "axgen.hf.config": "HFImportError",
    "axgen.interop": "CheckpointError",
}


def _user_errors() -> tuple[type[Exception], ...]:
    return tuple(
        getattr(sys.modules[module], name) for module, name in USER_ERRORS.items() if module in sys.modules
    )


def _print_error(err: Exception) -> None:
    """One line whatever the message holds: an exception a spec raises itself may span several."""
    print("axgen: error: " + " ".join(str(err).splitlines()), file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line, as every axgen error is (its usage block left to --help)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _path(text: str) -> Path:
    """A path argument; an empty one would silently mean the current directory."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path names nothing")
    return Path(text)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _nonnegative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:  # false for nan too
        raise argparse.ArgumentTypeError(f"must be >= 0 and < 1, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="axgen", description="Compile a model spec into a JAX training program.")
    parser.add_argument("--version", action="version", version=f"axgen {axgen.__version__}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    # What the commands that can run for minutes take: their progress shows on a terminal, unless --quiet.
    quiet = _Parser(add_help=False)
    quiet.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar (shown only on a terminal)"
    )

    b = sub.add_parser(
        "build", help="emit the program of a spec for a target (or of every spec x target)", parents=[quiet]
    )
    b.add_argument(
        "spec", nargs="?", help="spec file, or a bundled spec's name: specs/my_model.py, llama2_7b"
    )
    b.add_argument("--target", help="e.g. gpu-h100-8; default: every target the spec declares")
    b.add_argument("--out", type=_path, help="output file (default generated/<spec>/<target>.py)")
    b.add_argument(
        "--all", action="store_true", help="every bundled spec (axgen/specs/) for each of its targets"
    )
    b.add_argument("--check", action="store_true", help="write nothing; exit 1 if generated/ is stale")
    b.add_argument(
        "--force", action="store_true", help="replace an existing file that is not a program of this spec"
    )
    b.set_defaults(run=_build)

    g = sub.add_parser("graph", help="print the IR of a spec: as built, after its feature passes, or lowered")
    g.add_argument("spec")
    g.add_argument("--target", help="whose lowering to show (default: the spec's first target)")
    g.add_argument(
        "--after",
        choices=("spec", "passes", "lowering"),
        default="lowering",
        help="the graph as the spec builds it, after the feature passes, or after the target's lowering (default)",
    )
    g.set_defaults(run=_graph)

    e = sub.add_parser(
        "explain", help="per pass: nodes rewritten, layers touched, and the pass's lines of code"
    )
    e.add_argument("spec")
    e.add_argument("--target", help="default: the spec's first target")
    e.set_defaults(run=_explain)

    a = sub.add_parser(
        "aot", help="compile a program's train step for its target's chips without them", parents=[quiet]
    )
    a.add_argument(
        "spec", nargs="?", help="spec file, or a bundled spec's name: specs/my_model.py, llama2_7b"
    )
    a.add_argument("--target", help="default: every target the spec declares")
    a.add_argument(
        "--all", action="store_true", help="every bundled spec (axgen/specs/) for each of its targets"
    )
    a.add_argument("--json", action="store_true", help="one JSON object per program instead of text")
    a.add_argument(
        "--report", type=_path, help="also write a markdown table of the results, e.g. docs/aot.md"
    )
    a.add_argument("--timeout", type=_positive_float, help="seconds one compile may take")
    a.add_argument(
        "--dump-to",
        type=_path,
        metavar="DIR",
        help="also keep XLA's dumps of each program's train and eval steps (HLO before and after optimization, "
        "buffer assignment, live ranges) in DIR/SPEC/TARGET/",
    )
    a.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --report that is not an aot report, or an existing --dump-to folder",
    )
    a.set_defaults(run=_aot, out=None, check=False)

    pl = sub.add_parser(
        "plan", help="search mesh split x remat x microbatch (x splash block) by compiling; rank what fits"
    )
    pl.add_argument("spec", help="spec file, or a bundled spec's name: specs/my_model.py, llama2_7b")
    pl.add_argument("--target", required=True, help="e.g. tpu-v5e-256")
    pl.add_argument(
        "--mesh",
        type=_mesh,
        action="append",
        help="only this split, e.g. fsdp=256 or data=2,fsdp=-1 (repeatable; default: a search over splits)",
    )
    pl.add_argument("--max-compiles", type=_positive, default=40, help="compile budget (default 40)")
    pl.add_argument("--jobs", type=_positive, default=2, help="compiles at once (default 2)")
    pl.add_argument("--top", type=_positive, default=10, help="rows of the table (default 10)")
    pl.add_argument("--write", action="store_true", help="put the winner first among the spec's mesh rules")
    pl.set_defaults(run=_plan)

    sp = sub.add_parser("specs", help="list the bundled specs, which `axgen build NAME` builds by name")
    sp.set_defaults(run=_specs)

    t = sub.add_parser("targets", help="list the target patterns and their mesh rules")
    t.set_defaults(run=_targets)

    c = sub.add_parser("corpus", help="write the bundled demo corpus: one .txt document per stdlib module")
    c.add_argument("out", type=_path, help="directory to write into")
    c.add_argument("--force", action="store_true", help="write into an existing directory")
    c.set_defaults(run=_corpus)

    d = sub.add_parser(
        "data",
        help="tokenize text, JSON Lines or Parquet files into a sharded token dataset",
        parents=[quiet],
    )
    _input_arguments(d)
    d.add_argument("--tokenizer", type=_path, required=True, help="a Hugging Face tokenizer.json")
    d.add_argument("--out", type=_path, required=True, help="dataset directory to write")
    d.add_argument(
        "--eval-fraction", type=_fraction, default=0.01, help="chance a document goes to eval (0.01)"
    )
    d.add_argument("--seed", type=_nonnegative, default=0, help="seed of the train/eval split (0)")
    d.add_argument(
        "--shard-tokens", type=_positive, default=50_000_000, help="tokens that close a shard (50M)"
    )
    d.add_argument("--bos", metavar="TOKEN", help="default: tokenizer_config.json's, else a well-known name")
    d.add_argument("--eos", metavar="TOKEN", help="default: tokenizer_config.json's, else a well-known name")
    d.add_argument("--force", action="store_true", help="replace an existing dataset at --out")
    d.add_argument(
        "--chat",
        action="store_true",
        help="records are conversations ({role, content} messages), rendered with the chat template; a loss"
        " mask trains only the assistant's tokens",
    )
    d.add_argument(
        "--sharegpt",
        action="store_true",
        help="conversations in ShareGPT's form ({from, value}); implies --chat",
    )
    d.add_argument(
        "--pairs",
        action="store_true",
        help="records are preference pairs (prompt, chosen, rejected: text, or messages rendered with the chat"
        " template), tokenized as TRL's DPOTrainer does, for a spec with F.dpo or F.simpo",
    )
    d.add_argument(
        "--chat-template",
        metavar="T",
        help="chatml (built in), a .jinja file, or a name among tokenizer_config.json's templates (default: the"
        " tokenizer's own)",
    )
    d.add_argument(
        "--max-len",
        type=_positive,
        metavar="N",
        help="cut a longer conversation after its last assistant turn that ends within N tokens; drop it if none"
        " does (--pairs: leave out a pair whose two sequences together exceed N, the program's seq_len + 1)",
    )
    d.set_defaults(run=_data)

    tok = sub.add_parser("tokenizer", help="tokenizer tools").add_subparsers(required=True, metavar="ACTION")
    tt = tok.add_parser(
        "train", help="fit a byte-level BPE to the documents `axgen data` would read", parents=[quiet]
    )
    _input_arguments(tt)
    tt.add_argument("--vocab-size", type=int, required=True, help="tokens: 256 bytes, 2 special, merges")
    tt.add_argument("--out", type=_path, required=True, help="tokenizer.json (tokenizer_config.json beside)")
    tt.add_argument(
        "--force", action="store_true", help="replace an existing --out and its tokenizer_config.json"
    )
    tt.set_defaults(run=_tokenizer_train)

    r = sub.add_parser("report", help="draw a run's metrics.jsonl into a PNG and print a summary table")
    r.add_argument("run_dir", type=_path, help="the --run-dir of an emitted program's run")
    r.add_argument("--out", type=_path, help="PNG to write (default RUN_DIR/report.png)")
    r.add_argument("--force", action="store_true", help="replace an existing --out")
    r.set_defaults(run=_report)

    h = sub.add_parser("import-hf", help="write a spec file from a Hugging Face config.json")
    h.add_argument("config", type=_path, help="config.json, or a folder holding one")
    h.add_argument("--out", type=_path, required=True, help="spec file to write, e.g. specs/my_model.py")
    h.add_argument("--name", help="the model's name (default: from --out, my_model.py -> my-model)")
    h.add_argument(
        "--seq-len", type=_positive, help="Train.seq_len (default: max_position_embeddings, at most 4096)"
    )
    h.add_argument("--batch", type=_positive, default=8, help="Train.global_batch (8)")
    h.add_argument(
        "--lr", type=_positive_float, default=1e-5, help="peak learning rate (1e-5, for fine-tuning)"
    )
    h.add_argument("--steps", type=_positive, default=1000, help="Train.steps (1000)")
    h.add_argument("--target", action="append", help="a target to declare; repeat for more (default cpu-8)")
    h.add_argument("--force", action="store_true", help="replace an existing --out")
    h.set_defaults(run=_import_hf)

    w = sub.add_parser(
        "convert-hf",
        help="HF safetensors -> an orbax checkpoint the program takes with --init-from",
        parents=[quiet],
    )
    w.add_argument("spec", help="the spec the weights are for, e.g. written by `axgen import-hf`")
    w.add_argument(
        "--hf", type=_path, required=True, help="folder of model.safetensors or shards and their index"
    )
    w.add_argument("--out", type=_path, required=True, help="checkpoint directory to write")
    w.add_argument(
        "--adapter",
        type=_path,
        help="a PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) for a spec with "
        "F.lora: a run starts from its adapters (default: drawn from the seed)",
    )
    w.add_argument("--force", action="store_true", help="replace an existing --out")
    w.set_defaults(run=_convert_hf)

    x = sub.add_parser(
        "export-hf", help="a run's (or convert-hf's) params -> a Hugging Face model folder", parents=[quiet]
    )
    x.add_argument("spec", help="the spec the params are of")
    x.add_argument(
        "--ckpt", type=_path, required=True, help="a --run-dir (its newest checkpoint) or a convert-hf output"
    )
    x.add_argument("--out", type=_path, required=True, help="HF model folder to write")
    x.add_argument(
        "--dtype",
        choices=("bfloat16", "float32", "float16"),
        help="(default: the spec's checkpoint_dtype, the source checkpoint's, else bfloat16)",
    )
    x.add_argument(
        "--fused-experts",
        action="store_true",
        help="write routed experts as transformers 5 holds them in memory (default: one tensor per expert, as "
        "the family's published checkpoints)",
    )
    x.add_argument(
        "--base",
        type=_path,
        help="the published model folder the run started from: its config.json's keys are kept wherever the spec "
        "agrees (the spec's are written where it does not), its generation_config.json copied; pass the same "
        "folder as --tokenizer to copy its tokenizer too",
    )
    x.add_argument(
        "--tokenizer", type=_path, help="tokenizer.json (or its folder) to copy, with its config files"
    )
    x.add_argument(
        "--shard-gb", type=_positive_float, default=5.0, help="largest shard, GB (5, as save_pretrained)"
    )
    x.add_argument(
        "--chat-template",
        help="the chat template to write as chat_template.jinja: chatml, a .jinja file, or a named template of "
        "the tokenizer (as `axgen data --chat-template`; default: the tokenizer's own, if it has one)",
    )
    lora = x.add_mutually_exclusive_group()
    lora.add_argument(
        "--adapter",
        action="store_true",
        help="a spec with F.lora: write the run's adapters as a PEFT adapter folder, which "
        "PeftModel.from_pretrained loads onto the base",
    )
    lora.add_argument(
        "--merge",
        action="store_true",
        help="a spec with F.lora: write the base with the run's adapters merged into it (PEFT's merge_and_unload)",
    )
    x.add_argument("--force", action="store_true", help="replace an existing --out")
    x.set_defaults(run=_export_hf)
    return parser


def _input_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="files, directories, globs: .txt .jsonl .json .parquet")
    parser.add_argument(
        "--field",
        help="JSON Lines: the field of each record (text; messages with --chat, conversations with --sharegpt)",
    )
    parser.add_argument("--column", help="Parquet: the column (text; as --field with --chat, --sharegpt)")
    parser.add_argument("--doc-per-line", action="store_true", help="text: a document per non-empty line")
    parser.add_argument("--skip-bad", action="store_true", help="skip and count bad records, not stop")


def _read_options(args):
    from axgen.data.inputs import ReadOptions

    chat, sharegpt = getattr(args, "chat", False), getattr(args, "sharegpt", False)
    default = "conversations" if sharegpt else "messages" if chat else "text"
    return ReadOptions(args.field or default, args.column or default, args.doc_per_line, args.skip_bad)


class _Job(typing.NamedTuple):
    spec_file: Path
    spec: Model
    target: str
    out: Path


def _jobs(args) -> list[_Job]:
    """Every program the command covers."""
    from axgen.backends import family_for
    from axgen.build import default_output

    if args.all == bool(args.spec):
        raise SpecError("give a spec file or --all (not both)")
    if args.all and args.out:
        raise SpecError("--out names one program's file; --all writes each into generated/")
    spec_files = bundled_specs() if args.all else [spec_path(args.spec)]
    jobs = []
    for spec_file in spec_files:
        spec = load_spec(spec_file)
        for declared in spec.targets:  # a typo in a target this command does not build is a typo still
            family_for(spec, declared)
        targets = [args.target] if args.target else list(spec.targets)
        if args.out and len(targets) > 1:
            raise SpecError(
                f"--out names one file; {spec_file} declares {len(targets)} targets: pick one with --target"
            )
        for target in targets:
            family_for(spec, target)
            out = args.out or default_output(spec_file, target, GENERATED)
            jobs.append(_Job(spec_file, spec, target, out))
    return jobs


def _build(args) -> int:
    from axgen.build import program_header

    jobs = _jobs(args)
    if not args.check:
        for job in jobs:
            check_output_file(job.out, force=args.force, header=program_header(job.spec))
    stale = []
    # Formatting dominates and each program is independent: several are built one process per core, spawned (the
    # caller may hold threads, which fork could copy mid-lock).
    work = [(job.spec_file, job.target) for job in jobs]
    if len(work) > 1:
        with concurrent.futures.ProcessPoolExecutor(mp_context=multiprocessing.get_context("spawn")) as pool:
            sources = list(
                progress.bar(pool.map(_source, work), total=len(work), desc="building", unit="program")
            )
    else:
        sources = [_source(job) for job in work]
    for out, (source, warning) in zip((job.out for job in jobs), sources):
        if warning:
            print(f"axgen: warning: {warning}", file=sys.stderr)
        if args.check:
            if not out.is_file() or out.read_text() != source:
                stale.append(str(out))
        else:
            write_atomically(out, source)
            print(f"wrote {out}")
    if args.check and args.all:
        expected = {str(job.out) for job in jobs}
        stale += sorted(str(p) for p in GENERATED.glob("*/*.py") if str(p) not in expected)
    if stale:
        print("axgen: stale or unexpected generated files (run `make generate`):", file=sys.stderr)
        for path in stale:
            print(f"  {path}", file=sys.stderr)
        return 1
    if args.check:
        print(f"generated/ matches the compiler ({len(jobs)} programs)")
    return 0


def _source(job: tuple[str, str]) -> tuple[str, str | None]:
    """The program's text, and a warning where its mesh leaves params whole on every device."""
    from axgen.analysis.placement import uneven
    from axgen.build import build

    built = build(*job)
    return built.source, uneven(built)


def _graph(args) -> int:
    from axgen.build import lowered

    spec = load_spec(args.spec)
    graph, _, _ = lowered(spec, args.target or spec.targets[0], args.after)
    print(graph.dump(), end="")
    return 0


def _explain(args) -> int:
    from axgen.analysis.explain import explain, render
    from axgen.backends import family_for
    from axgen.build import build

    spec = load_spec(args.spec)
    target = args.target or spec.targets[0]
    family_for(spec, target)
    built = build(args.spec, target)
    print(render(built, explain(built)), end="")
    return 0


def _aot(args) -> int:
    """Exit 1 when a program does not fit its chip's memory (or, with --all, when a compile failed)."""
    from axgen.analysis.aot import REPORT_TITLE, AotError, markdown
    from axgen.analysis.extras import check_compiler
    from axgen.backends import plan_for

    if args.report:
        check_output_file(args.report, force=args.force, header=re.compile(re.escape(REPORT_TITLE)))
    if args.dump_to:
        check_output_dir(args.dump_to, force=args.force)
    jobs = _jobs(args)
    for job in jobs:  # before the first compile, not after an hour of them
        check_compiler(plan_for(job.spec, job.target), "aot")
    # The dumps appear at --dump-to when the compiles end, those of a compile that failed included.
    dumps = staging_dir(args.dump_to) if args.dump_to else None
    try:
        reports, failures = _compile_jobs(jobs, args, dumps)
    except AotError:
        _publish(dumps, args.dump_to)
        raise
    except BaseException:
        if dumps is not None:
            shutil.rmtree(dumps, ignore_errors=True)
        raise
    _publish(dumps, args.dump_to)
    if args.report:
        command = "axgen aot --all --report " + str(args.report) if args.all else " ".join(sys.argv)
        write_atomically(args.report, markdown(reports, failures, command))
        print(f"wrote {args.report}")
    return 1 if failures or not all(r.fits for r in reports) else 0


def _compile_jobs(jobs, args, dumps: Path | None) -> tuple[list, list[str]]:
    """Each job's aot report, printed as it comes, and the failures (with --all; else the first raises); each
    program's dumps in DUMPS/SPEC/TARGET where `dumps` is given."""
    from axgen.analysis.aot import AotError, compile_target
    from axgen.build import output_name

    reports, failures = [], []
    shown = progress.bar(jobs, desc="aot", unit="program")
    for job in shown:

        def phase(name: str, job=job) -> None:
            shown.set_postfix_str(f"{job.spec.name} for {job.target}: {name}")

        dump_to = None if dumps is None else dumps / job.spec_file.stem / Path(output_name(job.target)).stem
        try:
            report = compile_target(
                job.spec_file, job.target, timeout=args.timeout, phase=phase, dump_to=dump_to
            )
        except AotError as err:
            if not args.all:
                raise
            failures.append(str(err))
            _print_error(err)
            continue
        reports.append(report)
        print(json.dumps(dataclasses.asdict(report)) if args.json else report.text(), flush=True)
    return reports, failures


def _publish(staging: Path | None, out: Path) -> None:
    """The dumps' staging folder renamed to --dump-to, where dumps were asked for."""
    if staging is not None:
        publish_dir(staging, out)
        print(f"XLA's dumps: {out}", file=sys.stderr)


def _plan(args) -> int:
    """Exit 1 when nothing fits."""
    from axgen.analysis.extras import check_compiler
    from axgen.analysis.plan import search, table, write_rule
    from axgen.backends import plan_for

    spec = load_spec(args.spec)
    plan = plan_for(spec, args.target)
    check_compiler(plan, "plan")
    found = search(
        args.spec,
        args.target,
        max_compiles=args.max_compiles,
        jobs=args.jobs,
        meshes=args.mesh,
        log=lambda line: print(line, flush=True),
    )
    tokens = spec.train.global_batch * spec.train.seq_len
    print(table(found, plan, tokens, args.top))
    best = next((o for o in found if o.fits), None)
    if best is None:
        return 1
    if args.write:
        why = (
            f"axgen plan {date.today()}: {best.step_seconds:.3g} s a step estimated, "
            f"peak {best.report.peak_bytes / 2**30:.2f} GiB of {plan.usable_bytes / 2**30:.1f}"
        )
        rule = write_rule(spec_path(args.spec), args.target, best.candidate, why)
        print(f"wrote to {args.spec}: {rule}\nrun `axgen build {args.spec}` to regenerate its programs")
    return 0


def _mesh(text: str) -> dict[str, int]:
    """One split, checked as a MeshRule's mesh is: known axes, each once, sizes >= 1 or a single -1."""
    mesh: dict[str, int] = {}
    for part in text.split(","):
        try:
            axis, size_text = part.split("=")
            size = int(size_text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"is not axis=size[,axis=size...]: {text!r}") from None
        if axis not in MESH_AXES:
            raise argparse.ArgumentTypeError(f"{text!r} names {axis}, not one of {', '.join(MESH_AXES)}")
        if axis in mesh:
            raise argparse.ArgumentTypeError(f"{text!r} gives {axis} twice: give each axis once")
        if size < 1 and size != -1:
            raise argparse.ArgumentTypeError(
                f"{text!r} gives {axis}={size}: a size is >= 1, or -1 for the devices left over"
            )
        mesh[axis] = size
    if list(mesh.values()).count(-1) > 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} has more than one -1: only one axis takes the devices left over"
        )
    return mesh


def _targets(args) -> int:
    """Each family with the rules of its backend file that apply to its targets (the TPU generations share one
    file, whose rules name their generation), first match winning."""
    from axgen.backends import FAMILIES

    for family in FAMILIES:
        print(f"{family.display}  ({family.chip.name}, backends/{family.name}.py)")
        examples = _example_targets(family)
        for rule in family.rules:
            if any(re.fullmatch(rule.pattern, target) for target in examples):
                print(f"  {rule.pattern:<28} {rule.mesh}  {rule.why}")
    return 0


def _example_targets(family) -> list[str]:
    """Targets of the family of 1 to 4096 devices, and of 2 to 16 slices where it has slices."""
    one_slice = [family.display.replace("[xS]", "").replace("N", str(2**k)) for k in range(13)]
    sliced = (
        [f"{target}x{slices}" for target in one_slice for slices in (2, 4, 8, 16)]
        if "[xS]" in family.display
        else []
    )
    return [target for target in one_slice + sliced if family.parse(target) is not None]


def _specs(args) -> int:
    """The bundled specs by name, what `axgen build NAME` takes, with their targets and first docstring line."""
    for path in bundled_specs():
        spec = load_spec(path)
        about = (sys.modules[f"axgen.specs.{path.stem}"].__doc__ or "").strip().split("\n")[0]
        print(f"{path.stem:<18} {', '.join(spec.targets):<44} {about}")
    return 0


def _corpus(args) -> int:
    from axgen.data.corpus import write_corpus

    check_output_dir(args.out, force=args.force)
    files = write_corpus(args.out)
    size = sum(path.stat().st_size for path in files)
    print(f"wrote {len(files)} documents ({size / 1e6:.1f} MB of Python source) to {args.out}")
    return 0


def _data(args) -> int:
    from axgen.data.chat import load_chat_template
    from axgen.data.datasets import build_chat_dataset, build_dataset, build_pairs_dataset, summary
    from axgen.data.inputs import DataError
    from axgen.data.tokenizer import load_tokenizer

    args.chat = args.chat or args.sharegpt
    if args.pairs:
        given = [("--chat", args.chat), ("--doc-per-line", args.doc_per_line), ("--field", args.field)]
        wrong = [flag for flag, value in [*given, ("--column", args.column)] if value]
        if wrong:
            raise DataError(f"{wrong[0]} is not for --pairs, whose records hold prompt, chosen and rejected")
    elif not args.chat:
        for flag, value in (("--chat-template", args.chat_template), ("--max-len", args.max_len)):
            if value is not None:
                raise DataError(f"{flag} is for conversations: pass --chat (or --sharegpt) too")
    elif args.doc_per_line:
        raise DataError("--doc-per-line reads plain text; --chat reads JSON Lines or Parquet records")
    check_output_dir(args.out, force=args.force)
    tokenizer = load_tokenizer(args.tokenizer, bos=args.bos, eos=args.eos)
    start = time.perf_counter()
    settings = dict(
        eval_fraction=args.eval_fraction, seed=args.seed, shard_tokens=args.shard_tokens, overwrite=args.force
    )
    if not (args.chat or args.pairs):
        manifest = build_dataset(args.inputs, tokenizer, args.out, _read_options(args), **settings)
    else:
        try:
            template = load_chat_template(tokenizer, args.chat_template, bos=args.bos, eos=args.eos)
        except DataError as err:
            if not args.pairs:
                raise
            template = err  # text pairs need none: its absence is an error at the first conversational record
        inputs = (args.inputs, tokenizer, template, args.out, _read_options(args))
        if args.pairs:
            manifest = build_pairs_dataset(*inputs, max_len=args.max_len, **settings)
        else:
            manifest = build_chat_dataset(*inputs, sharegpt=args.sharegpt, max_len=args.max_len, **settings)
    print(f"wrote {args.out}: {summary(manifest, time.perf_counter() - start)}")
    return 0


def _import_hf(args) -> int:
    from axgen.hf.import_config import TrainChoices, import_hf
    from axgen.ir import cost, from_spec
    from axgen.passes import run_passes

    check_output_file(args.out, force=args.force)
    targets = tuple(args.target or ("cpu-8",))
    choices = TrainChoices(args.seq_len, args.batch, args.lr, args.steps, targets)
    spec = import_hf(args.config, args.out, choices, args.name, args.force)
    graph = from_spec(spec)
    run_passes(graph, spec.features)
    print(f"wrote {args.out}: {spec.name}, {cost.num_params(graph):,} parameters")
    return 0


def _convert_hf(args) -> int:
    from axgen.hf.weights import convert_hf

    check_output_dir(args.out, force=args.force)
    spec = load_spec(args.spec)
    params = convert_hf(spec, args.hf, args.out, overwrite=args.force, adapter=args.adapter)
    leaves = [
        leaf for block in params.values() for leaf in (block.values() if isinstance(block, dict) else [block])
    ]
    size = sum(leaf.nbytes for leaf in leaves)
    print(f"wrote {args.out}: {len(leaves)} params of {spec.name}, {size / 2**30:.2f} GiB")
    return 0


def _export_hf(args) -> int:
    from axgen.hf.export import export_dtype, export_hf

    check_output_dir(args.out, force=args.force)
    spec = load_spec(args.spec)
    if args.adapter:
        from axgen.hf.export import export_adapter

        written = export_adapter(spec, args.ckpt, args.out, args.dtype, args.base, args.force)
        print(f"wrote {args.out}: the PEFT adapter of {spec.name}, {len(written)} tensors")
        return 0
    shard_bytes = int(args.shard_gb * 10**9)
    dtype = export_dtype(spec, args.dtype)
    written = export_hf(
        spec,
        args.ckpt,
        args.out,
        dtype,
        args.tokenizer,
        shard_bytes,
        args.force,
        args.fused_experts,
        args.chat_template,
        args.base,
        args.merge,
    )
    size = sum(bytes_ for _, bytes_ in written.values())
    print(f"wrote {args.out}: {len(written)} tensors of {spec.name} in {dtype}, {size / 2**30:.2f} GiB")
    return 0


def _report(args) -> int:
    from axgen.analysis.report import write_report

    # RUN_DIR/report.png is the command's own, redrawn as the run goes on; a PNG elsewhere may be anyone's.
    if args.out:
        check_output_file(args.out, force=args.force)
    png, table = write_report(args.run_dir, args.out)
    print(table, end="")
    print(f"wrote {png}")
    return 0


def _tokenizer_train(args) -> int:
    from axgen.data.tokenizer import train_tokenizer

    check_output_file(args.out, force=args.force)
    tokenizer, skipped = train_tokenizer(
        args.inputs, args.vocab_size, args.out, _read_options(args), overwrite=args.force
    )
    print(
        f"wrote {args.out} ({tokenizer.get_vocab_size()} tokens) and its tokenizer_config.json; "
        f"{skipped.count} skipped"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
