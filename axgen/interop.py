"""Interop with other code: import an emitted program as a module, and load Hugging Face weights into it.

    program = load_program("generated/llama_tiny/cpu_1.py")
    params = hf_to_params(safetensors.numpy.load_file("model.safetensors"), spec)
    logits = program.forward(params, tokens)      # tokens: int32 [batch, seq]

Reads checkpoints of every HF family whose params the spec's graph names (transformers 5 layout): Llama,
Mistral, Mixtral, Qwen2, Qwen3, Qwen2-MoE and Gemma 2 are tested.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np

from axgen.ir import Graph, Node, Param, from_spec
from axgen.passes import run_passes
from axgen.spec import Model


def load_program(path: str | Path):
    """Imports an emitted program file as a module (its `main()` does not run)."""
    path = Path(path).resolve()
    name = f"axgen_program_{path.parent.name}_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


class CheckpointError(ValueError):
    """One line naming the tensor (and file) of a checkpoint that does not fit the spec."""


def hf_to_params(state_dict, spec: Model, dtype=np.float32) -> dict:
    """A Hugging Face state dict (name -> array, or a .safetensors path) as the emitted program's params.

    Every param of the spec's graph says where it lives in an HF checkpoint (`Param.hf`, set by the graph
    builder and by the pass that made the param): the tensor's name, with `{layer}` for the layer index, whether
    torch stores it [out, in], and which part of a fused tensor it is. Params of a block are stacked over its
    layers in the order the scan runs them. A param that HF checkpoints lack (an fp8 amax history) starts
    from its init, zeros. `dtype=None` keeps each tensor's own dtype (a param with an offset, Gemma's norms,
    becomes float32, where the offset is exact).
    """
    if isinstance(state_dict, (str, Path)):
        from safetensors.numpy import load_file

        state_dict = load_file(str(state_dict))
    params: dict = {}
    for block, param, layers in hf_layout(spec):
        if layers is None:
            params[param.key] = _hf_tensor(state_dict, param, None, dtype)
        else:
            tensors = [_hf_tensor(state_dict, param, layer, dtype) for layer in layers]
            params.setdefault(block, {})[param.key] = np.stack(tensors)
    return params


def hf_layout(spec: Model) -> list[tuple[str | None, Param, list[int] | None]]:
    """(block, param, the HF layer index of each of its stacked rows) for every param of the spec's program, in
    order; block and layers are None for a param outside the decoder's scan."""
    graph = from_spec(spec)
    run_passes(graph, spec.features)
    layout = []
    for node in graph.nodes(region="main"):
        if node.op == "scan":
            for block, layers in _block_layers(graph, node).items():
                layout += [(block, p, layers) for n in graph.nodes(region=block) for p in n.params.values()]
        layout += [(None, p, None) for p in node.params.values()]
    return layout


def hf_names(param: Param, layers: list[int] | None) -> list[str]:
    """The HF tensors a param reads: one per layer it stacks."""
    if param.hf is None:
        return []
    return [param.hf.name.format(layer=layer) for layer in (layers or [None])]


def _block_layers(graph: Graph, scan: Node) -> dict[str, list[int]]:
    """Each block's layer indices: a scan step runs each block's share of the step's layers in turn."""
    per_step = {block: graph.regions[block].repeat // scan.attrs.steps for block in scan.attrs.blocks}
    step_size, layers = sum(per_step.values()), {block: [] for block in per_step}
    for step in range(scan.attrs.steps):
        first = step * step_size
        for block, count in per_step.items():
            layers[block] += range(first, first + count)
            first += count
    return layers


def _hf_tensor(state_dict, param: Param, layer: int | None, dtype) -> np.ndarray:
    if param.hf is None:
        return np.zeros(param.shape, dtype or np.float32)
    name = param.hf.name.format(layer=layer)
    if name not in state_dict:
        raise CheckpointError(
            f"the checkpoint has no tensor {name!r} for param {param.key}{list(param.shape)}"
        )
    tensor = np.asarray(state_dict[name], dtype=dtype)
    count = param.hf.chunk[1] if param.hf.chunk else 1
    if tensor.size != count * math.prod(param.shape):
        raise CheckpointError(
            f"tensor {name!r} has shape {list(tensor.shape)}; param {param.key} needs {list(param.shape)}"
            + (f" from each of its {count} parts" if count > 1 else "")
        )
    if param.hf.chunk is not None:
        tensor = np.split(tensor, count, axis=-2)[param.hf.chunk[0]]
    if param.hf.transpose:
        tensor = np.swapaxes(tensor, -1, -2)
    if param.hf.offset:
        tensor = tensor.astype(np.float32) + np.float32(param.hf.offset)
    return tensor.reshape(param.shape)
