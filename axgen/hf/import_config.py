"""`axgen import-hf`: a Hugging Face `config.json` becomes a readable spec file.

Every key of the config is read by a family's mapping, listed in `IRRELEVANT`, or stops the import with an error
that names it: none is silently dropped. Keys a config leaves out take the value transformers' config class gives
them (`DEFAULTS`), and the written spec states every value. Both conventions are read: transformers 4.x
(`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters`, `dtype`, `layer_types`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import black

from axgen.codegen.emit import BLACK_MODE
from axgen.backends import family_for
from axgen.files import check_replaceable, write_atomically
from axgen.loader import load_spec
from axgen.spec import Model, SpecError
from axgen.spec.model import CHECKPOINT_DTYPES

# Keys that do not change what the model computes: inference settings, task heads, bookkeeping.
IRRELEVANT = frozenset(
    {
        "_name_or_path",
        "architectures",
        "bos_token_id",
        "cache_implementation",
        "chunk_size_feed_forward",
        "eos_token_id",
        "id2label",
        "initializer_range",
        "is_llama_config",  # nanotron's mark on the configs it exports (SmolLM2)
        "is_encoder_decoder",
        "label2id",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "pad_token_id",
        "pretraining_tp",  # splits the same matmuls for Llama 2's original tensor parallelism
        "problem_type",
        "return_dict",
        "torch_version",
        "transformers_version",
        "use_cache",
    }
)

# transformers' config-class defaults, for keys a published config.json may leave out.
_LLAMA = {
    "num_key_value_heads": None,  # None: as many as the attention heads
    "head_dim": None,  # None: hidden_size / num_attention_heads
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_bidirectional_attention": None,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "rope_interleaved": False,
}
# What transformers' Qwen2-MoE and Qwen3-MoE config classes give the keys they share.
_QWEN_MOE = {
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
}
DEFAULTS: dict[str, dict] = {
    "llama": _LLAMA,
    "mistral": _LLAMA | {"sliding_window": 4096, "max_position_embeddings": 32_768},
    "mixtral": _LLAMA
    | {
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "sliding_window": None,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
    },
    "qwen2": _LLAMA
    | {
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "qkv_bias": True,
        "use_mrope": False,
    },
    "qwen3": _LLAMA | {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "qwen2_moe": _LLAMA | {"qkv_bias": True, "use_mrope": False} | _QWEN_MOE,
    "qwen3_moe": _LLAMA | _QWEN_MOE,
    "gemma2": _LLAMA
    | {
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_size": None,  # transformers 4.42's second name for sliding_window
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 8192,
    },
    # Gemma3TextConfig's defaults (transformers 5.23), with the 4.x keys published configs still carry.
    "gemma3_text": _LLAMA
    | {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    },
    # transformers 5.23's GptOssConfig; a config without RoPE keys gets its YaRN.
    "gpt_oss": _LLAMA
    | {
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150_000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "attention_bias": True,
        "max_position_embeddings": 131_072,
        "sliding_window": 128,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "router_aux_loss_coef": 0.001,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "quantization_config": None,
        "experts_per_token": None,  # the original (non-HF) checkpoint's name for num_experts_per_tok
        "initial_context_length": None,  # the original checkpoint's name for YaRN's original context
    },
    "gemma3": {},  # an image-text config: its text_config is read as a gemma3_text config
}
# transformers 5.23's DeepseekV2Config (head_dim and qk_head_dim it derives from the qk dims, and saves).
DEFAULTS["deepseek_v2"] = _LLAMA | {
    "vocab_size": 102_400,
    "hidden_size": 4096,
    "intermediate_size": 11_008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "first_k_dense_replace": 0,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "n_group": None,
    "topk_group": None,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_head_dim": None,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "num_experts_per_tok": None,
    "moe_intermediate_size": 1407,
    # DeepSeek's own configs' balance-loss weight; transformers' model computes no balance loss.
    "aux_loss_alpha": 0.0,
    "scoring_func": "softmax",
    "moe_layer_freq": 1,
}

# transformers 5.23's DeepseekV3Config, and the keys of DeepSeek's own V3 configs it does not read (their remote
# code's: how it scores and chooses experts, which transformers' model does as noaux_tc with sigmoid scores).
DEFAULTS["deepseek_v3"] = _LLAMA | {
    "vocab_size": 129_280,
    "hidden_size": 7168,
    "intermediate_size": 18_432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "qk_head_dim": None,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rope_interleave": True,
    "num_nextn_predict_layers": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "aux_loss_alpha": 0.0,
    "seq_aux": True,
    "moe_layer_freq": 1,
}


class HFImportError(ValueError):
    """One line: the config file, and the key and value that stop the import."""


def _positive_int(value) -> bool:
    return type(value) is int and value > 0


def _finite(value) -> bool:
    """An int or float that is finite (JSON's NaN and Infinity are not), never a bool."""
    return type(value) in (int, float) and math.isfinite(value)


# What each numeric or boolean key may hold, and how an error says it. JSON gives `true` for 1 and "64" for 64;
# neither is read as a number.
KINDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "positive int": (_positive_int, "an integer > 0"),
    "positive int or null": (lambda v: v is None or _positive_int(v), "an integer > 0, or null"),
    "positive number": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "positive number or null": (
        lambda v: v is None or (_finite(v) and v > 0),
        "a finite number > 0, or null",
    ),
    "number >= 0": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "number >= 0 or null": (lambda v: v is None or (_finite(v) and v >= 0), "a finite number >= 0, or null"),
    # YaRN's attention-temperature coefficient (DeepSeek's configs: 0.707, 1.0); MLA's softmax scale grows
    # with its square, so a larger one is no temperature but a config error (1e300 overflows it to inf).
    "YaRN mscale": (lambda v: v is None or (_finite(v) and 0 <= v <= 10), "a number from 0 to 10, or null"),
    "boolean": (lambda v: type(v) is bool, "true or false"),
    "boolean or null": (lambda v: v is None or type(v) is bool, "true, false or null"),
}
KEY_KINDS = {
    **dict.fromkeys(
        (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "decoder_sparse_step",
            "max_position_embeddings",
            "max_window_layers",
        ),
        "positive int",
    ),
    **dict.fromkeys(
        ("num_key_value_heads", "head_dim", "sliding_window", "sliding_window_size"), "positive int or null"
    ),
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "query_pre_attn_scalar"), "positive number"),
    **dict.fromkeys(("swiglu_alpha", "swiglu_limit"), "positive number"),
    **dict.fromkeys(("experts_per_token", "initial_context_length"), "positive int or null"),
    **dict.fromkeys(("attn_logit_softcapping", "final_logit_softcapping"), "positive number or null"),
    **dict.fromkeys(("router_aux_loss_coef", "attention_dropout", "router_jitter_noise"), "number >= 0"),
    **dict.fromkeys(
        (
            "tie_word_embeddings",
            "norm_topk_prob",
            "use_sliding_window",
            "qkv_bias",
            "use_mrope",
            "rope_interleaved",
        ),
        "boolean",
    ),
    **dict.fromkeys(("attention_bias", "mlp_bias", "use_bidirectional_attention"), "boolean or null"),
}

