"""RoPE in config.json, both directions: `read_rope` takes a config's `rope_parameters` (transformers 5) or
`rope_theta` and `rope_scaling` (4.x) to the spec's F.rope; `write_scaling` takes a spec's RoPE scaling back to a
`rope_scaling` object. `SCALINGS` holds each scaling's reader and writer side by side.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from axgen.hf.config import KINDS, Config, HFImportError, literal, shown


def read_rope(c: Config) -> str:
    """F.rope from `rope_parameters` (transformers 5) or `rope_theta` and `rope_scaling` (4.x)."""
    if "rope_parameters" in c.values:
        key, parameters = "rope_parameters", rope_dict(c, "rope_parameters")
        theta = rope_value(c, key, parameters, "rope_theta", "positive number")
    else:
        key, theta, parameters = "rope_scaling", c["rope_theta"], rope_dict(c, "rope_scaling")
    scaling = read_scaling(c, key, parameters)
    return f"F.rope(theta={literal(float(theta))}{f', scaling={scaling}' if scaling else ''})"


def read_scaling(c: Config, key: str, parameters: dict) -> str | None:
    """The `scaling=` of F.rope from a config's RoPE parameters (theta already taken out), None for plain RoPE;
    every parameter must be read."""
    kind = parameters.pop("rope_type", parameters.pop("type", "default"))
    if kind == "default" and not parameters:
        return None
    if kind not in SCALINGS:
        raise HFImportError(
            f"{c.path}: {key}.rope_type={shown(kind)} is not one axgen implements "
            f"(default, {', '.join(SCALINGS)})"
        )
    scaling = SCALINGS[kind][0](c, key, parameters)
    if parameters:
        name, value = next(iter(parameters.items()))
        raise HFImportError(
            f"{c.path}: {key}.{name}={shown(value)} is not a parameter axgen's {kind} scaling reads"
        )
    return scaling


def _read_llama3(c: Config, key: str, parameters: dict) -> str:
    factor, low, high = (
        float(rope_value(c, key, parameters, name, "positive number"))
        for name in ("factor", "low_freq_factor", "high_freq_factor")
    )
    original = rope_value(c, key, parameters, "original_max_position_embeddings", "positive int")
    return (
        f"F.rope_scaling(factor={factor!r}, low_freq_factor={low!r}, high_freq_factor={high!r}, "
        f"original_max_position={original})"
    )


def _read_linear(c: Config, key: str, parameters: dict) -> str:
    return f"F.rope_linear(factor={float(rope_value(c, key, parameters, 'factor', 'positive number'))!r})"


def _read_yarn(c: Config, key: str, parameters: dict) -> str:
    """YaRN with every value transformers' `_compute_yarn_parameters` takes stated: beta_fast 32 and beta_slow 1
    where missing (or 0, which it reads as missing), truncate true, and the attention factor from `factor`,
    `mscale` and `mscale_all_dim` where the config does not give it."""
    factor = float(rope_value(c, key, parameters, "factor", "positive number"))
    original = rope_value(c, key, parameters, "original_max_position_embeddings", "positive int")
    optional = {
        name: rope_value(c, key, parameters, name, kind) if name in parameters else None
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
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor, 1)
    truncate = True if optional["truncate"] is None else optional["truncate"]
    return (
        f"F.rope_yarn(factor={factor!r}, beta_fast={float(optional['beta_fast'] or 32)!r}, "
        f"beta_slow={float(optional['beta_slow'] or 1)!r}, original_max_position={original}, "
        f"attention_factor={float(attention_factor)!r}, truncate={truncate!r})"
    )


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature for a context stretched by `factor` (transformers' `get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_dict(c: Config, key: str) -> dict:
    value = c[key]
    if value is not None and not isinstance(value, dict):
        raise HFImportError(f"{c.path}: {key}={shown(value)} is not an object of RoPE parameters, or null")
    return dict(value or {})


def rope_value(c: Config, key: str, parameters: dict, name: str, kind: str):
    """`parameters[name]` (removed from it), which must be of `kind`."""
    if name not in parameters:
        raise HFImportError(f"{c.path}: {key} has no {name!r}")
    value = parameters.pop(name)
    check, description = KINDS[kind]
    if not check(value):
        raise HFImportError(f"{c.path}: {key}.{name}={shown(value)} is not {description}")
    return value


def write_scaling(scaling) -> dict | None:
    """The `rope_scaling` object of a spec's RoPE scaling (None without one), every value stated, the attention
    factor too, so that transformers' defaults decide nothing."""
    return None if scaling is None else SCALINGS[scaling.rule][1](scaling)


def _write_llama3(scaling) -> dict:
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position,
    }


def _write_linear(scaling) -> dict:
    return {"rope_type": "linear", "factor": scaling.factor}


def _write_yarn(scaling) -> dict:
    return {
        "rope_type": "yarn",
        "factor": scaling.factor,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
        "original_max_position_embeddings": scaling.original_max_position,
        "attention_factor": scaling.attention_factor,
        "truncate": scaling.truncate,
    }


# Each rope_type axgen implements besides the default: (its reader, its writer). The reader takes a config's
# parameters (each removed as it is read) to F.rope's `scaling=` expression.
SCALINGS: dict[str, tuple[Callable[[Config, str, dict], str], Callable[[object], dict]]] = {
    "llama3": (_read_llama3, _write_llama3),
    "linear": (_read_linear, _write_linear),
    "yarn": (_read_yarn, _write_yarn),
}
