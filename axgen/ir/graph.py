"""The graph IR: named regions (the main program and repeated blocks) of op nodes over networkx.

A block is a region with `repeat=N`: one decoder layer, emitted as a `jax.lax.scan` over stacked params, so a
pass that rewrites the block rewrites all N layers. A `scan` node runs its `blocks` in order, `steps` times: one
block of N layers is `steps=N`; a mixed stack (dense, MoE, dense, MoE) is two blocks of N/2 layers each, run in
turn for `steps=N/2`. Node names are unique within a region and become the emitted
variable names. Every node records provenance: the spec field it came from (file and path, never a line) and the
passes that made or changed it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import networkx as nx

from axgen.ir.ops import OPS, Attrs, ShapeError
from axgen.ir.types import Param, TensorType


class GraphError(ValueError):
    pass


@dataclass(frozen=True)
class Op:
    """A node to be created by a rewrite: its op kind, attrs and learned params
    (`Op("rms_norm", params={"scale": Param(...)}, eps=1e-6)`)."""

    kind: str
    attrs: dict = field(default_factory=dict)
    params: dict[str, Param] = field(default_factory=dict)

    def __init__(self, kind: str, params: dict[str, Param] | None = None, **attrs):
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "attrs", attrs)
        object.__setattr__(self, "params", params or {})


@dataclass
class Node:
    region: str
    name: str
    op: str
    type: TensorType
    attrs: Attrs  # the op's own dataclass (ops.py)
    params: dict[str, Param]
    source: str  # the spec field it comes from: `specs/x.py: decoder.attention`
    label: str  # what the source declares: "attention", "mlp", ... or the pass that made the node
    passes: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.region}/{self.name}"


@dataclass
class Region:
    name: str
    repeat: int
    function: str  # the emitted function that computes one repeat of the region
    dag: nx.MultiDiGraph = field(default_factory=nx.MultiDiGraph)
    output: str | None = None
    # What passes and lowering decide for the whole region: its remat policy, the auxiliary outputs it returns.
    attrs: dict = field(default_factory=dict)
    passes: tuple[str, ...] = ()  # the passes that set its attrs


@dataclass(frozen=True)
class Subgraph:
    """Nodes of one region, the outside nodes they read, and the one node whose value leaves them."""

    nodes: tuple[Node, ...]
    inputs: tuple[Node, ...]
    output: Node


class Graph:
    def __init__(self, name: str):
        self.name = name
        self.regions: dict[str, Region] = {}
        self.attrs: dict = {}  # what lowering decides for the whole program: mesh, sharding rules, aux losses
        self._pass: tuple[str, str] | None = None  # (pass name, its feature's provenance) while a pass runs

    # --- building -------------------------------------------------------------------------------------------------

    def add_region(self, name: str, repeat: int = 1, function: str = "forward") -> Region:
        if name in self.regions:
            raise GraphError(f"region {name!r} exists")
        self.regions[name] = Region(name, repeat, function)
        return self.regions[name]

    def add(
        self,
        region: str,
        name: str,
        op: str,
        inputs: dict[str, Node] | None = None,
        params: dict[str, Param] | None = None,
        source: str = "",
        label: str = "",
        **attrs,
    ) -> Node:
        """Adds a node, checking its input slots and inferring its output type from the op's shape rule."""
        inputs, params = inputs or {}, params or {}
        dag = self.regions[region].dag
        name = self._unique(region, name)
        typed = self._attrs(region, name, op, OPS[op].attrs if op in OPS else None, attrs)
        node_type = self._infer(region, name, op, inputs, typed, params)
        passes = (self._pass[0],) if self._pass else ()
        source = source or (self._pass[1] if self._pass else "")
        label = label or (self._pass[0] if self._pass else op)
        node = Node(region, name, op, node_type, typed, params, source, label, passes)
        dag.add_node(name, node=node)
        for slot, src in inputs.items():
            dag.add_edge(src.name, name, key=slot)
        return node

    def set_output(self, node: Node) -> None:
        self.regions[node.region].output = node.name

    def _unique(self, region: str, name: str) -> str:
        dag, candidate, n = self.regions[region].dag, name, 1
        while candidate in dag:
            n += 1
            candidate = f"{name}_{n}"
        return candidate

    @staticmethod
    def _attrs(
        region: str, name: str, op: str, cls: type[Attrs] | None, values: dict, base: Attrs | None = None
    ):
        """The op's typed attrs from `values` (over `base`, when rewriting); an unknown or missing one is an error."""
        if cls is None:
            raise GraphError(f"{region}/{name}: unknown op {op!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise GraphError(
                f"{region}/{name}: op {op} has no attr {unknown[0]!r}; it has {', '.join(sorted(known))}"
            )
        try:
            return dataclasses.replace(base, **values) if base is not None else cls(**values)
        except TypeError as err:
            raise GraphError(f"{region}/{name} ({op}): {err}") from None

    def _infer(self, region, name, op, inputs, attrs, params) -> TensorType:
        if op not in OPS:
            raise GraphError(f"{region}/{name}: unknown op {op!r}")
        if set(inputs) != set(OPS[op].slots):
            raise GraphError(f"{region}/{name}: op {op} takes inputs {OPS[op].slots}, got {tuple(inputs)}")
        for src in inputs.values():
            if src.region != region:
                raise GraphError(f"{region}/{name}: input {src} is in another region")
        try:
            return OPS[op].rule({slot: src.type for slot, src in inputs.items()}, attrs, params)
        except ShapeError as err:
            raise GraphError(f"{region}/{name} ({op}): {err}") from None

    # --- reading --------------------------------------------------------------------------------------------------

    def nodes(self, op: str | None = None, region: str | None = None) -> Iterator[Node]:
        """Nodes in region order, each region in a deterministic topological order."""
        for reg in self.regions.values():
            if region is not None and reg.name != region:
                continue
            for name in nx.lexicographical_topological_sort(reg.dag, key=self._order_key(reg)):
                node = reg.dag.nodes[name]["node"]
                if op is None or node.op == op:
                    yield node

    def _order_key(self, region: Region):
        """Topological ties break by insertion order, so emitted code follows the order the spec describes."""
        position = {name: i for i, name in enumerate(region.dag.nodes)}
        return lambda name: position[name]

    def node(self, region: str, name: str) -> Node:
        return self.regions[region].dag.nodes[name]["node"]

    def inputs(self, node: Node) -> dict[str, Node]:
        dag = self.regions[node.region].dag
        slots = OPS[node.op].slots
        found = {key: self.node(node.region, src) for src, _, key in dag.in_edges(node.name, keys=True)}
        return {slot: found[slot] for slot in slots}

    def output(self, region: str) -> Node:
        return self.node(region, self.regions[region].output)

    def blocks(self) -> list[Region]:
        return [r for r in self.regions.values() if r.name != "main"]

    # --- rewriting (what passes call) -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def applying(self, pass_name: str, source: str) -> Iterator[None]:
        """Within this scope, new and changed nodes record `pass_name` and, when new, `source`: the feature's
        provenance."""
        self._pass = (pass_name, source)
        try:
            yield
        finally:
            self._pass = None

    def update(self, node: Node, params: dict[str, Param] | None = None, **attrs) -> Node:
        """Sets attrs on `node` and adds `params` (a rewrite that keeps its inputs); its shape rule must still hold."""
        inputs = self.inputs(node)
        node.attrs = self._attrs(node.region, node.name, node.op, type(node.attrs), attrs, node.attrs)
        node.params = {**node.params, **(params or {})}
        self._infer(node.region, node.name, node.op, inputs, node.attrs, node.params)
        self._touch(node)
        return node

    def set_region_attrs(self, region: str, **attrs) -> None:
        reg = self.regions[region]
        reg.attrs.update(attrs)
        if self._pass and self._pass[0] not in reg.passes:
            reg.passes = (*reg.passes, self._pass[0])

    def subgraph(self, region: str, keep: Callable[[Node], bool]) -> Subgraph:
        """The nodes of `region` that `keep` selects; exactly one of them may be read from outside."""
        dag = self.regions[region].dag
        nodes = tuple(n for n in self.nodes(region=region) if keep(n))
        names = {n.name for n in nodes}
        inputs = {src: None for n in nodes for src, _ in dag.in_edges(n.name) if src not in names}
        exits = [
            n
            for n in nodes
            if n.name == self.regions[region].output or any(d not in names for d in dag.successors(n.name))
        ]
        if len(exits) != 1:
            raise GraphError(
                f"{region}: the selected nodes must have one output, found {[str(n) for n in exits]}"
            )
        return Subgraph(nodes, tuple(self.node(region, src) for src in inputs), exits[0])

    def replace(self, old: Subgraph, new: Node) -> None:
        """Routes every reader of `old.output` to `new`, then removes `old`'s nodes."""
        region = self.regions[new.region]
        for _, reader, slot in list(region.dag.out_edges(old.output.name, keys=True)):
            region.dag.add_edge(new.name, reader, key=slot)
            self._touch(self.node(new.region, reader))
        if region.output == old.output.name:
            region.output = new.name
        region.dag.remove_nodes_from(n.name for n in old.nodes)

    def split_block(self, scan: Node, every: int, name: str, function: str) -> Region:
        """Gives every `every`-th layer of `scan`'s last block a copy of its own, to be rewritten apart.

        The scan then runs its old blocks and the copy in turn, `repeat / every` times; passes rewrite the copy.
        """
        source = self.regions[scan.attrs.blocks[-1]]
        if source.repeat % every:
            raise GraphError(f"{source.name}: {source.repeat} layers do not split into groups of {every}")
        steps = source.repeat // every
        copied = self._copy_block(source, name, steps, function)
        source.repeat -= steps
        self.update(scan, blocks=(*scan.attrs.blocks, name), steps=steps)
        return copied

    def split_tail(self, scan: Node, count: int, name: str, function: str) -> Node:
        """Gives the last `count` layers of a one-block `scan` a copy of the block, run by a scan of their own after
        it, so that the layers before split into whole groups (Gemma 3 27B: 62 layers, 10 groups of 6 and 2 more
        windowed ones). Returns the new scan."""
        source = self.regions[scan.attrs.blocks[0]]
        if len(scan.attrs.blocks) != 1 or not 0 < count < source.repeat:
            raise GraphError(f"{scan}: cannot run the last {count} of {source.repeat} layers apart")
        self._copy_block(source, name, count, function)
        source.repeat -= count
        self.update(scan, steps=source.repeat)
        dag = self.regions[scan.region].dag
        consumers = list(dag.out_edges(scan.name, keys=True))
        if len(consumers) != 1:
            raise GraphError(f"{scan}: its output has {len(consumers)} consumers, not one")
        [(_, consumer, slot)] = consumers
        inputs = self.inputs(scan)
        tail = self.add(
            scan.region,
            name,
            "scan",
            {"x": scan, "positions": inputs["positions"], "segment_ids": inputs["segment_ids"]},
            source=scan.source,
            label=scan.label,
            blocks=(name,),
            steps=count,
        )
        dag.remove_edge(scan.name, consumer, key=slot)
        dag.add_edge(tail.name, consumer, key=slot)
        self._touch(self.node(scan.region, consumer))
        return tail

    def split_head(self, scan: Node, count: int, name: str, function: str) -> Node:
        """Gives the first `count` layers of a one-block `scan` a copy of the block, run by a scan of their own before
        it, to be rewritten apart (DeepSeek's first_k_dense_replace: dense layers before the MoE ones); the mirror
        of `split_tail`. Returns the new scan."""
        source = self.regions[scan.attrs.blocks[0]]
        if len(scan.attrs.blocks) != 1 or not 0 < count < source.repeat:
            raise GraphError(f"{scan}: cannot run the first {count} of {source.repeat} layers apart")
        self._copy_block(source, name, count, function)
        source.repeat -= count
        self.update(scan, steps=source.repeat)
        inputs = self.inputs(scan)
        head = self.add(
            scan.region,
            name,
            "scan",
            {"x": inputs["x"], "positions": inputs["positions"], "segment_ids": inputs["segment_ids"]},
            source=scan.source,
            label=scan.label,
            blocks=(name,),
            steps=count,
        )
        dag = self.regions[scan.region].dag
        dag.remove_edge(inputs["x"].name, scan.name, key="x")
        dag.add_edge(head.name, scan.name, key="x")
        self._touch(scan)
        return head

    def resize(self, nodes: tuple[Node, ...], axis: str, size: int) -> None:
        """Gives the params of `nodes` (one region's, in topological order, each reading only nodes before it or
        outside them) `size` along `axis`, and infers their types again. The last one's type must not change: nodes
        outside read it."""
        before = nodes[-1].type
        for node in nodes:
            node.params = {role: _resized(p, axis, size) for role, p in node.params.items()}
            node.type = self._infer(
                node.region, node.name, node.op, self.inputs(node), node.attrs, node.params
            )
            self._touch(node)
        if nodes[-1].type != before:
            raise GraphError(
                f"{nodes[-1]}: resizing {axis} to {size} changes its type {before} -> {nodes[-1].type}"
            )

    def _copy_block(self, source: Region, name: str, repeat: int, function: str) -> Region:
        copied = self.add_region(name, repeat=repeat, function=function)
        copied.attrs = copy.deepcopy(source.attrs)
        for node_name, data in source.dag.nodes(data=True):
            copied.dag.add_node(node_name, node=dataclasses.replace(data["node"], region=name))
        copied.dag.add_edges_from(source.dag.edges(keys=True))
        copied.output = source.output
        return copied

    def insert_on_input(self, node: Node, slot: str, op: Op, **extra_inputs: Node) -> Node:
        """Puts a new `op` node between `node` and the producer of its input `slot`; returns the new node."""
        producer = self.inputs(node)[slot]
        new = self.add(
            node.region,
            f"{producer.name}_{op.kind}",
            op.kind,
            {"x": producer, **extra_inputs},
            op.params,
            **op.attrs,
        )
        self.rewire(node, slot, new)
        return new

    def rewire(self, node: Node, slot: str, producer: Node) -> None:
        """Makes `producer` (of the same region) what `node` reads in its input `slot`."""
        dag = self.regions[node.region].dag
        dag.remove_edge(self.inputs(node)[slot].name, node.name, key=slot)
        dag.add_edge(producer.name, node.name, key=slot)
        self._touch(node)

    def _touch(self, node: Node) -> None:
        if self._pass and self._pass[0] not in node.passes:
            node.passes = (*node.passes, self._pass[0])

    # --- text form ------------------------------------------------------------------------------------------------

    def dump(self) -> str:
        """A stable text form: regions in order, nodes topologically sorted, no ids or addresses."""
        lines = [f"graph {self.name}"]
        lines += [f"  {key}={_text(value)}" for key, value in self.attrs.items()]
        for region in self.regions.values():
            repeat = f" repeat={region.repeat}" if region.repeat > 1 else ""
            attrs = "".join(f" {k}={_text(v)}" for k, v in sorted(region.attrs.items()))
            lines.append(f"region {region.name}{repeat}{attrs}")
            for node in self.nodes(region=region.name):
                lines.append("  " + _dump_node(self, node))
            lines.append(f"  return {region.output}")
        return "\n".join(lines) + "\n"


def _resized(param: Param, axis: str, size: int) -> Param:
    sizes = tuple(size if a == axis else s for a, s in zip(param.type.axes, param.type.sizes))
    return dataclasses.replace(param, type=TensorType(param.type.axes, sizes))


def _dump_node(graph: Graph, node: Node) -> str:
    args = ", ".join(f"{slot}={src.name}" for slot, src in graph.inputs(node).items())
    attrs = "".join(f" {k}={_text(v)}" for k, v in node.attrs.changed().items() if k != "type")
    params = "".join(f" {role}:{p}" for role, p in sorted(node.params.items()))
    passes = f" passes={','.join(node.passes)}" if node.passes else ""
    return f"{node.name} = {node.op}({args}){attrs}{params} -> {node.type}  # {node.label} · {node.source}{passes}"


def _text(value) -> str:
    """Tuples and dicts as short comma lists, so a dump line stays readable."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple):
        return "(" + ",".join(_text(v) for v in value) + ")"
    return str(value)
