"""Parameter and FLOP counts read off the graph after the passes, so every rewrite is counted without extra code."""

from __future__ import annotations

import math

from axgen.ir.graph import Graph, Node

MATMUL_OPS = ("linear", "lm_head", "moe")


def num_params(graph: Graph) -> int:
    """Every learned value, embeddings included: each block's params count once per layer."""
    return sum(_repeat(graph, node) * _size(node) for node in graph.nodes())


def flops_per_token(graph: Graph, seq_len: int) -> int:
    """Training FLOPs per token: 6 per multiply-add of the weights a token uses (forward + backward), plus causal
    attention as in the PaLM paper's appendix B: 6 * 2 * seq * heads * head_dim per layer, halved by the mask.

    The input embedding is a gather and costs nothing; a mixture of experts costs its router and top_k experts.
    """
    matmuls = sum(
        _repeat(graph, node) * _matmul_weights(graph, node) for node in graph.nodes() if node.op in MATMUL_OPS
    )
    attention = sum(
        _repeat(graph, node) * 6 * seq_len * node.type.size("heads") * node.type.size("head_dim")
        for node in graph.nodes(op="attention")
    )
    return round(6 * matmuls + attention)


def _repeat(graph: Graph, node: Node) -> int:
    return graph.regions[node.region].repeat


def _size(node: Node) -> int:
    return sum(math.prod(p.shape) for p in node.params.values() if p.trained)


def _matmul_weights(graph: Graph, node: Node) -> float:
    if node.op == "lm_head" and node.attrs["tied"]:  # multiplies by the embedding table
        return node.attrs["vocab"] * graph.inputs(node)["x"].type.size("embed")
    if node.op == "moe":
        return _size(node) * node.attrs["top_k"] / node.params["w_up"].type.size("expert")
    return _size(node)
