"""Renders a program from the graph and the plan through the templates in `templates/`.

Each node becomes one statement, rendered by its op's macro in `templates/ops/`; a provenance comment precedes
each run of nodes that share a spec line and passes. The result is formatted by black and parsed by libcst; a
failure there is a compiler bug and names the template.
"""

from __future__ import annotations

from pathlib import Path

import black
import jinja2
import libcst

import axgen
from axgen.backends import Plan
from axgen.ir import Graph, Node, cost
from axgen.spec import Model

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "templates"

# Op -> the macro file in templates/ops/ that renders it.
OP_TEMPLATES = {
    "positions": "embed",
    "embed": "embed",
    "lm_head": "embed",
    "rms_norm": "norm",
    "layer_norm": "norm",
    "linear": "linear",
    "rope": "rope",
    "attention": "attention",
    "swiglu": "mlp",
    "gelu": "mlp",
    "add": "residual",
    "scan": "scan",
    "moe": "moe",
}

# One letter per logical axis, for einsum strings a reader can decode: "bse,ehd->bshd".
AXIS_LETTERS = {
    "batch": "b",
    "seq": "s",
    "embed": "e",
    "heads": "h",
    "kv_heads": "k",
    "head_dim": "d",
    "mlp": "f",
    "vocab": "v",
    "layers": "l",
    "expert": "x",
}


def _black_mode() -> black.Mode:
    """The project's one black configuration (pyproject.toml), for axgen's code and every program it emits."""
    config = black.parse_pyproject_toml(str(ROOT / "pyproject.toml"))
    versions = {black.TargetVersion[name.upper()] for name in config["target_version"]}
    return black.Mode(line_length=config["line_length"], target_versions=versions)


BLACK_MODE = _black_mode()


class EmitError(RuntimeError):
    pass


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def emit(graph: Graph, plan: Plan, spec: Model, passes: list, spec_path: str, output_name: str) -> str:
    """The program's source text: deterministic, black-formatted, and parsed by libcst."""
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
    ops = {node.op for node in graph.nodes()}
    groups = [_group(graph, scan) for scan in graph.nodes(op="scan") if _is_group(graph, scan)]
    remat_policy = _remat_policy(graph)
    return {
        "version": axgen.__version__,
        "spec": spec,
        "spec_path": spec_path,
        "output_name": output_name,
        "plan": plan,
        "mesh_text": " ".join(f"{axis}={size}" for axis, size in plan.mesh),
        "mesh_dict": repr(dict(plan.mesh)),
        "dcn_mesh_dict": repr(dict(plan.dcn_mesh)),
        "passes_text": " · ".join(_pass_text(p.feature) for p in passes) or "none",
        "config": _config(spec, graph),
        "params_tree": _params_tree(graph),
        "helpers": _helpers(env, graph, plan, ops),
        "blocks": [_block(env, graph, plan, region) for region in graph.blocks()],
        "groups": groups,
        "regroup": any(call["per_step"] > 1 for group in groups for call in group["calls"]),
        "main_lines": _lines(env, graph, plan, "main", param_root="params"),
        "main_output": graph.output("main").name,
        "main_aux": [f"{scan.name}_aux" for scan in graph.nodes(op="scan") if _scan_has_aux(graph, scan)],
        "aux_weights": {k: v for node in graph.nodes() for k, v in node.attrs.get("aux_weights", {}).items()},
        "remat_policy": remat_policy,
        "logical_axis_rules": _logical_axis_rules(graph, plan),
        "statistics": any(not p.trained for node in graph.nodes() for p in node.params.values()),
        "uses_checkpoint_name": any(n.attrs.get("checkpoint_name") for n in graph.nodes()),
        "uses_functools": bool(remat_policy or _quantized(graph)),
        "uses_splash": plan.attention == "splash" and "attention" in ops,
        "aux_names": sorted({name for node in graph.nodes() for name in node.attrs.get("aux", ())}),
    }


def _pass_text(feature) -> str:
    from_backend = feature.origin.file.startswith("backends/")
    return feature.summary() + (f" (default of {feature.origin})" if from_backend else "")


