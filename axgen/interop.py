"""Interop with other code: import an emitted program as a module, and load Hugging Face weights into it.

    program = load_program("generated/llama_tiny/cpu_1.py")
    params = hf_to_params(safetensors.numpy.load_file("model.safetensors"), spec)
    logits = program.forward(params, tokens)      # tokens: int32 [batch, seq]

Reads `LlamaForCausalLM`, `MistralForCausalLM` and `MixtralForCausalLM` checkpoints (transformers 5 layout).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

from axgen.spec import LayerNorm, Model


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
    """A Llama, Mistral or Mixtral state dict (name -> array, or a .safetensors path) as the emitted program's params.

    HF stores linear weights [out_features, in_features] with heads contiguous along `out`; the emitted program
    keeps named axes, e.g. wq [embed, heads, head_dim], stacked over layers. Mixtral's experts are fused:
    gate_up_proj [experts, 2 * mlp, embed] with the gate rows first, down_proj [experts, embed, mlp].
    """
    if isinstance(state_dict, (str, Path)):
        from safetensors.numpy import load_file

        state_dict = load_file(str(state_dict))
    if isinstance(spec.decoder.norm, LayerNorm) or spec.decoder.mlp.activation != "swiglu":
        raise ValueError("hf_to_params converts Llama-family checkpoints: RMSNorm and a swiglu MLP")
    sd = {k: np.asarray(v, dtype=np.float32) for k, v in state_dict.items()}
    attn, d = spec.decoder.attention, spec.d_model

    def layer(i: int, name: str) -> np.ndarray:
        return sd[f"model.layers.{i}.{name}"]

    def layer_params(i: int) -> dict[str, np.ndarray]:
        params = {
            "attn_norm": layer(i, "input_layernorm.weight"),
            "wq": layer(i, "self_attn.q_proj.weight").T.reshape(d, attn.num_heads, attn.head_dim),
            "wk": layer(i, "self_attn.k_proj.weight").T.reshape(d, attn.num_kv_heads, attn.head_dim),
            "wv": layer(i, "self_attn.v_proj.weight").T.reshape(d, attn.num_kv_heads, attn.head_dim),
            "wo": layer(i, "self_attn.o_proj.weight").T.reshape(attn.num_heads, attn.head_dim, d),
            "mlp_norm": layer(i, "post_attention_layernorm.weight"),
        }
        if f"model.layers.{i}.mlp.gate.weight" not in sd:
            return params | {
                "w_gate": layer(i, "mlp.gate_proj.weight").T,
                "w_up": layer(i, "mlp.up_proj.weight").T,
                "w_down": layer(i, "mlp.down_proj.weight").T,
            }
        gate, up = np.split(layer(i, "mlp.experts.gate_up_proj"), 2, axis=1)
        return params | {
            "router": layer(i, "mlp.gate.weight").T,
            "w_gate": gate.transpose(0, 2, 1),
            "w_up": up.transpose(0, 2, 1),
            "w_down": layer(i, "mlp.experts.down_proj").transpose(0, 2, 1),
        }

    layers = [layer_params(i) for i in range(spec.decoder.num_layers)]
    dense = [p for p in layers if "router" not in p]
    sparse = [p for p in layers if "router" in p]
    stacks = {"layers": dense or sparse, "moe_layers": sparse if dense else []}
    params = {"embed": sd["model.embed_tokens.weight"]}
    params |= {name: stack_layers(stack) for name, stack in stacks.items() if stack}
    params["final_norm"] = sd["model.norm.weight"]
    if not spec.tie_embeddings:
        params["lm_head"] = sd["lm_head.weight"].T
    return params


def stack_layers(layers: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-layer param dicts -> one dict of arrays stacked over layers (the emitted program's scan layout)."""
    return {key: np.stack([layer[key] for layer in layers]) for key in layers[0]}
