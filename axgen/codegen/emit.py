"""Renders a program from the lowered graph through the templates in `templates/`: the printer only prints.

Each node becomes one statement, rendered by its op's macro in `templates/ops/`; a provenance comment precedes
each run of nodes that share a spec field and passes. The result is formatted by black and compiled by Python
(a syntax error black's more lenient grammar lets through); a failure there is a compiler bug and names the template.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.resources
import sys
from pathlib import Path

import black
import jinja2
import networkx as nx

import axgen
from axgen.files import OutputError, write_atomically
from axgen.ir import OPS, Graph, Node
from axgen.ir.types import LOGICAL_AXES

# The templates ship inside the package (`axgen.templates`), so a wheel emits too, from the axgen that runs.
TEMPLATES = importlib.resources.files("axgen.templates")
# How emitted programs are formatted. `make test`'s `black --check .` reads pyproject.toml's [tool.black] for
# generated/ too, so the two cannot drift apart unnoticed.
BLACK_MODE = black.Mode(line_length=110, target_versions={black.TargetVersion.PY312})
# black takes about 0.4 s a 7B program, most of a build. What it made of a source is kept in FORMAT_CACHE under
# the hash of all that decides it (black's version, the mode, the source), so a source is formatted once a
# machine; the newest FORMAT_CACHE_ENTRIES stay (at most about 100 MB).
FORMAT_CACHE_ENTRIES = 1000


def _user_cache() -> Path | None:
    try:
        return Path.home() / ".cache" / "axgen" / "black"
    except RuntimeError:  # a user without a home directory (some containers'): every build formats
        return None


FORMAT_CACHE = _user_cache()


class EmitError(RuntimeError):
    pass


@functools.cache
def _environment() -> jinja2.Environment:
    """One environment per process, so each template compiles once (it reloads when its file changes)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.tests["stdlib_import"] = _is_stdlib_import
    env.filters["pyrepr"] = repr  # a value as Python source, where jinja's own printing would differ
    env.filters["one"] = _one
    return env


def _one(values) -> object:
    """The value every node agrees on, for a helper that all of them share; nodes that disagree are a compiler bug
    (lowering makes one helper per choice), never settled by taking the first node's."""
    distinct = list(dict.fromkeys(values))
    if len(distinct) != 1:
        raise EmitError(f"the nodes one helper prints for disagree: {distinct}")
    return distinct[0]


def _is_stdlib_import(line: str) -> bool:
    """`import x.y` or `from x.y import z` of a standard-library module."""
    return line.split()[1].split(".")[0] in sys.stdlib_module_names


def emit(graph: Graph, output_name: str) -> str:
    """The program's source text from the lowered graph: deterministic, black-formatted, and compiled by Python."""
    env = _environment()
    source = env.get_template("program.py.j2").render(**_context(env, graph, output_name))
    try:
        formatted = _formatted(source)
        compile(formatted, output_name, "exec", dont_inherit=True)
    except (black.parsing.InvalidInput, SyntaxError) as err:
        raise EmitError(
            f"templates/program.py.j2 rendered invalid Python for {graph.attrs['target']}: {err}"
        ) from None
    return formatted


def _formatted(source: str) -> str:
    """`source` formatted by black, from FORMAT_CACHE when it holds it; a cache that cannot be read or written
    costs only the formatting."""
    if FORMAT_CACHE is None:
        return black.format_str(source, mode=BLACK_MODE)
    key = f"{black.__version__}\n{BLACK_MODE.get_cache_key()}\n{source}"
    kept = FORMAT_CACHE / f"{hashlib.sha256(key.encode()).hexdigest()}.py"
    try:
        return kept.read_text(encoding="utf-8")
    except OSError:
        pass
    formatted = black.format_str(source, mode=BLACK_MODE)
    try:
        write_atomically(kept, formatted)  # whole or not at all, for a build running beside this one
        for old in sorted(FORMAT_CACHE.glob("*.py"), key=lambda p: p.stat().st_mtime)[:-FORMAT_CACHE_ENTRIES]:
            old.unlink(missing_ok=True)
    except (OSError, OutputError):
        pass
    return formatted


