"""`axgen export-hf`: a program's params (the newest checkpoint of a run, or an `axgen convert-hf` checkpoint) as
a Hugging Face model folder: sharded safetensors, their index, a config.json, the tokenizer's files, and a base
model's generation_config.json.

The config is the spec's, written in the keys of its family's transformers config class, so that
`AutoModelForCausalLM.from_pretrained` builds the same model; `axgen import-hf` reads it back to the same spec. With
the published model the run started from (`--base`), it is that model's config.json, key for key, wherever the spec
agrees (`config_json`). The tensors are the family's (`Family.to_hf`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from axgen import progress
from axgen.data.chat import load_chat_template
from axgen.data.tokenizer import load_tokenizer
from axgen.files import check_replaceable, publish_dir, staging_dir
from axgen.hf.config import HFImportError, SpecSource, cut, read_config
from axgen.hf.families import FAMILIES, family
from axgen.hf.import_config import import_config
from axgen.hf.rope import write_scaling
from axgen.hf.weights import DTYPES
from axgen.interop import CheckpointError, host_jax, iter_hf_tensors
from axgen.spec import Model

SAFETENSORS_DTYPES = {np.dtype(dtype): name for name, dtype in DTYPES.items()}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",  # transformers prefers it to tokenizer_config.json's chat_template
)


def hf_config(spec: Model, dtype: str) -> dict:
    """config.json of the spec alone, in its family's transformers 4.x keys (which transformers 5 reads too): the
    keys every family shares, then the family's own (`Family.write`)."""
    found = family(spec)
    attention, rope = spec.decoder.attention, spec.feature("rope")
    if not found.deepseek_layout:
        _refuse_deepseek_layout(spec)
    config = {
        "architectures": [found.architecture],
        "model_type": found.model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.d_model,
        "intermediate_size": spec.decoder.mlp.hidden_dim,
        "num_hidden_layers": spec.decoder.num_layers,
        "num_attention_heads": attention.num_heads,
        "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.decoder.norm.eps,
        "rope_theta": rope.theta,
        "rope_scaling": write_scaling(rope.scaling),
        "tie_word_embeddings": spec.tie_embeddings,
        "max_position_embeddings": _max_position(spec),
        "torch_dtype": dtype,
    }
    # Qwen2's q, k and v biases are implied by its model type; the others say they have none.
    no_bias = {} if found.model_type in ("qwen2", "qwen2_moe") else {"attention_bias": False}
    config = config | no_bias | found.write(spec)
    if "rope_parameters" in config:  # a family that must state its RoPE in transformers 5's key (gpt-oss)
        del config["rope_theta"], config["rope_scaling"]
    return config


def _refuse_deepseek_layout(spec: Model) -> None:
    """DeepSeek's layout (RoPE on part of each head or in adjacent pairs, routed experts' weights scaled, DeepSeek's
    routing: scoring, correction bias, groups, leading dense layers) in a spec of another family: its config would
    state another model."""
    rope, moe = spec.feature("rope"), spec.feature("moe")
    if moe is not None and moe.routed_scale is not None:
        raise CheckpointError(
            f"{moe.origin}: MoE.routed_scale={moe.routed_scale}: no family axgen exports scales its routed experts"
        )
    if moe is not None:
        fields = {
            "scoring": moe.scoring != "softmax",
            "balance_bias_rate": moe.balance_bias_rate is not None,
            "n_group": moe.n_group is not None,
            "first_dense_layers": moe.first_dense_layers > 0,
        }
        for name, set_here in fields.items():
            if set_here:
                raise CheckpointError(
                    f"{moe.origin}: MoE.{name}={getattr(moe, name)!r}: no family axgen exports routes as DeepSeek "
                    "does"
                )
    if rope.rotary_dim is not None or rope.interleaved:
        raise CheckpointError(
            f"{rope.origin}: RoPE.rotary_dim={rope.rotary_dim}, interleaved={rope.interleaved}: "
            "no family axgen exports rotates part of a head or adjacent pairs"
        )


def _max_position(spec: Model) -> int:
    """max_position_embeddings: the spec's `max_position` (what import-hf read); for a spec that states none, the
    longest sequence it was meant for: what it trains on, or what its RoPE scaling stretches to (linear scaling
    states no original length: what it trains on)."""
    if spec.max_position is not None:
        return spec.max_position
    trained = spec.train.seq_len if spec.train else 4096
    scaling = spec.feature("rope").scaling
    if scaling is None or scaling.rule == "linear":
        return trained
    return max(trained, int(scaling.original_max_position * scaling.factor))


