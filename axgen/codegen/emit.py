"""Renders a program from the graph and the plan through the templates in `templates/`.

Each node becomes one statement, rendered by its op's macro in `templates/ops/`; a provenance comment precedes
each run of nodes that share a spec line and passes. The result is formatted by black and parsed by libcst; a
failure there is a compiler bug and names the template.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import black
import jinja2
import libcst

import axgen
from axgen.backends import Plan
from axgen.ir import OPS, Graph, Node, cost
from axgen.ir.types import LOGICAL_AXES
from axgen.spec import REMAT_POLICIES, Model

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "templates"


def _black_mode() -> black.Mode:
    """The project's one black configuration (pyproject.toml), for axgen's code and every program it emits."""
    config = black.parse_pyproject_toml(str(ROOT / "pyproject.toml"))
    versions = {black.TargetVersion[name.upper()] for name in config["target_version"]}
    return black.Mode(line_length=config["line_length"], target_versions=versions)


BLACK_MODE = _black_mode()


class EmitError(RuntimeError):
    pass


@functools.cache
def _environment() -> jinja2.Environment:
    """One environment per process, so each template compiles once (it reloads when its file changes)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.tests["stdlib_import"] = _is_stdlib_import
    return env


def _is_stdlib_import(line: str) -> bool:
    """`import x.y` or `from x.y import z` of a standard-library module."""
    return line.split()[1].split(".")[0] in sys.stdlib_module_names


def emit(graph: Graph, plan: Plan, spec: Model, passes: list, spec_path: str, output_name: str) -> str:
    """The program's source text from the lowered graph: deterministic, black-formatted, and parsed by libcst."""
    env = _environment()
    context = _context(env, graph, plan, spec, passes, spec_path, output_name)
    source = env.get_template("program.py.j2").render(**context)
    try:
        formatted = black.format_str(source, mode=BLACK_MODE)
        libcst.parse_module(formatted)
    except (black.parsing.InvalidInput, libcst.ParserSyntaxError) as err:
        raise EmitError(f"templates/program.py.j2 rendered invalid Python for {plan.target}: {err}") from None
    return formatted


def _context(env, graph, plan, spec, passes, spec_path, output_name) -> dict:
    nodes = list(graph.nodes())
    groups = [_group(scan) for scan in graph.nodes(op="scan") if scan.attrs.groups(scan.attrs.calls)]
    remat = _remat(graph)
    return {
        "version": axgen.__version__,
        "spec": spec,
        "spec_path": spec_path,
        "output_name": output_name,
        "plan": plan,
        "mesh_text": " ".join(f"{axis}={size}" for axis, size in plan.mesh),
        "mesh_dict": repr(dict(plan.mesh)),
        "dcn_mesh_dict": repr(dict(plan.dcn_mesh)),
        "passes_text": " · ".join(p.feature.summary() for p in passes) or "none",
        "lowering_text": _lowering_text(graph, plan),
        "config": _config(spec, graph, spec_path),
        "params_tree": _params_tree(graph),
        "helpers": _helpers(env, nodes),
        "blocks": [_block(env, graph, region) for region in graph.blocks()],
        "groups": groups,
        "regroup": any(call.per_step > 1 for group in groups for call in group["calls"]),
        "main_lines": _lines(env, graph, "main", param_root="params"),
        "main_output": graph.output("main").name,
        "main_aux": [f"{scan.name}_aux" for scan in graph.nodes(op="scan") if scan.attrs.returns_aux],
        "aux_weights": graph.attrs["aux_losses"],
        "logged_metrics": (
            ("cross_entropy", *graph.attrs["aux_metrics"]) if graph.attrs["aux_metrics"] else ()
        ),
        "remat": remat,
        "logical_axis_rules": list(graph.attrs["logical_axis_rules"].items()),
        "memory_fraction": graph.attrs.get("memory_fraction"),
        "op_imports": _op_imports(env, nodes),
    }


def _lowering_text(graph: Graph, plan: Plan) -> str:
    """What the target chose: the header's summary of the lowered graph."""
    chosen = [
        f"remat(policy={region.attrs['remat']}) ({region.attrs['remat_source']})"
        for region in graph.blocks()[:1]
        if region.attrs.get("remat_source", "").startswith("default of")
    ]
    kernels = {(n.attrs.kernel, n.attrs.block) for n in graph.nodes(op="attention")}
    chosen += [
        f"attention {kernel}" + (f" (blocks of {block})" if block else "")
        for kernel, block in sorted(kernels, key=str)
    ]
    matmuls = {n.attrs.grouped_matmul for n in graph.nodes(op="moe") if not n.attrs.capacity_factor}
    chosen += [f"experts by {m}" for m in sorted(matmuls) if m != "ragged_dot"]
    dots = sorted({n.attrs.quantize for n in graph.nodes() if getattr(n.attrs, "quantize", None)})
    chosen += [f"{'/'.join(dots)} dots"] if dots else []
    return " · ".join(chosen) + f" ({plan.backend_file})"