def _context(env, graph: Graph, output_name: str) -> dict:
    """What the templates print: the lowered graph's own attrs (`program`), and each node rendered by its op's
    macro. Nothing here comes from the spec or the plan but through the graph."""
    nodes = list(graph.nodes())
    groups = [_group(scan) for scan in graph.nodes(op="scan") if scan.attrs.groups(scan.attrs.calls)]
    (head,) = graph.nodes(op="lm_head")
    return {
        "version": axgen.__version__,
        "name": graph.name,
        "output_name": output_name,
        "program": graph.attrs,
        "params_tree": _params_tree(graph),
        "helpers": _helpers(env, nodes, graph.attrs),
        "blocks": _blocks(env, graph),
        "stacked": (
            [r.name for r in graph.blocks()] if graph.attrs["stack_cast"]["name"] == "per_layer" else []
        ),
        "groups": groups,
        "regroup": any(call.per_step > 1 for group in groups for call in group["calls"]),
        "main_lines": _lines(env, graph, "main", param_root="params"),
        **_fused_loss(env, graph),
        # The loss the head trains: a preference loss (F.dpo, F.simpo) and DPO's reference, or None.
        "objective": head.attrs.objective,
        "reference": head.attrs.reference,
        "main_output": graph.output("main").name,
        "main_aux": [f"{scan.name}_aux" for scan in graph.nodes(op="scan") if scan.attrs.returns_aux],
        "logged_metrics": _logged_metrics(graph, head),
        "dropout": _dropout(graph),
        "op_imports": _op_imports(env, nodes),
    }


def _dropout(graph: Graph) -> bool:
    """Whether a training step draws dropout masks (F.lora's dropout): its layers then take the step's keys."""
    return any(node.attrs.lora_dropout for node in graph.nodes(op="linear"))


def _logged_metrics(graph: Graph, head: Node) -> tuple[str, ...]:
    """What the progress line shows besides the loss: a preference loss's reward accuracy and margin (TRL's
    names), the cross-entropy beside auxiliary losses, which the loss then holds too."""
    if head.attrs.objective:
        return ("rewards/accuracies", "rewards/margins", *graph.attrs["aux_metrics"])
    return ("cross_entropy", *graph.attrs["aux_metrics"]) if graph.attrs["aux_metrics"] else ()


def _params_tree(graph: Graph) -> str:
    """The PARAMS literal: main-region params in program order, each block's stacked under its name."""
    lines = ["{"]
    for node in graph.nodes(region="main"):
        for block in node.attrs.blocks if node.op == "scan" else ():
            region = graph.regions[block]
            lines.append(f'"{region.name}": {{  # stacked: one slice per layer')
            for block_node in graph.nodes(region=region.name):
                lines += [_param_entry(p, stack=region.repeat) for p in block_node.params.values()]
            lines.append("},")
        lines += [_param_entry(p) for p in node.params.values()]
    return "\n".join(lines + ["}"])


def _param_entry(param, stack: int | None = None) -> str:
    shape, axes = param.shape, param.type.axes
    if stack is not None:
        shape, axes = (stack, *shape), ("layers", *axes)
    extra = "".join(
        [
            f', init="{param.init}"' if param.init != "normal" else "",
            f", std={param.std}" if param.init == "normal" and param.std != 0.02 else "",
            ", decay=False" if not param.decay else "",
            ", trained=False" if not param.trained else "",
            ", frozen=True" if param.frozen else "",
            f', dtype="{param.dtype}"' if param.dtype != "float32" else "",
            ", adapter=True" if param.adapter else "",
            f", balance_rate={param.balance_rate}" if param.balance_rate is not None else "",
        ]
    )
    return f'"{param.key}": ParamSpec({shape!r}, {axes!r}{extra}),'


def _merged(dicts: list[str]) -> str | None:
    """An expression for the union of the named dicts: the name itself when there is one."""
    if len(dicts) <= 1:
        return dicts[0] if dicts else None
    return "{" + ", ".join(f"**{d}" for d in dicts) + "}"


def _einsum(x_axes, w_axes, out_axes) -> str:
    def letters(axes):
        return "".join(LOGICAL_AXES[a] for a in axes)

    return f"{letters(x_axes)},{letters(w_axes)}->{letters(out_axes)}"


