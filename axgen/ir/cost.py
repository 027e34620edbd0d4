"""Parameter and FLOP counts read off the graph after the passes, so every rewrite is counted without extra code."""

from __future__ import annotations

from collections.abc import Callable

from axgen.ir.graph import Graph, Node
from axgen.ir.ops import OPS, trained_size


def num_params(graph: Graph) -> int:
    """Every learned value, embeddings included: each block's params count once per layer."""
    return sum(_repeat(graph, node) * trained_size(node.params) for node in graph.nodes())


def flops_per_token(graph: Graph, seq_len: int, where: Callable[[Node], bool] = lambda node: True) -> int:
    """Training FLOPs per token, each op's by its own rule (ops.py): 6 per multiply-add of the weights a token uses,
    plus attention as in the PaLM paper's appendix B. The input embedding is a gather and costs nothing. `where`
    picks the nodes counted."""
    return round(sum(_repeat(graph, n) * _flops(graph, n, seq_len) for n in graph.nodes() if where(n)))


def _flops(graph: Graph, node: Node, seq_len: int) -> float:
    inputs = {slot: src.type for slot, src in graph.inputs(node).items()}
    return OPS[node.op].flops(inputs, node.attrs, node.params, seq_len)


def _repeat(graph: Graph, node: Node) -> int:
    return graph.regions[node.region].repeat