# --- a base model's config ----------------------------------------------------------------------------------------
#
# With a base (`--base DIR`: the published model folder the run started from), config.json is the base's, key for
# key, so that a round trip HF -> axgen -> HF gives back every key it held:
# - keys the spec does not decide (bos_token_id, use_cache, transformers_version, ...) are copied verbatim;
# - keys the spec decides (those `hf_config` writes) keep the base's value, spelled as the base spells it, wherever
#   the config still imports to the spec's model (`import-hf` of the result gives what it gives of `hf_config`);
#   where the base says otherwise (a vocabulary grown, a RoPE stretched), the spec's value is written, and a note
#   says which key (a spec that states no max_position leaves the base's max_position_embeddings);
# - the dtype is the one written, under the key the base names it by (`torch_dtype`, or transformers 5's `dtype`);
#   a base that names none gets none, unless the weights are written in another dtype than the spec's own;
# - the keys of tensors export-hf does not write (`Family.not_exported`: DeepSeek-V3's FP8 `quantization_config`
#   and multi-token-prediction layers, gpt-oss's MXFP4) are the spec's: the weights are written as the model
#   computes with them, and a loader would otherwise look for tensors that are not there.
# The base's generation_config.json is copied beside it.
DTYPE_KEYS = ("torch_dtype", "dtype")


def config_json(spec: Model, dtype: str, base: Path | None = None) -> tuple[dict, list[str]]:
    """(config.json, notes): the spec's (`hf_config`) or, with a base folder (or its config.json), the base's kept
    as far as it states the spec's model (above); each note names a key the spec decided otherwise than the base.
    """
    config = hf_config(spec, dtype)
    if base is None:
        return config, []
    source, path, _ = read_config(base)
    import_config(source, path)  # a base import-hf refuses is refused here, by its key
    if FAMILIES[source["model_type"]].write is None:
        raise HFImportError(
            f"{path}: model_type={source['model_type']!r} is not one export-hf writes (--base); the spec's is "
            f"{config['model_type']!r}"
        )
    stated = spec.max_position is not None
    model = _model(config, "the spec's config", stated)
    not_exported = family(spec).not_exported
    written = {key: value for key, value in source.items() if key not in not_exported}
    written |= {key: config[key] for key in not_exported if key in config}
    named = [key for key in DTYPE_KEYS if key in written]
    if named or dtype != export_dtype(spec, None):
        written |= dict.fromkeys(named or ["torch_dtype"], dtype)
    if _model(written, max_position=stated) == model:
        return written, []
    # The spec's every key over the base's, then taken back to the base's wherever the model stays the spec's: first
    # the keys the base does not state, together (a base may state its RoPE as rope_parameters, where the spec's
    # config says rope_theta and rope_scaling), then each key alone, until none is.
    merged = written | {key: value for key, value in config.items() if key not in DTYPE_KEYS}
    unstated = {key: value for key, value in merged.items() if key in written or key in DTYPE_KEYS}
    if _model(unstated, max_position=stated) == model:
        merged = unstated
    changed = True
    while changed:
        changed = False
        for key in config:
            if key in DTYPE_KEYS or merged.get(key, _ABSENT) == written.get(key, _ABSENT):
                continue
            trial = {k: v for k, v in merged.items() if k != key} | (
                {key: written[key]} if key in written else {}
            )
            if _model(trial, max_position=stated) == model:
                merged, changed = trial, True
    if _model(merged, max_position=stated) != model:
        raise CheckpointError(f"{path}: states keys the spec's model does not have; export without --base")
    notes = [
        f"{path}: {key}={cut(json.dumps(written[key]))} is written as the spec's {cut(json.dumps(merged[key]))}"
        for key in written
        if key in merged and merged[key] != written[key] and key not in DTYPE_KEYS
    ]
    order = [*written, *(key for key in merged if key not in written)]
    return {key: merged[key] for key in order if key in merged}, notes


_ABSENT = object()


def _model(config: dict, what: str = "", max_position: bool = True) -> SpecSource | None:
    """The model a config states, as import-hf reads it, the weights' dtype aside (it is decided apart), and its
    max_position_embeddings too where not `max_position` (a spec that states none leaves the base's standing);
    None where it states none."""
    try:
        source, _ = import_config(config, what or "config.json")
    except HFImportError:
        if what:
            raise
        return None
    return dataclasses.replace(
        source, checkpoint_dtype=None, max_position=source.max_position if max_position else None
    )


def load_params(checkpoint: Path) -> dict:
    """The params of an `axgen convert-hf` checkpoint, or of a run directory's newest checkpoint whose params match
    the checksums saved with them (a damaged newer one is named in a warning and skipped)."""
    host_jax()
    from axgen.runtime import checkpoints

    checkpoint = Path(checkpoint).resolve()
    try:
        if any(p.name.isdigit() for p in (checkpoint / "checkpoints").glob("*")):
            return checkpoints.newest_verified_on_host(checkpoint / "checkpoints", "params")
        return checkpoints.read_on_host(checkpoint)
    except checkpoints.Unreadable as err:
        raise CheckpointError(str(err)) from None


