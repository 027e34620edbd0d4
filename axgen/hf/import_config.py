"""`axgen import-hf`: a Hugging Face `config.json` becomes a readable spec file.

Every key of the config is read by its family's adapter (`axgen.hf.families`), listed in `config.IRRELEVANT`, or
stops the import with an error that names it: none is silently dropped. Keys a config leaves out take the value
transformers' config class gives them (each family's `defaults`), and the written spec states every value. Both
conventions are read: transformers 4.x (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters`,
`dtype`, `layer_types`).
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import black

from axgen.backends import family_for
from axgen.codegen.emit import BLACK_MODE
from axgen.files import check_replaceable, write_atomically
from axgen.hf.config import Config, HFImportError, SpecSource, cut, literal, read_config
from axgen.hf.families import FAMILIES
from axgen.loader import load_spec
from axgen.spec import Model, SpecError
from axgen.spec.model import CHECKPOINT_DTYPES


def import_config(config: dict, path: str) -> tuple[SpecSource, Config]:
    """The spec a config describes, and the config with every key it read marked."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise HFImportError(
            f"{path}: model_type={cut(repr(model_type))} is not one axgen imports "
            f"(it imports {', '.join(FAMILIES)})"
        )
    family = FAMILIES[model_type]
    c = Config(config, path, model_type, family.defaults)
    c.read.add("model_type")
    source = family.read(c)
    source.checkpoint_dtype = _checkpoint_dtype(c)
    unaccounted = c.unaccounted()
    if unaccounted:
        key = unaccounted[0]
        raise HFImportError(
            f"{path}: {key}={cut(repr(config[key]))} is a key axgen's {model_type} import does not know, so "
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
            f"{c.path}: {key}={cut(repr(value))} is not a dtype axgen reads (bfloat16, float16, float32)"
        )
    return value


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
    vocab_size={literal(source.vocab_size)},
    d_model={literal(source.d_model)},
    tie_embeddings={source.tie_embeddings!r},
    {source.checkpoint_comment}checkpoint_dtype={source.checkpoint_dtype!r},
    max_position={literal(source.max_position)},
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
