"""Interop with other code: import an emitted program as a module, and load Hugging Face Llama weights into it.

    program = load_program("generated/llama_tiny/cpu_1.py")
    params = hf_llama_to_params(safetensors.numpy.load_file("model.safetensors"), spec)
    logits = program.forward(params, tokens)      # tokens: int32 [batch, seq]
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


def hf_llama_to_params(state_dict, spec: Model) -> dict:
    """A `LlamaForCausalLM` state dict (name -> array, or a .safetensors path) as the emitted program's params.

    HF stores linear weights [out_features, in_features] with heads contiguous along `out`; the emitted program
    keeps named axes, e.g. wq [embed, heads, head_dim], stacked over layers.
    """
    if isinstance(state_dict, (str, Path)):
        from safetensors.numpy import load_file

        state_dict = load_file(str(state_dict))
    if isinstance(spec.decoder.norm, LayerNorm) or spec.decoder.mlp.activation != "swiglu":
        raise ValueError("hf_llama_to_params converts Llama checkpoints: RMSNorm and a swiglu MLP")
    sd = {k: np.asarray(v, dtype=np.float32) for k, v in state_dict.items()}
    attn, d = spec.decoder.attention, spec.d_model

    def layer(i: int, name: str) -> np.ndarray:
        return sd[f"model.layers.{i}.{name}"]

    def per_layer(fn) -> np.ndarray:
        return np.stack([fn(i) for i in range(spec.decoder.num_layers)])

    params = {
        "embed": sd["model.embed_tokens.weight"],
        "layers": {
            "attn_norm": per_layer(lambda i: layer(i, "input_layernorm.weight")),
            "wq": per_layer(lambda i: layer(i, "self_attn.q_proj.weight").T.reshape(d, attn.num_heads, attn.head_dim)),
            "wk": per_layer(lambda i: layer(i, "self_attn.k_proj.weight").T.reshape(d, attn.num_kv_heads, attn.head_dim)),
            "wv": per_layer(lambda i: layer(i, "self_attn.v_proj.weight").T.reshape(d, attn.num_kv_heads, attn.head_dim)),
            "wo": per_layer(lambda i: layer(i, "self_attn.o_proj.weight").T.reshape(attn.num_heads, attn.head_dim, d)),
            "mlp_norm": per_layer(lambda i: layer(i, "post_attention_layernorm.weight")),
            "w_gate": per_layer(lambda i: layer(i, "mlp.gate_proj.weight").T),
            "w_up": per_layer(lambda i: layer(i, "mlp.up_proj.weight").T),
            "w_down": per_layer(lambda i: layer(i, "mlp.down_proj.weight").T),
        },
        "final_norm": sd["model.norm.weight"],
    }
    if not spec.tie_embeddings:
        params["lm_head"] = sd["lm_head.weight"].T
    return params
