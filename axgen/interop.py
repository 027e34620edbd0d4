"""Interop with other code: import an emitted program as a module, and load Hugging Face weights into it.

    program = load_program("generated/llama_tiny/cpu_1.py")
    params = hf_to_params(safetensors.numpy.load_file("model.safetensors"), spec)
    logits = program.forward(params, tokens)      # tokens: int32 [batch, seq]

Reads checkpoints of every HF family axgen writes (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE,
Gemma 2 and 3, gpt-oss, DeepSeek-V2 and V3) in the family's names, as its adapter states them
(`axgen.hf.adapter.Family.from_hf`): routed experts fused as transformers 5 holds them in memory or one tensor per
expert as the Hub does, DeepSeek's `shared_experts`, gpt-oss's MXFP4 experts and DeepSeek-V3's FP8 blocks
dequantized.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
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


def host_jax():
    """jax for checkpoint I/O on the host: no accelerator plugin starts (or complains) for it."""
    import jax

    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    return jax


class CheckpointError(ValueError):
    """One line naming the tensor (and file) of a checkpoint that does not fit the spec."""


def hf_to_params(state_dict, spec: Model, dtype=np.float32, fp8_block: tuple[int, int] | None = None) -> dict:
    """A Hugging Face state dict (name -> array, or a .safetensors path) as the emitted program's params.

    The state dict is read in the names of the spec's family (`axgen.hf.families`), either expert layout. Every param
    of the spec's graph says where it lives in an HF checkpoint (`Param.hf`, set by the graph builder and by the
    pass that made the param): the tensor's name, with `{layer}` for the layer index, whether torch stores it
    [out, in], and which part of a fused tensor it is. Params of a block are stacked over its layers in the order
    the scan runs them. A param that HF checkpoints lack (an fp8 amax history) starts from its init, zeros.
    `dtype=None` keeps each tensor's own dtype. FP8 blocks are `fp8_block` (rows, columns) in size: the
    quantization_config's weight_block_size, which a .safetensors path's config.json beside it states.
    """
    from axgen.hf.families import FAMILIES, family_name
    from axgen.hf.storage import fp8_block_size

    source = "the checkpoint"
    if isinstance(state_dict, (str, Path)):
        from safetensors.numpy import load_file

        source = str(state_dict)
        state_dict = load_file(source)
    if fp8_block is not None:
        block_size = lambda scale: fp8_block  # noqa: E731
    elif source != "the checkpoint":
        block_size = lambda scale: fp8_block_size(Path(source).parent, scale)  # noqa: E731
    else:

        def block_size(scale: str):
            raise CheckpointError(
                f"the checkpoint holds {scale!r}: pass fp8_block=(rows, columns) of its blocks"
            )

    view = FAMILIES[family_name(spec)].from_hf(state_dict, spec, hf_shapes(spec), source, block_size)
    return params_of(view, spec, dtype)


def params_of(checkpoint, spec: Model, dtype=np.float32, adapters: bool = False) -> dict:
    """`hf_to_params` of a checkpoint already in the params' names (`Family.from_hf`'s view); with `adapters`, the
    adapters (F.lora) of a PEFT adapter file instead."""
    params: dict = {}
    for block, param, layers in hf_layout(spec, adapters):
        if layers is None:
            params[param.key] = _hf_tensor(checkpoint, param, None, dtype)
            continue
        first = _hf_tensor(checkpoint, param, layers[0], dtype)
        stacked = np.empty(
            (len(layers), *first.shape), first.dtype
        )  # filled a layer at a time: no second copy
        stacked[0] = first
        for row, layer in enumerate(layers[1:], 1):
            stacked[row] = _hf_tensor(checkpoint, param, layer, dtype)
        params.setdefault(block, {})[param.key] = stacked
    return params


def hf_layout(spec: Model, adapters: bool = False) -> list[tuple[str | None, Param, list[int] | None]]:
    """(block, param, the HF layer index of each of its stacked rows) for every param of the spec's program, in
    order; block and layers are None for a param outside the decoder's scan. The params of the model's own
    checkpoint, or with `adapters` those of its PEFT adapter file (F.lora)."""
    graph = from_spec(spec)
    run_passes(graph, spec.features)
    layout, first = [], 0  # first: the HF index of the scan's first layer; a later scan runs the layers after
    for node in graph.nodes(region="main"):
        if node.op == "scan":
            for block, layers in _block_layers(graph, node, first).items():
                layout += [(block, p, layers) for n in graph.nodes(region=block) for p in n.params.values()]
                first += len(layers)
        layout += [(None, p, None) for p in node.params.values()]
    return [entry for entry in layout if entry[1].adapter == adapters]


def params_to_hf(params: dict, spec: Model, dtype=None) -> dict[str, np.ndarray]:
    """The inverse of `hf_to_params`: the HF state dict of a program's params in its family's names as transformers
    5 holds them in memory (routed experts fused), each tensor in `dtype` (None: as stored)."""
    from axgen.hf.families import FAMILIES, family_name

    return dict(FAMILIES[family_name(spec)].to_hf(iter_hf_tensors(params, spec, dtype), fused_experts=True))


def iter_hf_tensors(
    params: dict, spec: Model, dtype=None, adapters: bool = False
) -> Iterator[tuple[str, np.ndarray]]:
    """The HF tensors of a program's params one at a time, so a writer holds one at once. A fused HF tensor comes
    once all the params that are its parts have. With `adapters`, the PEFT tensors of its adapters (F.lora).
    """
    layout = hf_layout(spec, adapters)
    values = [_param_value(params, block, param, layers, spec) for block, param, layers in layout]
    parts: dict[str, dict[int, np.ndarray]] = {}
    for (_, param, layers), value in zip(layout, values):
        for row, name in enumerate(hf_names(param, layers)):
            tensor = _to_hf(name, np.asarray(value if layers is None else value[row]), param, dtype)
            if param.hf.chunk is None and param.hf.interleave is None:
                yield name, tensor
                continue
            index, count = param.hf.chunk or param.hf.interleave
            parts.setdefault(name, {})[index] = tensor
            if len(parts[name]) == count:
                done = parts.pop(name)
                chunks = [done[i] for i in range(count)]
                if param.hf.chunk is not None:
                    yield name, np.concatenate(chunks, axis=-2)
                else:  # column j of part i is column j * count + i of the whole
                    yield name, np.stack(chunks, axis=-1).reshape(*chunks[0].shape[:-1], -1)


def _param_value(params: dict, block: str | None, param: Param, layers: list[int] | None, spec: Model):
    path = param.key if block is None else f"{block}/{param.key}"
    value = (params if block is None else params.get(block, {})).get(param.key)
    if value is None:
        raise CheckpointError(
            f"the checkpoint has no param {path} of {spec.name}: a checkpoint of another model?"
        )
    shape = (len(layers), *param.shape) if layers is not None else param.shape
    if tuple(value.shape) != tuple(shape):
        raise CheckpointError(
            f"the checkpoint's param {path} is {list(value.shape)}; {spec.name} needs {list(shape)}"
        )
    return value


def _to_hf(name: str, tensor: np.ndarray, param: Param, dtype) -> np.ndarray:
    tensor = tensor.reshape(_hf_view(param))
    if param.hf.transpose:
        tensor = np.swapaxes(tensor, -1, -2)
    # numpy's overflow warning would be a second line on stderr: the check below names the tensor instead.
    with np.errstate(over="ignore"):
        converted = np.ascontiguousarray(tensor, dtype=dtype)
    if dtype is not None and not np.isfinite(converted).all():
        _refuse_overflow(name, tensor, converted)
    return converted


def _refuse_overflow(name: str, tensor: np.ndarray, converted: np.ndarray) -> None:
    """A weight beyond the range of a narrower dtype (float16's 65504) would be written as inf, a model that
    computes NaN."""
    overflowed = np.isfinite(tensor) & ~np.isfinite(converted)
    if overflowed.any():
        largest = float(np.abs(tensor[overflowed].astype(np.float64)).max())
        limit = float(ml_dtypes.finfo(converted.dtype).max)
        wider = "bfloat16 or float32" if converted.dtype == np.float16 else "float32"
        raise CheckpointError(
            f"tensor {name}: its largest absolute value, {largest:.6g}, is beyond {converted.dtype}'s range "
            f"(at most {limit:.6g}): export with --dtype {wider}"
        )


def _hf_view(param: Param) -> tuple[int, ...]:
    """The param's shape as HF lays it out before any transpose: a head's axes are one ((heads, head_dim) ->
    heads * head_dim), and a Linear to a single output keeps that output's unit axis."""
    shape: list[int] = []
    previous = None
    for axis, size in zip(param.type.axes, param.shape):
        if axis == "head_dim" and previous in ("heads", "kv_heads"):
            shape[-1] *= size
        else:
            shape.append(size)
        previous = axis
    if param.hf.transpose and len(shape) == 1:
        shape.append(1)
    return tuple(shape)


def hf_shape(param: Param) -> tuple[int, ...]:
    """The shape of the HF tensor that holds the param (one layer of it): a fused tensor's, for one of its parts."""
    shape = list(_hf_view(param))
    if param.hf.transpose:
        shape[-2:] = shape[-1], shape[-2]
    if param.hf.chunk is not None:
        shape[-2] *= param.hf.chunk[1]
    if param.hf.interleave is not None:
        shape[-1] *= param.hf.interleave[1]
    return tuple(shape)


def hf_shapes(spec: Model) -> dict[str, tuple[int, ...]]:
    """Each HF tensor the spec reads, with its shape."""
    return {name: hf_shape(param) for _, param, layers in hf_layout(spec) for name in hf_names(param, layers)}


def hf_names(param: Param, layers: list[int] | None) -> list[str]:
    """The HF tensors a param reads: one per layer it stacks."""
    if param.hf is None:
        return []
    return [param.hf.name.format(layer=layer) for layer in (layers or [None])]


def _block_layers(graph: Graph, scan: Node, start: int) -> dict[str, list[int]]:
    """Each block's layer indices, from `start`: a scan step runs each block's share of the step's layers in turn."""
    per_step = {block: graph.regions[block].repeat // scan.attrs.steps for block in scan.attrs.blocks}
    step_size, layers = sum(per_step.values()), {block: [] for block in per_step}
    for step in range(scan.attrs.steps):
        first = start + step * step_size
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
    if tuple(tensor.shape) != hf_shape(param):
        # Also where the sizes agree: a transposed tensor reshaped to fit would be wrong weights.
        raise CheckpointError(
            f"tensor {name!r} has shape {list(tensor.shape)}; param {param.key} needs {list(hf_shape(param))}"
        )
    if param.hf.chunk is not None:
        tensor = np.split(tensor, param.hf.chunk[1], axis=-2)[param.hf.chunk[0]]
    if param.hf.interleave is not None:
        index, count = param.hf.interleave
        tensor = tensor[..., index::count]
    if param.hf.transpose:
        tensor = np.swapaxes(tensor, -1, -2)
    return tensor.reshape(param.shape)