def export_hf(
    spec: Model,
    checkpoint: Path,
    out: Path,
    dtype: str | None = None,
    tokenizer: Path | None = None,
    shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    fused_experts: bool = False,
    chat_template: str | None = None,
    base: Path | None = None,
    merge: bool = False,
) -> dict[str, tuple[str, int]]:
    """Writes the HF model folder at `out`, published only when complete; returns each tensor's shard and size.
    The weights are in `dtype`, else the dtype of the checkpoint the spec was imported from, else bfloat16; the
    routed experts as the family's published checkpoints hold them, one tensor per expert, unless
    `fused_experts` (transformers 5's layout in memory, which it also loads). With a tokenizer, its files go
    along, its chat template too; `chat_template` (`chatml`, a .jinja file, or one of the tokenizer's named
    templates: what `axgen data --chat-template` takes) is written as the folder's chat_template.jinja. With
    `base`, the published model folder (or its config.json) the run started from, config.json keeps the base's keys
    (`config_json`) and its generation_config.json goes along. A spec with F.lora is exported `merge`d: its base
    with the run's adapters merged in (`export_adapter` writes the adapters alone)."""
    out = Path(out).resolve()
    check_replaceable(out, overwrite, "config.json")
    dtype = export_dtype(spec, dtype)
    config, notes = config_json(spec, dtype, None if base is None else Path(base))
    generation = None
    if base is not None:
        generation = (Path(base) if Path(base).is_dir() else Path(base).parent) / "generation_config.json"
        generation = generation if generation.is_file() else None
    if chat_template is not None and tokenizer is None:
        raise CheckpointError(f"--chat-template {chat_template}: needs --tokenizer, whose files it goes with")
    if tokenizer is not None:
        tokenizer, template = _tokenizer_files(Path(tokenizer), spec, chat_template)
    params = lora_params(spec, checkpoint, merge)
    tensors = family(spec).to_hf(iter_hf_tensors(params, spec, _numpy_dtype(dtype)), fused_experts)
    staging = staging_dir(out)
    try:
        try:
            written = _write_shards(staging, tensors, shard_bytes)
        except CheckpointError as err:
            raise CheckpointError(f"{checkpoint}: {err}") from None
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if generation is not None:
            shutil.copy2(generation, staging / generation.name)
        for source, name in tokenizer or ():
            shutil.copy2(source, staging / name)
        if chat_template is not None:
            (staging / "chat_template.jinja").write_text(template)
        publish_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return written


def lora_params(spec: Model, checkpoint: Path, merge: bool) -> dict:
    """The params to export: a checkpoint's as they are, or for a spec with F.lora (`merge`), the run's base with
    its adapters merged in. A LoRA run's checkpoints hold its adapters; its base is the --init-from it recorded.
    """
    from axgen.hf.peft import merged

    if spec.feature("lora") is None:
        if merge:
            raise CheckpointError(f"--merge: {spec.name} has no F.lora adapters to merge")
        return load_params(checkpoint)
    if not merge:
        raise CheckpointError(
            f"{checkpoint}: {spec.name} trains LoRA adapters; export them with --adapter, or the base with them"
            " merged in with --merge"
        )
    from axgen.runtime.params import joined  # after load_params's host_jax(): it imports jax

    adapters = load_params(checkpoint)
    return merged(joined(load_params(run_base(checkpoint)), adapters), spec)


def run_base(run_dir: Path) -> Path:
    """The --init-from a LoRA run recorded (RUN_DIR/base.json), which its adapters were trained on."""
    recorded = _recorded_base(run_dir)
    if recorded is None:
        raise CheckpointError(
            f"{run_dir}: its base was drawn from the seed, not loaded (--init-from): there is no base to merge into;"
            " export the adapters with --adapter"
        )
    return Path(recorded)


def _recorded_base(run_dir: Path) -> str | None:
    from axgen.runtime.checkpoints import BASE, recorded_base

    try:
        return recorded_base(run_dir)
    except (OSError, ValueError, KeyError):
        raise CheckpointError(
            f"{run_dir}: not the run directory of a LoRA run (no readable {BASE} naming its base)"
        ) from None


def _base_model_name(run_dir: Path) -> str | None:
    """The HF folder a LoRA run's base was converted from, where convert-hf recorded it."""
    from axgen.runtime.checkpoints import SOURCE

    from axgen.runtime.checkpoints import BASE

    recorded = _recorded_base(run_dir) if (Path(run_dir) / BASE).is_file() else None
    source = Path(recorded or "") / SOURCE
    return json.loads(source.read_text()).get("hf_dir") if recorded and source.is_file() else None


