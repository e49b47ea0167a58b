"""transformers' RoPE initialisers (modeling_rope_utils: _compute_default_rope_parameters,
_compute_linear_scaling_rope_parameters, _compute_llama3_parameters,
_compute_yarn_parameters) transcribed in numpy, for the conversion tests' reference forwards.
Returns (inv_freq [dim / 2], attention_scaling on cos and sin)."""

import math

import numpy as np


def hf_inv_freq(cfg: dict, dim: int):
    base = cfg.get("rope_theta", 10000.0)
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim))
    rs = cfg.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    factor = rs["factor"]
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low_freq_factor, high_freq_factor = rs["low_freq_factor"], rs["high_freq_factor"]
        old_context_len = rs["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = ((old_context_len / wavelen - low_freq_factor)
                         / (high_freq_factor - low_freq_factor))
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return np.where(is_medium, smoothed, inv_freq_llama), 1.0
    assert kind == "yarn"
    original = rs.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    else:
        attention_factor = get_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def find_correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(find_correction_dim(beta_fast)), 0)
    high = min(math.ceil(find_correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2).astype(np.float64) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = (inv_freq_interpolation * (1 - extrapolation_factor)
                + inv_freq_extrapolation * extrapolation_factor)
    return inv_freq, attention_factor


def hf_rope_tables(cfg: dict, t: int, dim: int):
    """cos, sin [T, dim] as the HF rotary embedding returns them (attention scaling applied)."""
    inv_freq, scaling = hf_inv_freq(cfg, dim)
    emb = np.concatenate([np.outer(np.arange(t), inv_freq)] * 2, axis=-1)
    return np.cos(emb) * scaling, np.sin(emb) * scaling