def _config(spec: Model, graph: Graph) -> list[tuple[str, str, str]]:
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
        (
            "token_dtype",
            "uint16" if spec.vocab_size <= 2**16 else "uint32",
            "of the flat token file",
        ),
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
        for block in node.attrs["blocks"] if node.op == "scan" else ():
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


def _helpers(env, graph: Graph, plan: Plan, ops: set[str]) -> list[str]:
    families = sorted(
        {OP_TEMPLATES[op] for op in ops if op in OP_TEMPLATES}
        | ({"quantize"} if _quantized(graph) else set())
    )
    helpers = []
    for family in families:
        module = env.get_template(f"ops/{family}.j2").module
        if family == "rope":
            helpers.append(module.helpers(ops, next(graph.nodes(op="rope")).attrs["scaling"]))
        elif family == "attention":
            helpers.append(module.helpers(ops, plan.attention))
        elif family == "quantize":
            helpers.append(module.helpers(ops, _quantized(graph)))
        elif family == "moe":
            helpers.append(module.helpers(ops, list(graph.nodes(op="moe"))))
        else:
            helpers.append(module.helpers(ops))
    return [h.strip("\n") + "\n\n" for h in helpers if h.strip()]


def _block(env, graph: Graph, plan: Plan, region) -> dict:
    aux = [f"{node.name}_aux" for node in graph.nodes(region=region.name) if node.attrs.get("aux")]
    return {
        "name": region.name,
        "function": region.function,
        "repeat": region.repeat,
        "lines": _lines(env, graph, plan, region.name, param_root="p"),
        "output": graph.output(region.name).name,
        "aux": _merged(aux),
        "remat": region.attrs.get("remat"),
    }


def _merged(dicts: list[str]) -> str | None:
    """An expression for the union of the named dicts: the name itself when there is one."""
    if len(dicts) <= 1:
        return dicts[0] if dicts else None
    return "{" + ", ".join(f"**{d}" for d in dicts) + "}"


def _logical_axis_rules(graph: Graph, plan: Plan) -> list[tuple[str, tuple[str, ...]]]:
    """The rules for the logical axes this program's tensors have (stacked params add `layers`)."""
    types = [n.type for n in graph.nodes()] + [p.type for n in graph.nodes() for p in n.params.values()]
    used = {axis for t in types for axis in t.axes} | {"layers"}
    return [(axis, mesh_axes) for axis, mesh_axes in plan.logical_axis_rules if axis in used]


def _quantized(graph: Graph) -> set[str]:
    return {node.attrs["quantize"] for node in graph.nodes() if node.attrs.get("quantize")}


def _remat_policy(graph: Graph) -> dict | None:
    """The one jax.checkpoint policy of the program's blocks, as a comment and an expression."""
    policies = {repr(r.attrs["remat"]): r.attrs["remat"] for r in graph.blocks() if r.attrs.get("remat")}
    if not policies:
        return None
    if len(policies) > 1:
        raise EmitError(f"blocks have different remat policies: {sorted(policies)}")
    remat = next(iter(policies.values()))

    def names(key: str) -> str:
        return ", ".join(f'"{n}"' for n in remat[key])

    if remat["offload"]:
        expression = (
            f"jax.checkpoint_policies.save_and_offload_only_these_names(names_which_can_be_saved=[{names('save')}], "
            f'names_which_can_be_offloaded=[{names("offload")}], offload_src="device", offload_dst="pinned_host")'
        )
    elif remat["save"]:
        expression = f"jax.checkpoint_policies.save_only_these_names({names('save')})"
    else:
        expression = "jax.checkpoint_policies.nothing_saveable"
    comment = f"# remat · passes/remat.py · {remat['source']} · policy {remat['policy']}: {remat['why']}"
    return {"comment": comment, "expression": expression}


def _has_aux(graph: Graph, region: str) -> bool:
    return any(node.attrs.get("aux") for node in graph.nodes(region=region))


def _scan_has_aux(graph: Graph, scan: Node) -> bool:
    return any(_has_aux(graph, block) for block in scan.attrs["blocks"])