def export_adapter(
    spec: Model,
    checkpoint: Path,
    out: Path,
    dtype: str | None = None,
    base: Path | None = None,
    overwrite: bool = False,
) -> dict[str, np.ndarray]:
    """Writes the run's adapters (F.lora) at `out` as `PeftModel.save_pretrained` does: adapter_config.json and
    adapter_model.safetensors, in `dtype` (default float32, as PEFT keeps adapters), naming `base` (the published
    model folder) as the base model, else the folder the run's base was converted from. Published only when
    complete."""
    from safetensors.numpy import save_file

    from axgen.hf.peft import CONFIG, WEIGHTS, adapter_config, adapter_tensors, lora_of

    lora_of(spec)
    out = Path(out).resolve()
    check_replaceable(out, overwrite, CONFIG)
    tensors = adapter_tensors(load_params(checkpoint), spec, _numpy_dtype(dtype or "float32"))
    base_name = str(base) if base is not None else _base_model_name(checkpoint)
    staging = staging_dir(out)
    try:
        save_file(tensors, str(staging / WEIGHTS), metadata={"format": "pt"})
        config = adapter_config(spec, base_name)
        (staging / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        publish_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return tensors


def export_dtype(spec: Model, requested: str | None) -> str:
    """The dtype asked for, else the one of the checkpoint the spec was imported from, else bfloat16."""
    return requested or spec.checkpoint_dtype or "bfloat16"


def _numpy_dtype(name: str):
    return {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}[name]


def _write_shards(directory: Path, tensors: Iterator[tuple[str, np.ndarray]], shard_bytes: int) -> dict:
    """As `save_pretrained` lays them out: shards of at most `shard_bytes` and their index. Each tensor's bytes
    go to disk as it comes, so the host holds one tensor at a time; a shard's header, which must come first,
    is written once its tensors are known, and its data copied in after it."""
    shards: list[dict[str, dict]] = []
    bodies: list[Path] = []
    body = None
    with progress.bar(desc="exporting", unit="B", unit_scale=True, unit_divisor=1024) as shown:
        for name, tensor in tensors:
            shown.update(tensor.nbytes)
            if body is None or (shards[-1] and _size(shards[-1]) + tensor.nbytes > shard_bytes):
                if body is not None:
                    body.close()
                bodies.append(directory / f".body-{len(shards)}")
                shards.append({})
                body = open(bodies[-1], "wb")
            begin = _size(shards[-1])
            shards[-1][name] = {
                "dtype": SAFETENSORS_DTYPES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [begin, begin + tensor.nbytes],
            }
            body.write(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8))
    if body is not None:
        body.close()
    weight_map: dict[str, tuple[str, int]] = {}
    for number, (shard, data) in enumerate(zip(shards, bodies), 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(directory / file, shard, data)
        weight_map |= {name: (file, e["data_offsets"][1] - e["data_offsets"][0]) for name, e in shard.items()}
    index = {
        "metadata": {"total_size": sum(size for _, size in weight_map.values())},
        "weight_map": {name: file for name, (file, _) in weight_map.items()},
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def _size(shard: dict[str, dict]) -> int:
    return max((entry["data_offsets"][1] for entry in shard.values()), default=0)


def _write_safetensors(path: Path, header: dict, data: Path) -> None:
    """The safetensors layout: the header's length (8 bytes, little-endian), the JSON header padded with spaces
    to a multiple of 8, then the tensors' bytes."""
    text = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f, open(data, "rb") as body:
        f.write(struct.pack("<Q", len(text)) + text)
        shutil.copyfileobj(body, f, 64 * 2**20)
    data.unlink()


def _tokenizer_files(
    source: Path, spec: Model, chat_template: str | None
) -> tuple[list[tuple[Path, str]], str | None]:
    """(file, name to write it as) of a tokenizer.json, or of a folder holding one, and its config files beside
    it, and the text of the chat template asked for; the tokenizer must load and fit the spec's vocabulary."""
    if not source.exists():
        raise CheckpointError(f"{source}: no such file or folder (--tokenizer)")
    tokenizer_json = source / "tokenizer.json" if source.is_dir() else source
    if not tokenizer_json.is_file():
        raise CheckpointError(f"{source}: has no tokenizer.json (--tokenizer)")
    tokenizer = load_tokenizer(tokenizer_json)
    if tokenizer.vocab_size > spec.vocab_size:
        raise CheckpointError(
            f"{tokenizer_json}: its {tokenizer.vocab_size} tokens exceed vocab_size={spec.vocab_size} of {spec.origin}"
        )
    template = None if chat_template is None else load_chat_template(tokenizer, chat_template).text
    beside = [
        (tokenizer_json.with_name(name), name)
        for name in TOKENIZER_FILES[1:]
        if tokenizer_json.with_name(name).is_file() and not (name == "chat_template.jinja" and template)
    ]
    return [(tokenizer_json, "tokenizer.json"), *beside], template
