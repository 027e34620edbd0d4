"""PEFT's LoRA adapters, both ways: a folder `PeftModel.save_pretrained` wrote (adapter_config.json and
adapter_model.safetensors) read into a program's adapters (F.lora), a program's adapters written as one that
`PeftModel.from_pretrained` loads, and the adapters merged into their weights (`merge_and_unload`).

The tensors' names and layouts come from the params themselves: F.lora gives each adapter its PEFT name
(`base_model.model.model.layers.{layer}.self_attn.q_proj.lora_A.weight`, [rank, in]), which the HF machinery of
axgen/interop.py reads and writes as it reads and writes a model's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from axgen.interop import CheckpointError, iter_hf_tensors, params_of
from axgen.spec import LoRA, Model
from axgen.spec.feature_configs import LORA_TARGETS

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


class AdapterError(CheckpointError):
    """An adapter folder that does not fit the spec: one line naming the file, the key and the value."""


def lora_of(spec: Model) -> LoRA:
    lora = spec.feature("lora")
    if lora is None:
        raise AdapterError(f"{spec.name} has no F.lora: add F.lora(rank=..., alpha=...) to its features")
    return lora


def check_config(folder: Path, spec: Model) -> dict:
    """The folder's adapter_config.json, refused in one line where it asks for what the spec's F.lora does not
    train: another rank, alpha or set of modules, or an option axgen does not implement."""
    path, lora = Path(folder) / CONFIG, lora_of(spec)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise AdapterError(f"{path}: not a PEFT adapter config ({err})") from None

    def refuse(key: str, why: str):
        raise AdapterError(f"{path}: {key}={config.get(key)!r} {why}")

    if config.get("peft_type") != "LORA":
        refuse("peft_type", "is not LORA")
    if config.get("r") != lora.rank:
        refuse("r", f"differs from the spec's F.lora(rank={lora.rank})")
    if config.get("lora_alpha") != lora.alpha:
        refuse("lora_alpha", f"differs from the spec's F.lora(alpha={lora.alpha})")
    for key, value in (("rank_pattern", lora.rank), ("alpha_pattern", lora.alpha)):
        if any(v != value for v in (config.get(key) or {}).values()):
            refuse(key, "gives some modules their own value; F.lora has one for every module")
    targets = config.get("target_modules")
    targets = LORA_TARGETS if targets == "all-linear" else targets
    if not isinstance(targets, list | tuple) or set(targets) != set(lora.targets):
        refuse("target_modules", f"are not the spec's F.lora(targets={tuple(lora.targets)})")
    if bool(config.get("use_rslora")) != lora.use_rslora:
        refuse("use_rslora", f"differs from the spec's F.lora(use_rslora={lora.use_rslora})")
    unsupported = {
        "use_dora": "(DoRA) is not implemented by F.lora",
        "bias": "trains biases; F.lora trains A and B only",
        "modules_to_save": "trains whole modules beside the adapters; F.lora trains A and B only",
        "layers_to_transform": "adapts some layers only; F.lora adapts every layer",
        "fan_in_fan_out": "stores weights [in, out] (GPT-2's Conv1D); Llama-family Linear layers are [out, in]",
    }
    for key, why in unsupported.items():
        if config.get(key) not in (None, False, "none", [], {}):
            refuse(key, why)
    return config


def read_adapter(folder, spec: Model) -> dict:
    """The spec's adapters (a params tree of them alone) from a PEFT adapter folder."""
    from safetensors.numpy import load_file

    check_config(folder, spec)
    path = Path(folder) / WEIGHTS
    try:
        tensors = {_without_adapter_name(name): t for name, t in load_file(str(path)).items()}
    except (OSError, ValueError) as err:
        raise AdapterError(f"{path}: not a readable safetensors file ({err})") from None
    try:
        params = params_of(tensors, spec, adapters=True)
    except CheckpointError as err:
        raise AdapterError(f"{path}: {err}") from None
    unused = sorted(set(tensors) - set(dict(iter_hf_tensors(params, spec, adapters=True))))
    if unused:
        raise AdapterError(f"{path}: tensor {unused[0]!r} is not an adapter of {spec.name}'s F.lora")
    return params


def _without_adapter_name(name: str) -> str:
    """PEFT saves the default adapter's tensors without its name; a named one keeps `.NAME` before `.weight`."""
    return name.replace(".default.weight", ".weight")


def adapter_config(spec: Model, base_name: str | None) -> dict:
    """adapter_config.json for the spec's F.lora, as PEFT writes it for a causal language model."""
    lora = lora_of(spec)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": sorted(lora.targets),
        "use_rslora": lora.use_rslora,
        "lora_dropout": lora.dropout,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
    }


def adapter_tensors(params: dict, spec: Model, dtype=None) -> dict[str, np.ndarray]:
    """The adapters of a params tree as PEFT's file names and lays them out."""
    return dict(iter_hf_tensors(params, spec, dtype, adapters=True))


def merged(params: dict, spec: Model) -> dict:
    """The params with each adapter merged into its weight, W + scale * A B (PEFT's `merge_and_unload`), and no
    adapters left: the params of the spec without F.lora."""
    scale = lora_of(spec).scale

    def merge(tree: dict) -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = merge(value)
            elif not key.endswith(("_lora_a", "_lora_b")):
                out[key] = value
        for key in [k for k in tree if k.endswith("_lora_a")]:
            weight, a, b = (
                key.removesuffix("_lora_a"),
                np.asarray(tree[key]),
                np.asarray(tree[key[:-1] + "b"]),
            )
            rank = a.shape[-1]
            # Stacked over the layers: [layers, in..., rank] x [layers, rank, out...] -> the weight's shape.
            delta = np.einsum(
                "lir,lro->lio", a.reshape(a.shape[0], -1, rank), b.reshape(b.shape[0], rank, -1)
            )
            # In float32 whatever the base's dtype: export-hf writes the dtype it is asked for.
            w = np.asarray(out[weight], np.float32)
            out[weight] = w + scale * delta.reshape(w.shape)
        return out

    return merge(params)
