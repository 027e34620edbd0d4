"""Reading a Hugging Face config.json for `axgen import-hf`: the file, its keys marked as they are read (`Config`)
so that none goes unaccounted for, the kinds of value each numeric or boolean key may hold, the keys no family
reads, and what every family's reading shares (`decoder`, the attention and window checks). What a config becomes
is `SpecSource`, the written spec's expressions; each family's adapter (`axgen.hf.adapter.Family.read`) fills it.
"""

from __future__ import annotations


import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

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


# transformers' LlamaConfig defaults, which the other families' config classes start from.
LLAMA_DEFAULTS = {
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


class HFImportError(ValueError):
    """One line: the config file, and the key and value that stop the import."""


def positive_int(value) -> bool:
    return type(value) is int and value > 0


def finite(value) -> bool:
    """An int or float that is finite (JSON's NaN and Infinity are not), never a bool."""
    return type(value) in (int, float) and math.isfinite(value)


# What each numeric or boolean key may hold, and how an error says it. JSON gives `true` for 1 and "64" for 64;
# neither is read as a number.
KINDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "positive int": (positive_int, "an integer > 0"),
    "positive int or null": (lambda v: v is None or positive_int(v), "an integer > 0, or null"),
    "positive number": (lambda v: finite(v) and v > 0, "a finite number > 0"),
    "positive number or null": (
        lambda v: v is None or (finite(v) and v > 0),
        "a finite number > 0, or null",
    ),
    "number >= 0": (lambda v: finite(v) and v >= 0, "a finite number >= 0"),
    "number >= 0 or null": (lambda v: v is None or (finite(v) and v >= 0), "a finite number >= 0, or null"),
    # YaRN's attention-temperature coefficient (DeepSeek's configs: 0.707, 1.0); MLA's softmax scale grows
    # with its square, so a larger one is no temperature but a config error (1e300 overflows it to inf).
    "YaRN mscale": (lambda v: v is None or (finite(v) and 0 <= v <= 10), "a number from 0 to 10, or null"),
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
    # transformers' config-class defaults of the family, for keys a published config.json may leave out.
    defaults: Mapping[str, object]
    read: set[str] = field(default_factory=set)

    def __getitem__(self, key: str):
        self.read.add(key)
        if key not in self.values:
            if key not in self.defaults:
                raise HFImportError(f"{self.path}: has no {key!r}, which a {self.model_type} config needs")
            return self.defaults[key]
        value = self.values[key]
        if key in KEY_KINDS:
            check, description = KINDS[KEY_KINDS[key]]
            if not check(value):
                raise HFImportError(f"{self.path}: {key}={shown(value)} is not {description}")
        return value

    def expect(self, key: str, allowed: tuple, why: str):
        """The key's value, which must be one of `allowed`: axgen does not implement the others."""
        value = self[key]
        if value not in allowed:
            raise HFImportError(f"{self.path}: {key}={cut(repr(value))} {why}")
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


def literal(value: int | float) -> str:
    """A literal as a person writes it: 151_936, 1_000_000.0, 1e-06."""
    if isinstance(value, float) and not value.is_integer():
        return repr(value)
    text = f"{int(value):_}" if abs(value) >= 10_000 else str(int(value))
    return f"{text}.0" if isinstance(value, float) else text


def shown(value) -> str:
    """A value as an error shows it, as JSON spells it: short, on one line."""
    return cut(json.dumps(value) if not isinstance(value, float) else repr(value))


def cut(text: str) -> str:
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


# --- what every family's reading shares ---------------------------------------------------------------------------


def decoder(c: Config, activation: str = "swiglu") -> SpecSource:
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
        mlp=f'MLP(hidden_dim={literal(c["intermediate_size"])}, activation="{activation}")',
        norm=f'RMSNorm(eps={c["rms_norm_eps"]!r})',
        max_position=c["max_position_embeddings"],
        tie_embeddings=c["tie_word_embeddings"],
    )


def no_attention_bias(c: Config) -> None:
    c.expect(
        "attention_bias", (False, None), "puts biases on all four attention projections (axgen: q, k, v only)"
    )


def no_window(c: Config) -> None:
    c.expect("use_sliding_window", (False,), "slides a window over some layers, which axgen does not import")
    c.read |= {"sliding_window", "max_window_layers"}  # unused while use_sliding_window is false
    check_layer_types(c, lambda layer: "full_attention")


def check_layer_types(c: Config, kind: Callable[[int], str]) -> None:
    """transformers 5 lists each layer's attention; it must be what the family's other keys say."""
    if "layer_types" in c.values:
        expected = [kind(layer) for layer in range(c["num_hidden_layers"])]
        if c["layer_types"] != expected:
            raise HFImportError(
                f"{c.path}: layer_types={cut(repr(c['layer_types']))} is not what axgen's {c.model_type} "
                f"import maps ({expected[:2]}...)"
            )


def ignored_key(c: Config, key: str, computed, what: str) -> None:
    """A key the family's transformers config does not read, which some published configs state anyway
    (Qwen3-Coder's): accepted where it says what the family computes, refused where it says otherwise, as
    axgen will not guess which the checkpoint means."""
    c.read.add(key)
    value = c.values.get(key, computed)
    if type(value) is not type(computed) or value != computed:
        raise HFImportError(
            f"{c.path}: {key}={shown(value)}: transformers' {c.model_type} ignores this key and computes "
            f"{what}; state {shown(computed)} or leave the key out"
        )


def check_activation(c: Config, key: str, allowed: tuple[str, ...]) -> None:
    c.expect(key, allowed, f"is an activation axgen's gated MLP does not use (it takes {', '.join(allowed)})")