KEY_KINDS |= dict.fromkeys(
    (
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "n_shared_experts",
        "moe_intermediate_size",
    ),
    "positive int",
) | {
    "q_lora_rank": "positive int or null",
    "qk_head_dim": "positive int or null",
    "routed_scaling_factor": "positive number",
    "aux_loss_alpha": "number >= 0",
}
KEY_KINDS |= {
    "rope_local_base_freq": "positive number",
    "sliding_window_pattern": "positive int",
    "_sliding_window_pattern": "positive int",
}


@dataclass
class Config:
    """An HF config.json whose keys are marked as they are read, so that none goes unaccounted for."""

    values: dict
    path: str
    model_type: str
    read: set[str] = field(default_factory=set)

    def __getitem__(self, key: str):
        self.read.add(key)
        if key not in self.values:
            defaults = DEFAULTS[self.model_type]
            if key not in defaults:
                raise HFImportError(f"{self.path}: has no {key!r}, which a {self.model_type} config needs")
            return defaults[key]
        value = self.values[key]
        if key in KEY_KINDS:
            check, description = KINDS[KEY_KINDS[key]]
            if not check(value):
                raise HFImportError(f"{self.path}: {key}={_shown(value)} is not {description}")
        return value

    def expect(self, key: str, allowed: tuple, why: str):
        """The key's value, which must be one of `allowed`: axgen does not implement the others."""
        value = self[key]
        if value not in allowed:
            raise HFImportError(f"{self.path}: {key}={_cut(repr(value))} {why}")
        return value

    def unaccounted(self) -> list[str]:
        return sorted(set(self.values) - self.read - IRRELEVANT)


@dataclass
class SpecSource:
    """What the written spec says, as Python expressions."""

    vocab_size: int
    d_model: int
    num_layers: int
    attention: str
    mlp: str
    norm: str
    max_position: int
    tie_embeddings: bool = False
    checkpoint_dtype: str | None = None
    features: list[str] = field(default_factory=list)
    # Comment lines written above checkpoint_dtype: how the published checkpoint stores its weights, where convert-hf
    # reads them otherwise than as stored (DeepSeek-V3's FP8 blocks).
    checkpoint_comment: str = ""


def _shown(value) -> str:
    """A value as an error shows it, as JSON spells it: short, on one line."""
    return _cut(json.dumps(value) if not isinstance(value, float) else repr(value))


def _cut(text: str) -> str:
    """A value's text cut for an error line: a config's list or object may run to thousands of characters."""
    return text if len(text) <= 60 else text[:57] + "..."


def read_config(path: Path) -> tuple[dict, str, str]:
    """(config, the path it came from, sha256 of its bytes) from a config.json or a folder holding one."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    try:
        raw = config_path.read_bytes()
        config = json.loads(raw)
    except FileNotFoundError:
        raise HFImportError(f"{config_path}: no such file") from None
    except (OSError, ValueError) as err:
        raise HFImportError(f"{config_path}: not a readable JSON config ({err})") from None
    except RecursionError:
        raise HFImportError(f"{config_path}: not a config: its JSON nests too deeply") from None
    if not isinstance(config, dict):
        raise HFImportError(f"{config_path}: not a JSON object")
    return config, str(config_path), hashlib.sha256(raw).hexdigest()


def import_config(config: dict, path: str) -> tuple[SpecSource, Config]:
    """The spec a config describes, and the config with every key it read marked."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise HFImportError(
            f"{path}: model_type={_cut(repr(model_type))} is not one axgen imports "
            f"(it imports {', '.join(FAMILIES)})"
        )
    c = Config(config, path, model_type)
    c.read.add("model_type")
    source = FAMILIES[model_type](c)
    source.checkpoint_dtype = _checkpoint_dtype(c)
    unaccounted = c.unaccounted()
    if unaccounted:
        key = unaccounted[0]
        raise HFImportError(
            f"{path}: {key}={_cut(repr(config[key]))} is a key axgen's {model_type} import does not know, so "
            "it stops rather than drop it"
        )
    return source, c


def _checkpoint_dtype(c: Config) -> str | None:
    """The dtype the checkpoint's weights are stored in: `dtype` (transformers 5) or `torch_dtype` (4.x)."""
    c.read |= {"dtype", "torch_dtype"}
    key = "dtype" if "dtype" in c.values else "torch_dtype"
    value = c.values.get(key)
    if value is not None and value not in CHECKPOINT_DTYPES:
        raise HFImportError(
            f"{c.path}: {key}={_cut(repr(value))} is not a dtype axgen reads (bfloat16, float16, float32)"
        )
    return value


# --- the families ------------------------------------------------------------------------------------------------


def _decoder(c: Config, activation: str = "swiglu") -> SpecSource:
    """What every supported family shares: a pre-norm decoder of GQA attention, a gated MLP and RMSNorms."""
    heads = c["num_attention_heads"]
    kv_heads = c["num_key_value_heads"] or heads
    head_dim = c["head_dim"] or c["hidden_size"] // heads
    c.expect("attention_dropout", (0, 0.0), "is dropout in attention, which axgen does not train with")
    c.expect("use_bidirectional_attention", (None, False), "makes attention bidirectional; axgen's is causal")
    c.expect("mlp_bias", (False, None), "puts biases on the MLP projections, which axgen does not implement")
    return SpecSource(
        vocab_size=c["vocab_size"],
        d_model=c["hidden_size"],
        num_layers=c["num_hidden_layers"],
        attention=f"Attention(num_heads={heads}, num_kv_heads={kv_heads}, head_dim={head_dim})",
        mlp=f'MLP(hidden_dim={_number(c["intermediate_size"])}, activation="{activation}")',
        norm=f'RMSNorm(eps={c["rms_norm_eps"]!r})',
        max_position=c["max_position_embeddings"],
        tie_embeddings=c["tie_word_embeddings"],
    )


