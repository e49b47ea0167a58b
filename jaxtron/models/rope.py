"""RoPE frequencies, plain or scaled for a longer context (`model.rope_scaling`).

Each rotated pair i of a head of width K turns at inv_freq[i] = theta^(-2i / K) radians per
position. Scaling changes those rates so that positions beyond the trained context
(`model.rope_original_max_len`, L0) look like positions inside it, with factor s =
`model.rope_factor`:

- `linear` (position interpolation, Chen et al. 2023): every rate divided by s.
- `llama3` (Llama 3.1): wavelengths 2 pi / inv_freq longer than L0 / low_freq_factor are
  divided by s, shorter than L0 / high_freq_factor kept, and those between blended by
  r = (L0 / wavelength - low) / (high - low): (1 - r) inv_freq / s + r inv_freq.
- `yarn` (Peng et al. 2023, "YaRN"; DeepSeek-V3, Qwen): pairs that turn fewer than beta_slow
  times over L0 are interpolated (divided by s), more than beta_fast times kept, a linear ramp
  between; cos and sin are multiplied by the attention factor
  m(s, mscale) / m(s, mscale_all_dim) with m(s, a) = 0.1 a ln(s) + 1 (1 for s <= 1), and
  multi-head latent attention also multiplies its softmax scale by m(s, mscale_all_dim)^2, as
  DeepSeek-V3's model code does.

These are the formulas of transformers' `modeling_rope_utils` (and the models' code), which is
what a converted checkpoint was trained with.
"""

from __future__ import annotations

import math

import numpy as np

from jaxtron.config.schema import ModelConfig

SCALINGS = ("none", "linear", "llama3", "yarn")


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inverse_frequencies(cfg: ModelConfig, plain: np.ndarray, width: int) -> np.ndarray:
    base, factor, original = cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_len

    def correction_dim(rotations: float) -> float:  # the pair that turns `rotations` times
        return width * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), width - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(width // 2) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (keep the rate), 0: interpolate (divide by s)
    return plain / factor * (1.0 - keep) + plain * keep


def inverse_frequencies(cfg: ModelConfig, width: int) -> np.ndarray:
    """Radians per position of each of the width / 2 rotated pairs."""
    plain = 1.0 / cfg.rope_theta ** (np.arange(0, width, 2, dtype=np.float64) / width)
    kind, factor = cfg.rope_scaling, cfg.rope_factor
    if kind == "none":
        return plain
    if kind == "linear":
        return plain / factor
    if kind == "yarn":
        return _yarn_inverse_frequencies(cfg, plain, width)
    original, low, high = (cfg.rope_original_max_len, cfg.rope_low_freq_factor,
                           cfg.rope_high_freq_factor)
    wavelength = 2 * math.pi / plain
    scaled = np.where(wavelength > original / low, plain / factor, plain)
    blend = (original / wavelength - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return np.where(medium, smoothed, scaled)


def rotation_scale(cfg: ModelConfig) -> float:
    """Factor on cos and sin (YaRN's attention factor; 1 otherwise)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return (_mscale(cfg.rope_factor, cfg.rope_mscale)
                / _mscale(cfg.rope_factor, cfg.rope_mscale_all_dim))
    return _mscale(cfg.rope_factor)


def latent_softmax_scale(cfg: ModelConfig) -> float:
    """Factor on multi-head latent attention's softmax scale under YaRN (DeepSeek-V3)."""
    if cfg.rope_scaling != "yarn" or not cfg.rope_mscale_all_dim:
        return 1.0
    return _mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
