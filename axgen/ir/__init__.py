"""The graph IR: ops in named axes, regions for repeated blocks, provenance, a stable dump."""

from axgen.ir import cost
from axgen.ir.from_spec import from_spec
from axgen.ir.graph import Graph, GraphError, Node, Op, Region
from axgen.ir.ops import OPS
from axgen.ir.types import Param, TensorType

__all__ = ["OPS", "Graph", "GraphError", "Node", "Op", "Param", "Region", "TensorType", "cost", "from_spec"]