def _by_template(env, nodes: list[Node]) -> list[tuple]:
    """Each op template's module with the nodes it prints, in template order."""
    by_template: dict[str, list[Node]] = {}
    for node in nodes:
        by_template.setdefault(OPS[node.op].template, []).append(node)
    return [(env.get_template(f"ops/{t}.j2").module, by_template[t]) for t in sorted(by_template)]


def _helpers(env, nodes: list[Node], program: dict) -> list[str]:
    """The helper functions and constants the op templates' optional `helpers` macros print, given the nodes each
    template prints and the program's attrs, in template order."""
    helpers = [
        module.helpers(ops, program) for module, ops in _by_template(env, nodes) if hasattr(module, "helpers")
    ]
    return [h.strip("\n") + "\n\n" for h in helpers if h.strip()]


def _op_imports(env, nodes: list[Node]) -> list[str]:
    """The import lines the op templates' optional `imports` macros ask for the nodes they print."""
    declared = [
        str(module.imports(ops)) for module, ops in _by_template(env, nodes) if hasattr(module, "imports")
    ]
    return [line.strip() for text in declared for line in text.splitlines() if line.strip()]


def _blocks(env, graph: Graph) -> list[dict]:
    """Each layer function once. Blocks may share one (Gemma 3's windowed layers after its last whole group of six,
    scanned apart with params of their own): they must print the same statements, and the function's docstring
    counts the layers of them all."""
    functions: dict[str, dict] = {}
    for region in graph.blocks():
        block = _block(env, graph, region)
        first = functions.setdefault(block["function"], block)
        if first is block:
            continue
        if {k: v for k, v in first.items() if k not in ("name", "repeat")} != {
            k: v for k, v in block.items() if k not in ("name", "repeat")
        }:
            raise EmitError(
                f"blocks {first['name']} and {block['name']} share {block['function']} but differ"
            )
        first["repeat"] += block["repeat"]
    return list(functions.values())


def _block(env, graph: Graph, region) -> dict:
    return {
        "name": region.name,
        "function": region.function,
        "repeat": region.repeat,
        "lines": _lines(env, graph, region.name, param_root="p"),
        "output": graph.output(region.name).name,
        "aux": _merged(list(region.attrs.get("aux", ()))),
        "checkpointed": region.attrs.get("checkpointed", False),
    }


def _group(scan: Node) -> dict:
    """The function one step of a grouped scan runs: each block's layers of the group, in order."""
    return {
        "function": scan.attrs.function,
        "steps": scan.attrs.steps,
        "calls": scan.attrs.calls,
        "aux": scan.attrs.returns_aux,
    }


def _fused_loss(env, graph: Graph) -> dict:
    """Where the lowering fused the output head with the loss: the main region's statements up to the head
    (`trunk_lines`, which `hidden_with_aux` prints) and from it on (`head_lines`), and what the loss call takes
    (`fused_loss`); else `fused_loss` is None."""
    (head,) = graph.nodes(op="lm_head")
    if head.attrs.loss != "fused":
        return {"fused_loss": None, "pipelined": None}
    nodes = list(graph.nodes(region="main"))
    split = nodes.index(head)
    return {
        "fused_loss": {
            "hidden": graph.inputs(head)["x"].name,
            "weight": 'params["embed"]' if head.attrs.tied else f'params["{head.params["w"].key}"]',
            "tied": head.attrs.tied,
            "chunk": head.attrs.loss_chunk,
            "soft_cap": head.attrs.loss_soft_cap,
            "context": head.attrs.context,
        },
        "trunk_lines": _lines(env, graph, "main", param_root="params", nodes=nodes[:split]),
        "head_lines": _lines(env, graph, "main", param_root="params", nodes=nodes[split:]),
        "pipelined": _pipelined(env, graph, nodes[:split]),
    }


