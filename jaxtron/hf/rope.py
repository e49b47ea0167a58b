"""RoPE settings between Hugging Face's config.json and `model.rope_*`.

transformers writes them in two layouts: top-level `rope_theta` and `rope_scaling` (up to
4.x), or one `rope_parameters` dict holding both (5.x). Both read; export writes the first.
Scaling types `linear`, `llama3` and `yarn` map onto `model.rope_scaling` (formulas in
`models/rope.py`); others (dynamic NTK, LongRoPE, per-attention-type settings, YaRN with an
explicit attention_factor or without truncation) are refused, naming the field.
"""

from __future__ import annotations

from jaxtron.config.schema import ModelConfig
from jaxtron.errors import ConfigError

# config.json key -> model field, per scaling type
_FIELDS = {
    "linear": {"factor": "rope_factor"},
    "llama3": {"factor": "rope_factor", "original_max_position_embeddings":
               "rope_original_max_len", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor"},
    "yarn": {"factor": "rope_factor", "original_max_position_embeddings":
             "rope_original_max_len", "beta_fast": "rope_beta_fast",
             "beta_slow": "rope_beta_slow", "mscale": "rope_mscale",
             "mscale_all_dim": "rope_mscale_all_dim"},
}
_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings"),
             "yarn": ("factor",)}


def _refuse(field: str, why: str):
    raise ConfigError(f"config.json sets {field}, which jaxtron cannot convert: {why}; "
                      "convert a model without that setting.")


def rope_parameters(hf: dict) -> dict:
    """The 5.x `rope_parameters` dict, or {}."""
    params = hf.get("rope_parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ConfigError(f"config.json: rope_parameters={params!r} must be an object; fix "
                          "config.json.")
    if any(isinstance(v, dict) for v in params.values()):  # {"full_attention": {...}, ...}
        _refuse("rope_parameters per attention type", "one RoPE serves every layer")
    return params


def rope_theta(hf: dict, default: float) -> float:
    theta = hf.get("rope_theta", rope_parameters(hf).get("rope_theta", default))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"config.json: rope_theta={theta!r} must be a positive number; fix "
                          "config.json.")
    return float(theta)


def rope_from_hf(hf: dict) -> dict:
    """config.json -> the `model.rope_*` overrides of its scaling ({} for plain RoPE)."""
    scaling, where = hf.get("rope_scaling"), "rope_scaling"
    if scaling is None:
        scaling, where = rope_parameters(hf), "rope_parameters"
    if not isinstance(scaling, dict):
        raise ConfigError(f"config.json: {where}={scaling!r} must be an object; fix "
                          "config.json.")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return {}
    if kind not in _FIELDS:
        _refuse(f"{where}.rope_type={kind}", "RoPE scaling converts for linear, llama3 and "
                "yarn only")
    missing = [key for key in _REQUIRED[kind] if key not in scaling]
    if missing:
        raise ConfigError(f"config.json: {where} of type {kind} lacks {', '.join(missing)}; "
                          "fix config.json.")
    if kind == "yarn" and scaling.get("attention_factor") is not None:
        _refuse(f"{where}.attention_factor", "YaRN's attention factor is derived from mscale")
    if kind == "yarn" and scaling.get("truncate", True) is False:
        _refuse(f"{where}.truncate=false", "YaRN's correction range is truncated")
    out = {"rope_scaling": kind}
    if kind == "yarn" and "original_max_position_embeddings" not in scaling:
        out["rope_original_max_len"] = hf["max_position_embeddings"]
    for key, field in _FIELDS[kind].items():
        if scaling.get(key) is not None:
            value = scaling[key]
            out[field] = int(value) if field == "rope_original_max_len" else float(value)
    return out


def rope_to_hf(m: ModelConfig) -> dict | None:
    """`model.rope_*` -> config.json's `rope_scaling` (None for plain RoPE)."""
    if m.rope_scaling == "none":
        return None
    out = {"rope_type": m.rope_scaling}
    for key, field in _FIELDS[m.rope_scaling].items():
        out[key] = getattr(m, field)
    return out
