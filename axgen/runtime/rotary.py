"""Rotary position embedding: the frequencies of each scaling rule (Llama 3's, linear interpolation, YaRN) and the
rotation, by halves or by interleaved pairs, of all channels or the last `rotary_dim`. A program passes the rule's
numbers as a dict its spec decides (`ROPE_SCALING`, with the rule's name under "rule")."""

import math

import jax.numpy as jnp
import numpy as np


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """Inverse frequency of each channel pair, a float32 numpy constant."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    if scaling is None:
        return inv_freq
    return _SCALINGS[scaling["rule"]](inv_freq, head_dim, theta, scaling)


def _llama3(inv_freq, head_dim, theta, scaling):
    """Llama 3's long-context rule: wavelengths beyond original_max_position / low_freq_factor are slowed by
    `factor`, those below original_max_position / high_freq_factor are kept, and the band between is
    interpolated."""
    wavelength = 2 * np.pi / inv_freq
    low_freq_wavelength = scaling["original_max_position"] / scaling["low_freq_factor"]
    high_freq_wavelength = scaling["original_max_position"] / scaling["high_freq_factor"]
    slowed = np.where(wavelength > low_freq_wavelength, inv_freq / scaling["factor"], inv_freq)
    smooth = (scaling["original_max_position"] / wavelength - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"]
    )
    blended = (1 - smooth) * slowed / scaling["factor"] + smooth * slowed
    in_band = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return np.where(in_band, blended, slowed).astype(np.float32)


def _linear(inv_freq, head_dim, theta, scaling):
    """Linear position interpolation: every frequency divided by `factor`, as if the positions were."""
    return inv_freq / np.float32(scaling["factor"])


def _yarn(inv_freq, head_dim, theta, scaling):
    """YaRN: channel pairs that turn fewer than beta_slow times over original_max_position are slowed by `factor`,
    those that turn more than beta_fast times are kept, and a linear ramp blends the pairs between (`rope` scales
    cos and sin by attention_factor)."""

    def pair(rotations):
        """The (fractional) channel pair that turns `rotations` times over the original context."""
        return (
            head_dim
            * math.log(scaling["original_max_position"] / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = pair(scaling["beta_fast"]), pair(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp
    slowed = 1.0 / (scaling["factor"] * theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    return (slowed * (1 - kept) + inv_freq * kept).astype(np.float32)


_SCALINGS = {"llama3": _llama3, "linear": _linear, "yarn": _yarn}


def rope(x, positions, *, theta: float, scaling: dict | None, rotary_dim: int | None, interleaved: bool):
    """Rotary embedding of x [batch, seq, heads, head_dim]: channel halves rotate by position * frequency. With
    `rotary_dim`, only the last rotary_dim channels rotate (over frequencies of that width); the others carry no
    position. With `interleaved`, the pairs are adjacent channels (2i, 2i + 1) instead. No option has a default:
    a program states each, so what it computes never changes without a diff of it."""
    if rotary_dim is not None and rotary_dim < x.shape[-1]:
        kept, rotated = jnp.split(x, [x.shape[-1] - rotary_dim], axis=-1)
        turned = rope(
            rotated, positions, theta=theta, scaling=scaling, rotary_dim=None, interleaved=interleaved
        )
        return jnp.concatenate([kept, turned], axis=-1)
    inv_freq = rope_frequencies(x.shape[-1], theta, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, seq, head_dim / 2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]  # broadcast over heads
    if scaling is not None and scaling["rule"] == "yarn":
        cos, sin = cos * scaling["attention_factor"], sin * scaling["attention_factor"]
    if interleaved:
        pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return rotated.reshape(x.shape).astype(x.dtype)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
