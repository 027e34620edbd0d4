"""The graph IR: named regions (the main program and repeated blocks) of op nodes over networkx.

A block is a region with `repeat=N`: one decoder layer, emitted as a `jax.lax.scan` over stacked params, so a
pass that rewrites the block rewrites all N layers. Node names are unique within a region and become the emitted
variable names. Every node records provenance: the spec line it came from and the passes that made or changed it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import networkx as nx

from axgen.ir.ops import OPS, ShapeError
from axgen.ir.types import Param, TensorType


class GraphError(ValueError):
    pass


@dataclass(frozen=True)
class Op:
    """A node to be created by a rewrite: its op kind and attrs (`Op("rope", theta=1e4)`)."""

    kind: str
    attrs: dict = field(default_factory=dict)

    def __init__(self, kind: str, **attrs):
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "attrs", attrs)


@dataclass
class Node:
    region: str
    name: str
    op: str
    type: TensorType
    attrs: dict
    params: dict[str, Param]
    source: str  # spec file:line
    label: str  # what the source line declares: "attention", "mlp", ... or the pass that made the node
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


class Graph:
    def __init__(self, name: str):
        self.name = name
        self.regions: dict[str, Region] = {}
        self._pass: tuple[str, str] | None = None  # (pass name, spec source) while a pass runs

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
        node_type = self._infer(region, name, op, inputs, attrs, params)
        passes = (self._pass[0],) if self._pass else ()
        source = source or (self._pass[1] if self._pass else "")
        label = label or (self._pass[0] if self._pass else op)
        node = Node(region, name, op, node_type, attrs, params, source, label, passes)
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
        """Within this scope, new and changed nodes record `pass_name` and, when new, the feature's spec line."""
        self._pass = (pass_name, source)
        try:
            yield
        finally:
            self._pass = None

    def insert_on_input(self, node: Node, slot: str, op: Op, **extra_inputs: Node) -> Node:
        """Puts a new `op` node between `node` and the producer of its input `slot`; returns the new node."""
        dag = self.regions[node.region].dag
        producer = self.inputs(node)[slot]
        new = self.add(node.region, f"{producer.name}_{op.kind}", op.kind, {"x": producer, **extra_inputs}, **op.attrs)
        dag.remove_edge(producer.name, node.name, key=slot)
        dag.add_edge(new.name, node.name, key=slot)
        self._touch(node)
        return new

    def _touch(self, node: Node) -> None:
        if self._pass and self._pass[0] not in node.passes:
            node.passes = (*node.passes, self._pass[0])

    # --- text form ------------------------------------------------------------------------------------------------

    def dump(self) -> str:
        """A stable text form: regions in order, nodes topologically sorted, no ids or addresses."""
        lines = [f"graph {self.name}"]
        for region in self.regions.values():
            lines.append(f"region {region.name}" + (f" repeat={region.repeat}" if region.repeat > 1 else ""))
            for node in self.nodes(region=region.name):
                lines.append("  " + _dump_node(self, node))
            lines.append(f"  return {region.output}")
        return "\n".join(lines) + "\n"


def _dump_node(graph: Graph, node: Node) -> str:
    args = ", ".join(f"{slot}={src.name}" for slot, src in graph.inputs(node).items())
    attrs = "".join(f" {k}={v}" for k, v in sorted(node.attrs.items()) if k != "type")
    params = "".join(f" {role}:{p}" for role, p in sorted(node.params.items()))
    passes = f" passes={','.join(node.passes)}" if node.passes else ""
    return f"{node.name} = {node.op}({args}){attrs}{params} -> {node.type}  # {node.label} · {node.source}{passes}"