def _pipelined(env, graph: Graph, trunk: list[Node]) -> dict | None:
    """Where the scan's stages run 1F1B (runtime.pipelined_loss), the trunk cut around the scan: what makes its
    input from a microbatch's tokens (`first_lines`), what else the scan takes (`input_lines`: positions, segment
    ids), and what follows it up to the head (`last_lines`); else None."""
    scans = [n for n in trunk if n.op == "scan" and n.attrs.stage_schedule == "1f1b"]
    if not scans:
        return None
    (scan,) = scans
    at = trunk.index(scan)
    before = [n for n in trunk[:at] if n.op != "input"]
    x = graph.inputs(scan)["x"]
    feeding = {x.name, *nx.ancestors(graph.regions["main"].dag, x.name)}
    args = {slot: node.name for slot, node in graph.inputs(scan).items()}
    return {
        "scan": scan.attrs,
        "args": args,
        "output": scan.name,
        "xs": _scan_xs(scan, "params"),
        "first_lines": _lines(env, graph, "main", "params", [n for n in before if n.name in feeding]),
        "input_lines": _lines(env, graph, "main", "params", [n for n in before if n.name not in feeding]),
        "last_lines": _lines(env, graph, "main", "params", trunk[at + 1 :]),
    }


def _lines(env, graph: Graph, region: str, param_root: str, nodes: list[Node] | None = None) -> list[str]:
    """One statement per node (of `nodes`, a part of the region, when given), a provenance comment per run of nodes
    from the same spec field and passes."""
    lines, last_provenance = [], None
    for node in graph.nodes(region=region) if nodes is None else nodes:
        if node.op == "input":
            continue
        provenance = _provenance(node, graph.attrs["backend_file"])
        if provenance != last_provenance:
            lines.append(provenance)
            last_provenance = provenance
        lines += _statement(env, graph, node, param_root).splitlines()
        if node.attrs.constrain:
            lines.append(f"{node.name} = constrain({node.name}, {node.attrs.constrain!r})")
    return lines


def _provenance(node: Node, backend_file: str) -> str:
    """`# label · passes/made_by.py · kernel · spec field · changed by passes/x.py`: where the statement comes from."""
    where = [node.label]
    where += [f"passes/{p}.py" for p in node.passes if p == node.label]
    if node.op == "attention":
        mask = {"dense": "dense document mask", "segment_ids": "documents by segment ids"}
        where.append(f"kernel {node.attrs.kernel}, {mask[node.attrs.document_mask]} ({backend_file})")
    where.append(node.source)
    changed = [f"passes/{p}.py" for p in node.passes if p != node.label]
    if changed:
        where.append("changed by " + ", ".join(changed))
    return "# " + " · ".join(where)


def _statement(env, graph: Graph, node: Node, param_root: str) -> str:
    args = {slot: src.name for slot, src in graph.inputs(node).items()}
    weights = {role: f'{param_root}["{p.key}"]' for role, p in node.params.items()}
    attrs = {f.name: getattr(node.attrs, f.name) for f in dataclasses.fields(node.attrs)}
    if node.op == "linear":
        x = graph.inputs(node)["x"].type
        attrs["einsum"] = _einsum(x.axes, node.params["w"].type.axes, node.type.axes)
        if node.attrs.lora_scale:
            a, b = node.params["lora_a"].type, node.params["lora_b"].type
            low_rank = x.drop(*a.axes).concat(b.drop(*b.axes[1:]))  # [batch, seq, lora_rank]
            attrs["lora_a_einsum"] = _einsum(x.axes, a.axes, low_rank.axes)
            attrs["lora_b_einsum"] = _einsum(low_rank.axes, b.axes, node.type.axes)
            attrs["lora_dropout_name"] = node.params["lora_a"].key
    if node.op == "scan":
        attrs["xs"] = _scan_xs(node, param_root)
        attrs["dropout"] = _dropout(graph)
    template = env.get_template(f"ops/{OPS[node.op].template}.j2").module
    statement = str(getattr(template, node.op)(node.name, attrs, args, weights)).strip()
    # Its shape goes on its last line, unless the template put a comment of its own there.
    return statement if "#" in statement.splitlines()[-1] else f"{statement}  # {node.type}"


def _scan_xs(scan: Node, param_root: str) -> str:
    """The stacked params a scan runs over: one block's, or each block's of a group, regrouped per step."""
    if not scan.attrs.groups(scan.attrs.calls):
        return f'{param_root}["{scan.attrs.blocks[0]}"]'
    entries = []
    for call in scan.attrs.calls:
        stacked = f'{param_root}["{call.block}"]'
        if call.per_step > 1:
            stacked = f"regroup({stacked}, {scan.attrs.steps})"
        entries.append(f'"{call.block}": {stacked}')
    return "{" + ", ".join(entries) + "}"