def _is_group(graph: Graph, scan: Node) -> bool:
    """Whether one scan step runs more than one layer: a mixed stack, or several layers of one block."""
    blocks = scan.attrs["blocks"]
    return len(blocks) > 1 or graph.regions[blocks[0]].repeat != scan.attrs["steps"]


def _group(graph: Graph, scan: Node) -> dict:
    """The function one step of a grouped scan runs: each block's layers of the group, in order."""
    calls = []
    for block in scan.attrs["blocks"]:
        region = graph.regions[block]
        calls.append(
            {
                "block": block,
                "function": region.function,
                "per_step": region.repeat // scan.attrs["steps"],
                "aux": _has_aux(graph, block),
            }
        )
    if sum(call["aux"] for call in calls) > 1:
        raise EmitError(f"scan {scan.name}: more than one block of a group has auxiliary outputs")
    return {
        "function": f"{scan.name}_group",
        "steps": scan.attrs["steps"],
        "calls": calls,
        "aux": _scan_has_aux(graph, scan),
    }


def _lines(env, graph: Graph, plan: Plan, region: str, param_root: str) -> list[str]:
    """One statement per node, a provenance comment per run of nodes from the same spec line and passes."""
    lines, last_provenance = [], None
    for node in graph.nodes(region=region):
        if node.op == "input":
            continue
        provenance = _provenance(node, plan)
        if provenance != last_provenance:
            lines.append(provenance)
            last_provenance = provenance
        lines.append(_statement(env, graph, node, param_root, plan))
        if node.op in plan.constrained_ops:
            lines.append(f"{node.name} = constrain({node.name}, {node.type.axes!r})")
    return lines


def _provenance(node: Node, plan: Plan) -> str:
    """`# label · passes/made_by.py · kernel · spec line · changed by passes/x.py`: where the statement comes from."""
    where = [node.label]
    where += [f"passes/{p}.py" for p in node.passes if p == node.label]
    if node.op == "attention":
        where.append(f"kernel {plan.attention} ({plan.backend_file})")
    where.append(node.source)
    changed = [f"passes/{p}.py" for p in node.passes if p != node.label]
    if changed:
        where.append("changed by " + ", ".join(changed))
    return "# " + " · ".join(where)


def _statement(env, graph: Graph, node: Node, param_root: str, plan: Plan) -> str:
    args = {slot: src.name for slot, src in graph.inputs(node).items()}
    weights = {role: f'{param_root}["{p.key}"]' for role, p in node.params.items()}
    attrs = dict(node.attrs)
    if node.op == "linear":
        attrs["einsum"] = _einsum(
            graph.inputs(node)["x"].type.axes, node.params["w"].type.axes, node.type.axes
        )
    if node.op == "scan":
        attrs.update(_scan_call(graph, node, param_root))
    if node.op == "attention":
        attrs["kernel"] = plan.attention
    macro = getattr(env.get_template(f"ops/{OP_TEMPLATES[node.op]}.j2").module, node.op)
    statement = str(macro(node.name, attrs, args, weights)).strip()
    return f"{statement}  # {node.type}" if "#" not in statement else statement


def _scan_call(graph: Graph, scan: Node, param_root: str) -> dict:
    """The function a scan step calls and the stacked params it scans over."""
    aux = _scan_has_aux(graph, scan)
    if not _is_group(graph, scan):
        block = scan.attrs["blocks"][0]
        return {"function": graph.regions[block].function, "xs": f'{param_root}["{block}"]', "aux": aux}
    group = _group(graph, scan)
    entries = []
    for call in group["calls"]:
        stacked = f'{param_root}["{call["block"]}"]'
        if call["per_step"] > 1:
            stacked = f"regroup({stacked}, {group['steps']})"
        entries.append(f'"{call["block"]}": {stacked}')
    return {"function": group["function"], "xs": "{" + ", ".join(entries) + "}", "aux": aux}


def _einsum(x_axes, w_axes, out_axes) -> str:
    def letters(axes):
        return "".join(AXIS_LETTERS[a] for a in axes)

    return f"{letters(x_axes)},{letters(w_axes)}->{letters(out_axes)}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
