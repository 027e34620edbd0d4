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


def hf_to_params(state_dict, spec: Model) -> dict:
    """A Hugging Face state dict (name -> array, or a .safetensors path) as the emitted program's params.

    Every param of the spec's graph says where it lives in an HF checkpoint (`Param.hf`, set by the graph
    builder and by the pass that made the param): the tensor's name, with `{layer}` for the layer index, whether
    torch stores it [out, in], and which part of a fused tensor it is. Params of a block are stacked over its
    layers in the order the scan runs them. A param that HF checkpoints lack (an fp8 amax history) starts
    from its init, zeros.
    """
    if isinstance(state_dict, (str, Path)):
        from safetensors.numpy import load_file

        state_dict = load_file(str(state_dict))
    graph = from_spec(spec)
    run_passes(graph, spec.features)
    params: dict = {}
    for node in graph.nodes(region="main"):
        if node.op == "scan":
            for block, layers in _block_layers(graph, node).items():
                region = graph.nodes(region=block)
                params[block] = {
                    p.key: np.stack([_hf_tensor(state_dict, p, i) for i in layers])
                    for n in region
                    for p in n.params.values()
                }
        params |= {p.key: _hf_tensor(state_dict, p, None) for p in node.params.values()}
    return params


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


def _hf_tensor(state_dict, param: Param, layer: int | None) -> np.ndarray:
    if param.hf is None:
        return np.zeros(param.shape, np.float32)
    name = param.hf.name.format(layer=layer)
    if name not in state_dict:
        raise KeyError(f"the checkpoint has no tensor {name!r} for param {param.key}{list(param.shape)}")
    tensor = np.asarray(state_dict[name], dtype=np.float32)
    if param.hf.chunk is not None:
        index, count = param.hf.chunk
        tensor = np.split(tensor, count, axis=-2)[index]
    if param.hf.transpose:
        tensor = np.swapaxes(tensor, -1, -2)
    tensor = tensor + np.float32(param.hf.offset)
    if tensor.size != math.prod(param.shape):
        raise ValueError(
            f"tensor {name!r} has shape {list(tensor.shape)}; param {param.key} needs {list(param.shape)}"
        )
    return tensor.reshape(param.shape)