def _config(spec: Model, graph: Graph, spec_path: str) -> list[tuple[str, str, str]]:
    attn, mlp, train, opt = (
        spec.decoder.attention,
        spec.decoder.mlp,
        spec.train,
        spec.train.optimizer,
    )
    entries = [
        ("model", spec.name, ""),
        ("vocab_size", spec.vocab_size, ""),
        ("d_model", spec.d_model, ""),
        ("num_layers", spec.decoder.num_layers, ""),
        ("num_heads", attn.num_heads, ""),
        ("num_kv_heads", attn.num_kv_heads, ""),
        ("head_dim", attn.head_dim, ""),
        ("mlp_hidden", mlp.hidden_dim, mlp.activation),
        ("tie_embeddings", spec.tie_embeddings, ""),
        ("num_params", cost.num_params(graph), _count(cost.num_params(graph))),
        ("seq_len", train.seq_len, ""),
        ("global_batch", train.global_batch, "sequences per step, over all devices"),
        ("steps", train.steps, "length of the learning-rate schedule"),
        ("warmup_steps", train.warmup_steps, ""),
        ("lr", opt.lr, "peak"),
        ("min_lr_ratio", opt.min_lr_ratio, ""),
        ("b1", opt.b1, ""),
        ("b2", opt.b2, ""),
        ("eps", opt.eps, ""),
        ("weight_decay", opt.weight_decay, ""),
        ("grad_clip", train.grad_clip, "global norm"),
        ("seed", train.seed, ""),
        ("checkpoint_every", train.checkpoint_every, "steps"),
        ("spec", spec_path, "datasets are checked against its vocab_size"),
        (
            "flops_per_token",
            cost.flops_per_token(graph, train.seq_len),
            "6 x matmul weights used + causal attention",
        ),
    ]
    return [(key, repr(value), comment) for key, value, comment in entries]


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


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _by_template(env, nodes: list[Node]) -> list[tuple]:
    """Each op template's module with the nodes it prints, in template order."""
    by_template: dict[str, list[Node]] = {}
    for node in nodes:
        by_template.setdefault(OPS[node.op].template, []).append(node)
    return [(env.get_template(f"ops/{t}.j2").module, by_template[t]) for t in sorted(by_template)]


def _helpers(env, nodes: list[Node]) -> list[str]:
    """Each op template's helper functions, given the nodes it prints, in template order."""
    helpers = [module.helpers(ops) for module, ops in _by_template(env, nodes)]
    return [h.strip("\n") + "\n\n" for h in helpers if h.strip()]


def _op_imports(env, nodes: list[Node]) -> list[str]:
    """The import lines the op templates' optional `imports` macros ask for the nodes they print."""
    declared = [
        str(module.imports(ops)) for module, ops in _by_template(env, nodes) if hasattr(module, "imports")
    ]
    return [line.strip() for text in declared for line in text.splitlines() if line.strip()]


def _block(env, graph: Graph, region) -> dict:
    return {
        "name": region.name,
        "function": region.function,
        "repeat": region.repeat,
        "lines": _lines(env, graph, region.name, param_root="p"),
        "output": graph.output(region.name).name,
        "aux": _merged(list(region.attrs.get("aux", ()))),
        "remat": _block_remat(region),
    }


def _remat(graph: Graph) -> dict | None:
    """The one jax.checkpoint policy of the program's blocks, from the remat lowering."""
    chosen = {(r.attrs["remat"], r.attrs["remat_source"]) for r in graph.blocks() if _block_remat(r)}
    if not chosen:
        return None
    if len(chosen) > 1:
        raise EmitError(f"blocks have different remat policies: {sorted(chosen)}")
    ((name, source),) = chosen
    policy = REMAT_POLICIES[name]
    return {"name": name, "source": source, "save": policy.save, "offload": policy.offload, "why": policy.why}


def _block_remat(region) -> bool:
    return REMAT_POLICIES[region.attrs.get("remat", "none")].checkpoint


def _group(scan: Node) -> dict:
    """The function one step of a grouped scan runs: each block's layers of the group, in order."""
    return {
        "function": scan.attrs.function,
        "steps": scan.attrs.steps,
        "calls": scan.attrs.calls,
        "aux": scan.attrs.returns_aux,
    }


def _lines(env, graph: Graph, region: str, param_root: str) -> list[str]:
    """One statement per node, a provenance comment per run of nodes from the same spec line and passes."""
    lines, last_provenance = [], None
    for node in graph.nodes(region=region):
        if node.op == "input":
            continue
        provenance = _provenance(node, graph.attrs["backend_file"])
        if provenance != last_provenance:
            lines.append(provenance)
            last_provenance = provenance
        lines.append(_statement(env, graph, node, param_root))
        if node.attrs.constrain:
            lines.append(f"{node.name} = constrain({node.name}, {node.attrs.constrain!r})")
    return lines


def _provenance(node: Node, backend_file: str) -> str:
    """`# label · passes/made_by.py · kernel · spec line · changed by passes/x.py`: where the statement comes from."""
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
        attrs["einsum"] = _einsum(
            graph.inputs(node)["x"].type.axes, node.params["w"].type.axes, node.type.axes
        )
    if node.op == "scan":
        attrs["xs"] = _scan_xs(node, param_root)
    template = env.get_template(f"ops/{OPS[node.op].template}.j2").module
    statement = str(getattr(template, node.op)(node.name, attrs, args, weights)).strip()
    return f"{statement}  # {node.type}" if "#" not in statement else statement


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