def _rope(c: Config) -> str:
    """F.rope from `rope_parameters` (transformers 5) or `rope_theta` and `rope_scaling` (4.x)."""
    if "rope_parameters" in c.values:
        key, parameters = "rope_parameters", _rope_dict(c, "rope_parameters")
        theta = _rope_value(c, key, parameters, "rope_theta", "positive number")
    else:
        key, theta, parameters = "rope_scaling", c["rope_theta"], _rope_dict(c, "rope_scaling")
    scaling = _rope_scaling(c, key, parameters)
    return f"F.rope(theta={_number(float(theta))}{f', scaling={scaling}' if scaling else ''})"


def _rope_scaling(c: Config, key: str, parameters: dict) -> str | None:
    """The `scaling=` of F.rope from a config's RoPE parameters (theta already taken out), None for plain RoPE;
    every parameter must be read."""
    kind = parameters.pop("rope_type", parameters.pop("type", "default"))
    if kind == "default" and not parameters:
        return None
    if kind not in ROPE_SCALINGS:
        raise HFImportError(
            f"{c.path}: {key}.rope_type={_shown(kind)} is not one axgen implements "
            f"(default, {', '.join(ROPE_SCALINGS)})"
        )
    scaling = ROPE_SCALINGS[kind](c, key, parameters)
    if parameters:
        name, value = next(iter(parameters.items()))
        raise HFImportError(
            f"{c.path}: {key}.{name}={_shown(value)} is not a parameter axgen's {kind} scaling reads"
        )
    return scaling


def _llama3_scaling(c: Config, key: str, parameters: dict) -> str:
    factor, low, high = (
        float(_rope_value(c, key, parameters, name, "positive number"))
        for name in ("factor", "low_freq_factor", "high_freq_factor")
    )
    original = _rope_value(c, key, parameters, "original_max_position_embeddings", "positive int")
    return (
        f"F.rope_scaling(factor={factor!r}, low_freq_factor={low!r}, high_freq_factor={high!r}, "
        f"original_max_position={original})"
    )


def _linear_scaling(c: Config, key: str, parameters: dict) -> str:
    return f"F.rope_linear(factor={float(_rope_value(c, key, parameters, 'factor', 'positive number'))!r})"


