"""The graph IR: ops in named axes, regions for repeated blocks, provenance, a stable dump."""

from axgen.ir import cost
from axgen.ir.from_spec import LAYER, from_spec
from axgen.ir.graph import Graph, GraphError, Node, Op, Region
from axgen.ir.ops import OPS, Attrs, ScanCall, ShapeError, register_op, same_as
from axgen.ir.types import HFWeight, Param, TensorType

__all__ = [
    "LAYER",
    "OPS",
    "Attrs",
    "Graph",
    "GraphError",
    "HFWeight",
    "Node",
    "Op",
    "Param",
    "Region",
    "ScanCall",
    "ShapeError",
    "TensorType",
    "cost",
    "from_spec",
    "register_op",
    "same_as",
]
