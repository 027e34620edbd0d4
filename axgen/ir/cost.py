"""Parameter and FLOP counts read off the graph after the passes, so every rewrite is counted without extra code."""

from __future__ import annotations

import dataclasses
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


def forward_flops_per_token(graph: Graph, seq_len: int) -> int:
    """FLOPs per token of a forward pass alone (DPO's reference): a third of training's with every weight trained,
    2 of each multiply-add's 6 and a third of attention's, frozen weights (4 in training: no weight gradient)
    included."""
    total = 0.0
    for node in graph.nodes():
        inputs = {slot: src.type for slot, src in graph.inputs(node).items()}
        params = {role: dataclasses.replace(p, frozen=False) for role, p in node.params.items()}
        total += _repeat(graph, node) * OPS[node.op].flops(inputs, node.attrs, params, seq_len)
    return round(total / 3)


def _flops(graph: Graph, node: Node, seq_len: int) -> float:
    inputs = {slot: src.type for slot, src in graph.inputs(node).items()}
    return OPS[node.op].flops(inputs, node.attrs, node.params, seq_len)


def _repeat(graph: Graph, node: Node) -> int:
    return graph.regions[node.region].repeat