def _yarn_scaling(c: Config, key: str, parameters: dict) -> str:
    """YaRN with every value transformers' `_compute_yarn_parameters` takes stated: beta_fast 32 and beta_slow 1
    where missing (or 0, which it reads as missing), truncate true, and the attention factor from `factor`,
    `mscale` and `mscale_all_dim` where the config does not give it."""
    factor = float(_rope_value(c, key, parameters, "factor", "positive number"))
    original = _rope_value(c, key, parameters, "original_max_position_embeddings", "positive int")
    optional = {
        name: _rope_value(c, key, parameters, name, kind) if name in parameters else None
        for name, kind in (
            ("beta_fast", "positive number or null"),
            ("beta_slow", "positive number or null"),
            ("attention_factor", "positive number or null"),
            ("mscale", "YaRN mscale"),
            ("mscale_all_dim", "YaRN mscale"),
            ("truncate", "boolean"),
        )
    }
    attention_factor = optional["attention_factor"]
    if attention_factor is None:
        mscale, mscale_all_dim = optional["mscale"], optional["mscale_all_dim"]
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1)
    truncate = True if optional["truncate"] is None else optional["truncate"]
    return (
        f"F.rope_yarn(factor={factor!r}, beta_fast={float(optional['beta_fast'] or 32)!r}, "
        f"beta_slow={float(optional['beta_slow'] or 1)!r}, original_max_position={original}, "
        f"attention_factor={float(attention_factor)!r}, truncate={truncate!r})"
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature for a context stretched by `factor` (transformers' `get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


ROPE_SCALINGS: dict[str, Callable[[Config, str, dict], str]] = {
    "llama3": _llama3_scaling,
    "linear": _linear_scaling,
    "yarn": _yarn_scaling,
}


def _rope_dict(c: Config, key: str) -> dict:
    value = c[key]
    if value is not None and not isinstance(value, dict):
        raise HFImportError(f"{c.path}: {key}={_shown(value)} is not an object of RoPE parameters, or null")
    return dict(value or {})


def _rope_value(c: Config, key: str, parameters: dict, name: str, kind: str):
    """`parameters[name]` (removed from it), which must be of `kind`."""
    if name not in parameters:
        raise HFImportError(f"{c.path}: {key} has no {name!r}")
    value = parameters.pop(name)
    check, description = KINDS[kind]
    if not check(value):
        raise HFImportError(f"{c.path}: {key}.{name}={_shown(value)} is not {description}")
    return value


def _no_attention_bias(c: Config) -> None:
    c.expect(
        "attention_bias", (False, None), "puts biases on all four attention projections (axgen: q, k, v only)"
    )


def _no_window(c: Config) -> None:
    c.expect("use_sliding_window", (False,), "slides a window over some layers, which axgen does not import")
    c.read |= {"sliding_window", "max_window_layers"}  # unused while use_sliding_window is false
    _layer_types(c, lambda layer: "full_attention")


def _layer_types(c: Config, kind: Callable[[int], str]) -> None:
    """transformers 5 lists each layer's attention; it must be what the family's other keys say."""
    if "layer_types" in c.values:
        expected = [kind(layer) for layer in range(c["num_hidden_layers"])]
        if c["layer_types"] != expected:
            raise HFImportError(
                f"{c.path}: layer_types={_cut(repr(c['layer_types']))} is not what axgen's {c.model_type} "
                f"import maps ({expected[:2]}...)"
            )


def _ignored_key(c: Config, key: str, computed, what: str) -> None:
    """A key the family's transformers config does not read, which some published configs state anyway
    (Qwen3-Coder's): accepted where it says what the family computes, refused where it says otherwise, as
    axgen will not guess which the checkpoint means."""
    c.read.add(key)
    value = c.values.get(key, computed)
    if type(value) is not type(computed) or value != computed:
        raise HFImportError(
            f"{c.path}: {key}={_shown(value)}: transformers' {c.model_type} ignores this key and computes "
            f"{what}; state {_shown(computed)} or leave the key out"
        )


def _activation(c: Config, key: str, allowed: tuple[str, ...]) -> None:
    c.expect(key, allowed, f"is an activation axgen's gated MLP does not use (it takes {', '.join(allowed)})")


def llama(c: Config) -> SpecSource:
    _activation(c, "hidden_act", ("silu",))
    _no_attention_bias(c)
    # nanotron's exports (SmolLM2) say how their RoPE paired channels; HF's Llama rotates halves whatever it says.
    c.expect(
        "rope_interleaved",
        (False,),
        "pairs RoPE's channels as neighbours; HF's Llama (and axgen) rotate halves",
    )
    if c.model_type == "llama":
        _layer_types(c, lambda layer: "full_attention")
    source = _decoder(c)
    source.features = [_rope(c)]
    return source


def mistral(c: Config) -> SpecSource:
    source = llama(c)
    window = c["sliding_window"]
    if window is not None:
        source.features.append(f"F.sliding_window(window={window})")
    _layer_types(c, lambda layer: "full_attention" if window is None else "sliding_attention")
    return source


def mixtral(c: Config) -> SpecSource:
    source = mistral(c)
    c.expect("router_jitter_noise", (0, 0.0), "perturbs routing in training, which axgen does not do")
    source.features.append(
        f'F.moe(num_experts={c["num_local_experts"]}, top_k={c["num_experts_per_tok"]}, renormalize=True, '
        f'aux_loss_weight={c["router_aux_loss_coef"]!r}, router_z_loss_weight=0.0)'
    )
    return source


def qwen2(c: Config) -> SpecSource:
    _activation(c, "hidden_act", ("silu",))
    c.expect("qkv_bias", (True,), "leaves out Qwen2's q, k and v biases, which its checkpoints hold")
    # Qwen2.5's text models say that they do not use Qwen2-VL's multimodal RoPE sections.
    c.expect("use_mrope", (False,), "splits RoPE into Qwen2-VL's multimodal sections, which axgen does not")
    _no_window(c)
    source = _decoder(c)
    source.features = [_rope(c), "F.qkv_bias()"]
    return source


def qwen3(c: Config) -> SpecSource:
    _activation(c, "hidden_act", ("silu",))
    _no_window(c)
    _no_attention_bias(c)
    _ignored_key(c, "qkv_bias", False, "no biases on q, k and v")
    _ignored_key(c, "use_qk_norm", True, "q and k norms")
    source = _decoder(c)
    source.features = [_rope(c), f'F.qk_norm(eps={c["rms_norm_eps"]!r})']
    return source


def qwen2_moe(c: Config) -> SpecSource:
    source = qwen2(c)
    source.mlp = _expert_mlp(c)
    source.features.append(
        f'F.moe(num_experts={c["num_experts"]}, top_k={c["num_experts_per_tok"]}, '
        f'renormalize={c["norm_topk_prob"]!r}, every={c["decoder_sparse_step"]}, '
        f'shared_hidden_dim={_number(c["shared_expert_intermediate_size"])}, shared_gate=True, '
        f'aux_loss_weight={c["router_aux_loss_coef"]!r}, router_z_loss_weight=0.0)'
    )
    return source


def qwen3_moe(c: Config) -> SpecSource:
    """Qwen3's attention (q/k norms, no biases) with Qwen2-MoE's routing and no shared expert."""
    source = qwen3(c)
    source.mlp = _expert_mlp(c)
    _ignored_key(c, "shared_expert_intermediate_size", 0, "no shared expert")
    # The published configs say num_experts; transformers 5 saves the same number as num_local_experts.
    experts = c["num_local_experts" if "num_local_experts" in c.values else "num_experts"]
    source.features.append(
        f'F.moe(num_experts={experts}, top_k={c["num_experts_per_tok"]}, '
        f'renormalize={c["norm_topk_prob"]!r}, every={c["decoder_sparse_step"]}, '
        f'aux_loss_weight={c["router_aux_loss_coef"]!r}, router_z_loss_weight=0.0)'
    )
    return source


def _expert_mlp(c: Config) -> str:
    """The experts' MLP, which is also the dense layers' in axgen: Qwen's dense layers (`mlp_only_layers`, and
    those between every `decoder_sparse_step`-th) are `intermediate_size` wide, so they can exist only when that
    width is the experts' own."""
    c.expect("mlp_only_layers", ([],), "keeps dense MLPs in chosen layers, which axgen's import does not map")
    width, experts_width = c["intermediate_size"], c["moe_intermediate_size"]
    if c["decoder_sparse_step"] != 1 and width != experts_width:
        raise HFImportError(
            f"{c.path}: decoder_sparse_step={c['decoder_sparse_step']!r} keeps dense layers of "
            f"intermediate_size={width}, but axgen's dense layers are the experts' width "
            f"(moe_intermediate_size={experts_width})"
        )
    return f'MLP(hidden_dim={_number(experts_width)}, activation="swiglu")'


def gemma2(c: Config) -> SpecSource:
    _activation(c, "hidden_activation", ("gelu_pytorch_tanh",))
    c.read.add("hidden_act")  # transformers reads hidden_activation for Gemma 2
    _no_attention_bias(c)
    source = _decoder(c)
    head_dim = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    scalar = c["query_pre_attn_scalar"]
    if scalar != head_dim:  # Gemma-2-27B: 144 (hidden / heads), where head_dim is 128
        source.attention = source.attention[:-1] + f", scale={_number(scalar)}**-0.5)"
    source.features = [_rope(c), "F.gemma_block()", _alternating_window(c)]
    caps = {"attention": c["attn_logit_softcapping"], "final": c["final_logit_softcapping"]}
    caps = {name: cap for name, cap in caps.items() if cap is not None}
    if caps:
        source.features.append(f"F.softcap({', '.join(f'{k}={float(v)!r}' for k, v in caps.items())})")
    return source


def _alternating_window(c: Config) -> str:
    """Gemma 2's layers alternate a sliding window (even layers) and full attention (odd)."""
    _layer_types(c, lambda layer: "full_attention" if layer % 2 else "sliding_attention")
    window = c["sliding_window"]
    c.expect("sliding_window_size", (None, window), f"differs from sliding_window={window}")
    return f"F.sliding_window(window={window}, global_every=2)"


def gemma3_text(c: Config) -> SpecSource:
    """Gemma 3's text model: Gemma 2's block with (1 + w) q/k norms, layers of N local : 1 global, a theta per
    layer type, and no attention soft-capping."""
    _activation(c, "hidden_activation", ("gelu_pytorch_tanh",))
    c.read.add("hidden_act")  # transformers reads hidden_activation for Gemma 3
    _no_attention_bias(c)
    # transformers' Gemma 3 never caps attention scores, whatever the config says; axgen will not guess.
    c.expect("attn_logit_softcapping", (None,), "caps attention scores, which transformers' Gemma 3 does not")
    source = _decoder(c)
    head_dim = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    scalar = c["query_pre_attn_scalar"]
    if scalar != head_dim:  # Gemma-3-27B: 168 (hidden / heads), where head_dim is 128
        source.attention = source.attention[:-1] + f", scale={_number(scalar)}**-0.5)"
    every = _gemma3_pattern(c)
    source.features = [
        _gemma3_rope(c, local=every != 1),
        "F.gemma_block()",
        f'F.qk_norm(eps={c["rms_norm_eps"]!r})',
    ]
    if every != 1:
        window = c["sliding_window"]
        source.features.append(
            f"F.sliding_window(window={window}{f', global_every={every}' if every else ''})"
        )
    else:
        c.read.add("sliding_window")  # no layer has a window
    final = c["final_logit_softcapping"]
    if final is not None:
        source.features.append(f"F.softcap(final={float(final)!r})")
    return source


def _gemma3_pattern(c: Config) -> int | None:
    """k of "the last layer of each group of k is global" (4.x: sliding_window_pattern; 5: layer_types); None
    when every layer has a window, 1 when none has. Layers after the last whole group are windowed."""
    c.read |= {"sliding_window_pattern", "_sliding_window_pattern"}
    layers = c["num_hidden_layers"]
    if "layer_types" in c.values:
        types = c["layer_types"]
        full = (
            [i for i, kind in enumerate(types) if kind == "full_attention"] if isinstance(types, list) else []
        )
        every = full[0] + 1 if full else None
    elif "_sliding_window_pattern" in c.values and "sliding_window_pattern" not in c.values:
        every = c["_sliding_window_pattern"]  # the private name some re-saved configs carry
    else:
        every = c["sliding_window_pattern"]
    _layer_types(c, lambda i: "full_attention" if every and (i + 1) % every == 0 else "sliding_attention")
    if every and every > layers:  # no group is whole: every layer is windowed
        return None
    return every


def _gemma3_rope(c: Config, local: bool) -> str:
    """F.rope of the global layers with `local_theta` for the windowed ones: transformers 5's `rope_parameters`
    per layer type, or 4.x's rope_theta, rope_scaling (global) and rope_local_base_freq."""
    if "rope_parameters" in c.values:
        per_type = _rope_dict(c, "rope_parameters")
        kinds = {}
        for kind in ("full_attention", "sliding_attention"):
            key = f"rope_parameters.{kind}"
            value = per_type.pop(kind, None)
            if not isinstance(value, dict):
                raise HFImportError(f"{c.path}: {key}={_shown(value)} is not an object of RoPE parameters")
            kinds[kind] = (key, dict(value))
        if per_type:
            name, value = next(iter(per_type.items()))
            raise HFImportError(
                f"{c.path}: rope_parameters.{name}={_shown(value)} is not a Gemma 3 layer type"
            )
        (key, full), (local_key, sliding) = kinds["full_attention"], kinds["sliding_attention"]
        theta = _rope_value(c, key, full, "rope_theta", "positive number")
        scaling = _rope_scaling(c, key, full)
        local_theta = _rope_value(c, local_key, sliding, "rope_theta", "positive number")
        if _rope_scaling(c, local_key, sliding) is not None:
            raise HFImportError(
                f"{c.path}: {local_key} scales RoPE on the local layers, which axgen gives plain RoPE only"
            )
    else:
        theta, local_theta = c["rope_theta"], c["rope_local_base_freq"]
        scaling = _rope_scaling(c, "rope_scaling", _rope_dict(c, "rope_scaling"))
    arguments = [f"theta={_number(float(theta))}"]
    if scaling:
        arguments.append(f"scaling={scaling}")
    if local:
        arguments.append(f"local_theta={_number(float(local_theta))}")
    return f"F.rope({', '.join(arguments)})"


def gemma3(c: Config) -> SpecSource:
    """A Gemma 3 image-text config: the import builds its text model (`text_config`, read as a gemma3_text
    config); the vision tower and the projector are not built, so their keys are read and left."""
    text = c["text_config"]
    if not isinstance(text, dict):
        raise HFImportError(f"{c.path}: text_config={_shown(text)} is not an object")
    text_type = text.get("model_type", "gemma3_text")
    if text_type != "gemma3_text":
        raise HFImportError(f"{c.path}: text_config.model_type={_shown(text_type)} is not gemma3_text")
    inner = Config(text, f"{c.path}: text_config", "gemma3_text")
    inner.read |= {"model_type", "dtype", "torch_dtype"}
    source = gemma3_text(inner)
    unaccounted = inner.unaccounted()
    if unaccounted:
        key = unaccounted[0]
        raise HFImportError(
            f"{c.path}: text_config.{key}={_shown(text[key])} is a key axgen's gemma3_text import does not know"
        )
    c.read |= MULTIMODAL_KEYS
    return source


# A Gemma 3 image-text config's keys for the parts the import does not build: the vision tower, its projector and
# the image tokens.
MULTIMODAL_KEYS = frozenset(
    {
        "vision_config",
        "mm_tokens_per_image",
        "boi_token_index",
        "eoi_token_index",
        "image_token_index",
        "image_token_id",
        "boi_token_id",
        "eoi_token_id",
    }
)


def gpt_oss(c: Config) -> SpecSource:
    """gpt-oss: biases on q, k, v and o, a sink logit per head, 128-token windows on even layers, and routed
    experts with biases and the clamped SwiGLU (F.gpt_oss_experts). Its published checkpoints store the experts in
    MXFP4, which convert-hf dequantizes (`quantization_config`)."""
    _activation(
        c, "hidden_act", ("silu",)
    )  # transformers' gpt-oss ignores it: its experts' SwiGLU is clamped
    c.expect(
        "attention_bias", (True,), "leaves out gpt-oss's attention biases, which axgen's gpt-oss import maps"
    )
    _mxfp4_storage(c)
    source = _decoder(c)
    top_k = c["num_experts_per_tok"]
    c.expect("experts_per_token", (None, top_k), f"differs from num_experts_per_tok={top_k}")
    c.read.add("initial_context_length")  # transformers does not read it: YaRN's is in rope_scaling
    window = c["sliding_window"]
    if window is None:
        raise HFImportError(f"{c.path}: sliding_window=null leaves gpt-oss's sliding layers without a window")
    _layer_types(c, lambda layer: "full_attention" if layer % 2 else "sliding_attention")
    if "rope_parameters" not in c.values and c["rope_scaling"] is None:
        # transformers' GptOssConfig gives a config without RoPE parameters a YaRN of its own choosing.
        raise HFImportError(
            f"{c.path}: rope_scaling=null: transformers' gpt-oss then takes a built-in YaRN; state it in the "
            "config's rope_scaling, as the published ones do"
        )
    source.features = [
        _rope(c),
        "F.qkv_bias()",
        "F.out_bias()",
        "F.attention_sinks()",
        f"F.sliding_window(window={window}, global_every=2)",
        f'F.moe(num_experts={c["num_local_experts"]}, top_k={top_k}, renormalize=True, '
        f'aux_loss_weight={c["router_aux_loss_coef"]!r}, router_z_loss_weight=0.0)',
        f'F.gpt_oss_experts(alpha={float(c["swiglu_alpha"])!r}, limit={float(c["swiglu_limit"])!r})',
    ]
    return source


def _mxfp4_storage(c: Config) -> None:
    """`quantization_config`: how the published checkpoint stores its experts (MXFP4 blocks and scales), which
    convert-hf dequantizes; it does not change what the model computes."""
    storage = c["quantization_config"]
    if storage is None:
        return
    if not isinstance(storage, dict) or storage.get("quant_method") != "mxfp4":
        method = storage.get("quant_method") if isinstance(storage, dict) else storage
        raise HFImportError(
            f"{c.path}: quantization_config.quant_method={_shown(method)} is not a storage convert-hf reads (mxfp4)"
        )
    extra = sorted(set(storage) - {"quant_method", "modules_to_not_convert"})
    if extra:
        raise HFImportError(
            f"{c.path}: quantization_config.{extra[0]}={_shown(storage[extra[0]])} is not a key axgen's mxfp4 "
            "reading knows"
        )


def deepseek_v2(c: Config) -> SpecSource:
    """DeepSeek-V2: multi-head latent attention (F.mla) whose RoPE turns the qk_rope_head_dim channels of each
    head in adjacent pairs, its softmax scale qk_head_dim**-0.5 times YaRN's mscale(factor, mscale_all_dim)**2
    where the RoPE states mscale_all_dim (transformers' yarn_apply_mscale); and DeepSeek-MoE in every layer:
    softmax over the routed experts, the greedy top-k kept as they are (transformers' deepseek_v2 renormalises
    nothing) and scaled by routed_scaling_factor, plus n_shared_experts experts' width of shared expert, ungated.
    """
    _activation(c, "hidden_act", ("silu",))
    c.expect("attention_bias", (False, None), "puts biases on q_a, kv_a and o, which axgen's MLA does not")
    topk_method = c["topk_method"]
    if topk_method not in ("greedy", "group_limited_greedy"):
        raise HFImportError(
            f"{c.path}: topk_method={_shown(topk_method)} is not one transformers' deepseek_v2 computes "
            "(greedy, group_limited_greedy)"
        )
    if topk_method == "greedy":
        c.read |= {"n_group", "topk_group"}  # read by group_limited_greedy only
    # DeepSeek's own configs (its remote code's keys) say how they score and place experts and how their code
    # ran: transformers' model scores by softmax in every layer after the dense ones, whatever they say, so other
    # values are refused; ep_size is their inference's expert parallelism, seq_aux their balance loss's form
    # (axgen's is Switch's, weighted by aux_loss_alpha), auto_map their code's classes.
    c.expect(
        "scoring_func", ("softmax",), "scores experts otherwise than transformers' deepseek_v2 (softmax)"
    )
    c.expect(
        "moe_layer_freq", (1,), "puts experts in some layers only, which transformers' deepseek_v2 does not"
    )
    c.read |= {"ep_size", "seq_aux", "auto_map"}
    c.expect(
        "norm_topk_prob",
        (False,),
        "asks for renormalised top-k weights, which transformers' deepseek_v2 does not compute; axgen will not guess",
    )
    source = _deepseek_mla(c, interleaved=True)
    source.mlp = f'MLP(hidden_dim={_number(c["moe_intermediate_size"])}, activation="swiglu")'
    # V2's group_limited_greedy ranks a group by its best expert's score.
    groups = _deepseek_groups(c, "max") if topk_method == "group_limited_greedy" else ""
    source.features.append(
        f'F.moe(num_experts={c["n_routed_experts"]}, top_k={c["num_experts_per_tok"]}, renormalize=False, '
        + _deepseek_moe_fields(c)
        + groups
        + f'aux_loss_weight={float(c["aux_loss_alpha"])!r}, router_z_loss_weight=0.0)'
    )
    return source


def deepseek_v3(c: Config) -> SpecSource:
    """DeepSeek-V3: V2's multi-head latent attention, its RoPE's channels in adjacent pairs when rope_interleave
    (transformers de-interleaves q and k alike, which leaves q.k as the pairs give it) and in halves otherwise; and
    DeepSeek-MoE after the first first_k_dense_replace dense layers: sigmoid scores, the e_score_correction_bias
    added to choose experts (noaux_tc: the best topk_group of n_group groups by their two best experts' sum) but not
    to weight them, the chosen scores renormalised when norm_topk_prob and scaled by routed_scaling_factor, plus
    n_shared_experts experts' width of shared expert. The multi-token-prediction layers (num_nextn_predict_layers,
    the Hub's `model.layers.61.*`) are not trained here: convert-hf leaves their tensors out."""
    _activation(c, "hidden_act", ("silu",))
    c.expect("attention_bias", (False, None), "puts biases on q_a, kv_a and o, which axgen's MLA does not")
    # DeepSeek's own configs state the routing transformers' deepseek_v3 computes whatever they say; other values
    # are refused. ep_size is their inference's expert parallelism, auto_map their code's classes.
    c.expect("topk_method", ("noaux_tc",), "is not the routing transformers' deepseek_v3 computes (noaux_tc)")
    c.expect(
        "scoring_func", ("sigmoid",), "scores experts otherwise than transformers' deepseek_v3 (sigmoid)"
    )
    c.expect(
        "moe_layer_freq", (1,), "puts experts in some layers only, which transformers' deepseek_v3 does not"
    )
    c.expect("seq_aux", (True,), "asks for a batch-wise balance loss; DeepSeek-V3's is sequence-wise")
    c.read |= {"ep_size", "auto_map"}
    mtp = c["num_nextn_predict_layers"]
    if type(mtp) is not int or mtp < 0:
        raise HFImportError(f"{c.path}: num_nextn_predict_layers={_shown(mtp)} is not a count of layers")
    interleave = c["rope_interleave"]
    if type(interleave) is not bool:
        raise HFImportError(f"{c.path}: rope_interleave={_shown(interleave)} is not true or false")
    source = _deepseek_mla(c, interleaved=interleave)
    source.checkpoint_comment = _fp8_storage(c)
    source.mlp = f'MLP(hidden_dim={_number(c["moe_intermediate_size"])}, activation="swiglu")'
    renormalize = c["norm_topk_prob"]
    if type(renormalize) is not bool:
        raise HFImportError(f"{c.path}: norm_topk_prob={_shown(renormalize)} is not true or false")
    source.features.append(
        # The expressions' comments reach the written spec: black keeps them in the call.
        f'F.moe(num_experts={c["n_routed_experts"]}, top_k={c["num_experts_per_tok"]}, '
        f'renormalize={renormalize}, scoring="sigmoid", '
        + _deepseek_moe_fields(c)
        + _deepseek_groups(c, "top2_sum")
        + "\n# The config states no update rate for e_score_correction_bias: 0.0 holds the published bias as it"
        "\n# is (DeepSeek-V3's own rate for its last 500B tokens); 0.001 is its rate for the first 14.3T.\n"
        + "balance_bias_rate=0.0, "
        + f'seq_aux_loss_weight={float(c["aux_loss_alpha"])!r}, aux_loss_weight=0.0, router_z_loss_weight=0.0'
        + (
            f"\n# num_nextn_predict_layers={mtp}: the multi-token-prediction layers are not trained here;"
            "\n# convert-hf leaves their tensors (the Hub's model.layers.61.*) out.\n"
            if mtp
            else ""
        )
        + ")"
    )
    return source


# DeepSeek-V3's published quantization_config (V3.1's adds scale_fmt ue8m0: its scales are powers of two, still
# stored as float32), each key with the values convert-hf reads.
FP8_STORAGE = {
    "quant_method": ("fp8",),
    "fmt": ("e4m3",),
    "activation_scheme": ("dynamic",),  # how DeepSeek's inference quantizes activations; training does not
    "scale_fmt": ("ue8m0",),
}


def _fp8_storage(c: Config) -> str:
    """`quantization_config`: DeepSeek-V3's checkpoints store each projection as float8_e4m3fn blocks with a float32
    weight_scale_inv per block, which convert-hf dequantizes (it does not change what the model computes); the
    comment the spec gets that says so, or "" for a checkpoint without one."""
    storage = c.values.get("quantization_config")
    c.read.add("quantization_config")
    if storage is None:
        return ""
    if not isinstance(storage, dict):
        raise HFImportError(
            f"{c.path}: quantization_config={_shown(storage)} is not an object of storage settings, or null"
        )
    method = storage.get("quant_method")
    if method != "fp8":
        raise HFImportError(
            f"{c.path}: quantization_config.quant_method={_shown(method)} is not a storage convert-hf reads (fp8)"
        )
    for key in sorted(storage):
        value = storage[key]
        if key == "weight_block_size":
            if not (
                isinstance(value, list) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)
            ):
                raise HFImportError(
                    f"{c.path}: quantization_config.weight_block_size={_shown(value)} is not [rows, columns] of "
                    "a 2-D block"
                )
        elif key not in FP8_STORAGE:
            raise HFImportError(
                f"{c.path}: quantization_config.{key}={_shown(value)} is not a key axgen's fp8 reading knows"
            )
        elif value not in FP8_STORAGE[key]:
            raise HFImportError(
                f"{c.path}: quantization_config.{key}={_shown(value)} is not a storage convert-hf reads "
                f"({', '.join(FP8_STORAGE[key])})"
            )
    if "weight_block_size" not in storage:
        raise HFImportError(
            f"{c.path}: quantization_config states no weight_block_size, which convert-hf needs to read its blocks"
        )
    rows, columns = storage["weight_block_size"]
    powers = (
        "\n# scale_fmt ue8m0: the scales are powers of two, stored as float32."
        if "scale_fmt" in storage
        else ""
    )
    return (
        f"# The published checkpoint stores the projections as FP8 (e4m3) in {rows} x {columns} blocks, each with a"
        "\n# float32 weight_scale_inv (its quantization_config); convert-hf dequantizes them to checkpoint_dtype by"
        "\n# the block size in the checkpoint's config.json. Training does not keep FP8 blocks: the program trains"
        f"\n# in its own dtype.{powers}\n"
    )


def _deepseek_mla(c: Config, interleaved: bool) -> SpecSource:
    """DeepSeek-V2's and V3's attention: multi-head latent attention (F.mla) whose RoPE turns the qk_rope_head_dim
    channels of each head (in adjacent pairs when `interleaved`), its softmax scale qk_head_dim**-0.5 times YaRN's
    mscale(factor, mscale_all_dim)**2 where the RoPE states mscale_all_dim (transformers' yarn_apply_mscale). The
    source's features are the RoPE and the MLA."""
    heads = c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    c.expect(
        "num_key_value_heads",
        (None, heads),
        f"differs from num_attention_heads={heads}; MLA has a k, v per head",
    )
    c.expect(
        "head_dim",
        (None, rope),
        f"is not qk_rope_head_dim={rope}, which transformers' DeepSeek sets it to",
    )
    c.expect("qk_head_dim", (None, nope + rope), f"is not qk_nope_head_dim + qk_rope_head_dim={nope + rope}")
    source = _decoder(c)
    rope_feature = _rope(c)  # first: it checks the RoPE parameters that the softmax scale reads
    mscale = _mla_mscale(c)
    scale = (nope + rope) ** -0.5 * mscale * mscale
    source.attention = (
        f"Attention(num_heads={heads}, num_kv_heads={heads}, head_dim={nope + rope}, scale={scale!r})"
    )
    source.features = [
        rope_feature[:-1] + f", rotary_dim={rope}, interleaved={interleaved})",
        # transformers' DeepSeek norms the latents with DeepseekV2RMSNorm's default eps, not rms_norm_eps.
        f'F.mla(q_lora_rank={c["q_lora_rank"]}, kv_lora_rank={c["kv_lora_rank"]}, qk_nope_head_dim={nope}, '
        f"qk_rope_head_dim={rope}, v_head_dim={v}, eps=1e-06)",
    ]
    return source


def _mla_mscale(c: Config) -> float:
    """YaRN's mscale(factor, mscale_all_dim) where the RoPE states mscale_all_dim, else 1; `_rope` has checked
    the parameters (only YaRN reads mscale_all_dim)."""
    key = "rope_parameters" if "rope_parameters" in c.values else "rope_scaling"
    parameters = c.values.get(key) or {}
    if not parameters.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(parameters["factor"], parameters["mscale_all_dim"])


def _deepseek_groups(c: Config, score: str) -> str:
    """F.moe's group-limited top-k: n_group equal groups of the routed experts, the best topk_group chosen from."""
    experts, groups, chosen = c["n_routed_experts"], c["n_group"], c["topk_group"]
    if not _positive_int(groups) or experts % groups:
        raise HFImportError(
            f"{c.path}: n_group={_shown(groups)} does not split n_routed_experts={_shown(experts)} into equal groups"
        )
    if not _positive_int(chosen) or chosen > groups:
        raise HFImportError(
            f"{c.path}: topk_group={_shown(chosen)} is not a count of groups up to n_group={groups}"
        )
    return f'n_group={groups}, topk_group={chosen}, group_score="{score}", '


def _deepseek_moe_fields(c: Config) -> str:
    """F.moe's fields that DeepSeek-V2 and V3 state alike: routed_scaling_factor, the shared experts' width, and the
    first first_k_dense_replace layers dense at intermediate_size (the experts' width is moe_intermediate_size).
    """
    shared = c["n_shared_experts"] * c["moe_intermediate_size"]
    fields = f'routed_scale={float(c["routed_scaling_factor"])!r}, shared_hidden_dim={_number(shared)}, '
    dense = c["first_k_dense_replace"]
    if not isinstance(dense, int) or isinstance(dense, bool) or not 0 <= dense < c["num_hidden_layers"]:
        raise HFImportError(
            f"{c.path}: first_k_dense_replace={_shown(dense)} is not a count of leading dense layers below "
            f"num_hidden_layers={_shown(c['num_hidden_layers'])}"
        )
    c.read.add("intermediate_size")  # the dense layers' width, when there are any
    if dense:
        fields += f'first_dense_layers={dense}, dense_hidden_dim={_number(c["intermediate_size"])}, '
    return fields


FAMILIES: dict[str, Callable[[Config], SpecSource]] = {
    "llama": llama,
    "mistral": mistral,
    "mixtral": mixtral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen2_moe": qwen2_moe,
    "qwen3_moe": qwen3_moe,
    "gemma2": gemma2,
    "gemma3_text": gemma3_text,
    "gemma3": gemma3,
    "gpt_oss": gpt_oss,
    "deepseek_v2": deepseek_v2,
    "deepseek_v3": deepseek_v3,
}


# --- the written spec ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainChoices:
    """What the checkpoint does not say: how to train it. The written spec states them for the user to edit."""

    seq_len: int | None = None  # None: the config's max_position_embeddings, at most 4096
    global_batch: int = 8
    lr: float = 1e-5
    steps: int = 1000
    targets: tuple[str, ...] = ("cpu-8",)


def spec_text(source: SpecSource, name: str, origin: str, sha256: str, choices: TrainChoices) -> str:
    """The spec file's source (not yet black-formatted)."""
    seq_len = choices.seq_len or min(source.max_position, 4096)
    return f'''"""{name}: imported by `axgen import-hf` from {origin}
(sha256 {sha256}).

The model's numbers come from that config; the Train block and the targets are training choices to edit.
"""

from axgen.spec import MLP, AdamW, Attention, Decoder, Model, RMSNorm, Train
from axgen.spec import features as F

spec = Model(
    name={name!r},
    vocab_size={_number(source.vocab_size)},
    d_model={_number(source.d_model)},
    tie_embeddings={source.tie_embeddings!r},
    {source.checkpoint_comment}checkpoint_dtype={source.checkpoint_dtype!r},
    decoder=Decoder(
        num_layers={source.num_layers},
        attention={source.attention},
        mlp={source.mlp},
        norm={source.norm},
    ),
    features=[{", ".join(source.features)}],
    train=Train(
        seq_len={seq_len},
        global_batch={choices.global_batch},
        steps={choices.steps},
        warmup_steps={_warmup_steps(choices.steps)},
        optimizer=AdamW(lr={choices.lr!r}),
    ),
    targets={list(choices.targets)!r},
)
'''


def _warmup_steps(steps: int) -> int:
    """1% of the steps, at least 1; none for a one-step run, as Train requires fewer warmup steps than steps."""
    return min(max(1, steps // 100), steps - 1)


def _number(value: int | float) -> str:
    """A literal as a person writes it: 151_936, 1_000_000.0, 1e-06."""
    if isinstance(value, float) and not value.is_integer():
        return repr(value)
    text = f"{int(value):_}" if abs(value) >= 10_000 else str(int(value))
    return f"{text}.0" if isinstance(value, float) else text


def model_name(out: Path) -> str:
    """The spec's name from its file: specs/my_model.py -> my-model."""
    return re.sub(r"[^a-z0-9._-]", "-", out.stem.lower().replace("_", "-"))


def import_hf(
    config_path: Path, out: Path, choices: TrainChoices, name: str | None = None, overwrite: bool = False
) -> Model:
    """Writes the spec of an HF config to `out` (black-formatted; only once it loads as a valid spec for each of
    its targets) and returns it."""
    check_replaceable(out, overwrite)
    config, origin, sha256 = read_config(config_path)
    source, _ = import_config(config, origin)
    text = black.format_str(
        spec_text(source, name or model_name(out), origin, sha256, choices), mode=BLACK_MODE
    )
    with tempfile.TemporaryDirectory() as scratch:
        trial = Path(scratch) / out.name
        trial.write_text(text)
        try:
            spec = load_spec(trial)
        except SpecError as err:
            # The spec is a scratch file about to go: name the config that made it.
            why = re.sub(rf"^{re.escape(str(trial))}(:\d+)?: ", "", str(err))
            raise HFImportError(f"{origin}: gives a spec axgen refuses: {why}") from None
    for target in spec.targets:
        try:
            family_for(spec, target)
        except SpecError:
            raise HFImportError(
                f"--target {target!r} is not a target axgen knows (`axgen targets` lists them)"
            ) from None
    write_atomically(out, text)
    return spec
