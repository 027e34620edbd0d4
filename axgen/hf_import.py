"""`axgen import-hf`: a Hugging Face `config.json` becomes a readable spec file.

Every key of the config is read by a family's mapping, listed in `IRRELEVANT`, or stops the import with an error
that names it: none is silently dropped. Keys a config leaves out take the value transformers' config class gives
them (`DEFAULTS`), and the written spec states every value. Both conventions are read: transformers 4.x
(`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters`, `dtype`, `layer_types`).
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import black

from axgen.codegen.emit import BLACK_MODE
from axgen.files import write_atomically
from axgen.loader import load_spec
from axgen.spec import Model

# Keys that do not change what the model computes: inference settings, task heads, bookkeeping.
IRRELEVANT = frozenset(
    {
        "_name_or_path",
        "architectures",
        "bos_token_id",
        "cache_implementation",
        "chunk_size_feed_forward",
        "dtype",
        "eos_token_id",
        "id2label",
        "initializer_range",
        "is_encoder_decoder",
        "label2id",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "pad_token_id",
        "pretraining_tp",  # splits the same matmuls for Llama 2's original tensor parallelism
        "problem_type",
        "return_dict",
        "torch_dtype",
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
    | {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "qkv_bias": True},
    "qwen3": _LLAMA | {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "qwen2_moe": _LLAMA
    | {
        "qkv_bias": True,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "decoder_sparse_step": 1,
        "norm_topk_prob": False,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
    },
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
}


class HFImportError(ValueError):
    """One line: the config file, and the key and value that stop the import."""


@dataclass
class Config:
    """An HF config.json whose keys are marked as they are read, so that none goes unaccounted for."""

    values: dict
    path: str
    model_type: str
    read: set[str] = field(default_factory=set)

    def __getitem__(self, key: str):
        self.read.add(key)
        if key in self.values:
            return self.values[key]
        defaults = DEFAULTS[self.model_type]
        if key not in defaults:
            raise HFImportError(f"{self.path}: has no {key!r}, which a {self.model_type} config needs")
        return defaults[key]

    def expect(self, key: str, allowed: tuple, why: str):
        """The key's value, which must be one of `allowed`: axgen does not implement the others."""
        value = self[key]
        if value not in allowed:
            raise HFImportError(f"{self.path}: {key}={value!r} {why}")
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
    features: list[str] = field(default_factory=list)


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
    if not isinstance(config, dict):
        raise HFImportError(f"{config_path}: not a JSON object")
    return config, str(config_path), hashlib.sha256(raw).hexdigest()


def import_config(config: dict, path: str) -> tuple[SpecSource, Config]:
    """The spec a config describes, and the config with every key it read marked."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise HFImportError(
            f"{path}: model_type={model_type!r} is not one axgen imports (it imports {', '.join(FAMILIES)})"
        )
    c = Config(config, path, model_type)
    c.read.add("model_type")
    source = FAMILIES[model_type](c)
    unaccounted = c.unaccounted()
    if unaccounted:
        key = unaccounted[0]
        raise HFImportError(
            f"{path}: {key}={config[key]!r} is a key axgen's {model_type} import does not know, so it stops "
            f"rather than drop it"
        )
    return source, c


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
        parameters = dict(c["rope_parameters"])
        theta = parameters.pop("rope_theta")
    else:
        theta, parameters = c["rope_theta"], dict(c["rope_scaling"] or {})
    kind = parameters.pop("rope_type", parameters.pop("type", "default"))
    if kind == "default" and not parameters:
        return f"F.rope(theta={_number(float(theta))})"
    if kind != "llama3":
        raise HFImportError(f"{c.path}: rope type {kind!r} is not one axgen implements (default, llama3)")
    scaling = (
        f"F.rope_scaling(factor={float(parameters.pop('factor'))!r}, "
        f"low_freq_factor={float(parameters.pop('low_freq_factor'))!r}, "
        f"high_freq_factor={float(parameters.pop('high_freq_factor'))!r}, "
        f"original_max_position={parameters.pop('original_max_position_embeddings')})"
    )
    if parameters:
        key, value = next(iter(parameters.items()))
        raise HFImportError(
            f"{c.path}: rope parameter {key}={value!r} is not one axgen's llama3 scaling reads"
        )
    return f"F.rope(theta={_number(float(theta))}, scaling={scaling})"


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
                f"{c.path}: layer_types={c['layer_types']!r} is not what axgen's {c.model_type} import maps "
                f"({expected[:2]}...)"
            )


def _activation(c: Config, key: str, allowed: tuple[str, ...]) -> None:
    c.expect(key, allowed, f"is an activation axgen's gated MLP does not use (it takes {', '.join(allowed)})")


def llama(c: Config) -> SpecSource:
    _activation(c, "hidden_act", ("silu",))
    _no_attention_bias(c)
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
    _no_window(c)
    source = _decoder(c)
    source.features = [_rope(c), "F.qkv_bias()"]
    return source


def qwen3(c: Config) -> SpecSource:
    _activation(c, "hidden_act", ("silu",))
    _no_window(c)
    _no_attention_bias(c)
    source = _decoder(c)
    source.features = [_rope(c), f'F.qk_norm(eps={c["rms_norm_eps"]!r})']
    return source


def qwen2_moe(c: Config) -> SpecSource:
    source = qwen2(c)
    c.expect("mlp_only_layers", ([],), "keeps dense MLPs in chosen layers, which axgen's import does not map")
    source.mlp = f'MLP(hidden_dim={_number(c["moe_intermediate_size"])}, activation="swiglu")'
    c.read.add("intermediate_size")  # the dense MLP width, which no layer uses when every layer is sparse
    source.features.append(
        f'F.moe(num_experts={c["num_experts"]}, top_k={c["num_experts_per_tok"]}, '
        f'renormalize={c["norm_topk_prob"]!r}, every={c["decoder_sparse_step"]}, '
        f'shared_hidden_dim={_number(c["shared_expert_intermediate_size"])}, shared_gate=True, '
        f'aux_loss_weight={c["router_aux_loss_coef"]!r}, router_z_loss_weight=0.0)'
    )
    return source


def gemma2(c: Config) -> SpecSource:
    _activation(c, "hidden_activation", ("gelu_pytorch_tanh",))
    c.read.add("hidden_act")  # transformers reads hidden_activation for Gemma 2
    _no_attention_bias(c)
    source = _decoder(c)
    head_dim = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    c.expect("query_pre_attn_scalar", (head_dim,), f"scales queries by other than head_dim={head_dim}")
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


FAMILIES: dict[str, Callable[[Config], SpecSource]] = {
    "llama": llama,
    "mistral": mistral,
    "mixtral": mixtral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen2_moe": qwen2_moe,
    "gemma2": gemma2,
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


def import_hf(config_path: Path, out: Path, choices: TrainChoices, name: str | None = None) -> Model:
    """Writes the spec of an HF config to `out` (black-formatted; only once it loads as a valid spec) and returns
    it."""
    config, origin, sha256 = read_config(config_path)
    source, _ = import_config(config, origin)
    text = black.format_str(
        spec_text(source, name or model_name(out), origin, sha256, choices), mode=BLACK_MODE
    )
    with tempfile.TemporaryDirectory() as scratch:
        trial = Path(scratch) / out.name
        trial.write_text(text)
        spec = load_spec(trial)
    write_atomically(out, text)
    return spec
