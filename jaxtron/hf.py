"""Conversion between jaxtron llama parameters and Hugging Face Llama / Mixtral checkpoints.

    hf_config, tensors = to_hf(config, nnx.to_pure_dict(trainer.to_model_params(state.params)))
    save_hf_dir("out/hf", hf_config, tensors)    # loads with LlamaForCausalLM.from_pretrained
    model, moe, params = from_hf(*load_hf_dir("out/hf"))

A dense llama maps to `LlamaForCausalLM`; a llama whose every block is a Mixtral-style MoE
(`moe.every=1`, no shared experts, `topk_then_softmax` routing) maps to `MixtralForCausalLM`.
Pure functions on numpy arrays: no torch, no checkpoint machinery.

Layout. A torch `Linear` stores its weight [out, in] and computes x @ W.T; ours are [in, out]
with heads kept as their own axes (wq [D, H, K], wo [H, K, D]), and stacked over layers with a
leading N. So q_proj.weight = wq[i].reshape(D, H*K).T, o_proj.weight = wo[i].reshape(H*K, D).T.

RoPE needs no permutation of the q/k rows: `jaxtron.models.layers.rotary` rotates the pairs
(i, i + K/2) with frequencies theta^(-2i/K), which is HF Llama's `rotate_half` convention with
`inv_freq = 1 / theta^(arange(0, K, 2) / K)`. (Meta's original checkpoints rotate interleaved
pairs (2i, 2i+1); HF's conversion script permutes them into this layout, so HF files need none.)
Mixtral's router (softmax over all experts, top-k, renormalise the k weights) equals a softmax
over the top-k logits, which is our `topk_then_softmax`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from jaxtron.config import COMPUTE_DTYPES, Config
from jaxtron.errors import ConfigError, DataError

LLAMA, MIXTRAL = "LlamaForCausalLM", "MixtralForCausalLM"
MODEL_TYPES = {LLAMA: "llama", MIXTRAL: "mixtral"}
# HF config defaults for fields a config.json may omit (transformers' LlamaConfig/MixtralConfig).
DEFAULTS = {LLAMA: {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                    "rope_theta": 10000.0},
            MIXTRAL: {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                      "rope_theta": 1e6}}
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # a buffer older checkpoints saved; recomputed
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def _tensor_table(dims: dict) -> list[tuple]:
    """Every tensor as (hf name, our path, index into our array, our full shape, input dims).

    `input dims` is how many leading axes of the indexed slice are a Linear's input (0: a norm
    vector, copied as it is). `dims` holds N D H G K F V and E (0 for a dense model)."""
    n, d, h, g, k, f, v, e = (dims[c] for c in "NDHGKFVE")
    rows = [("model.embed_tokens.weight", ("embedder", "embed"), (), (v, d), 0),
            ("model.norm.weight", ("head", "final_norm", "scale"), (), (d,), 0),
            ("lm_head.weight", ("head", "lm_head"), (), (d, v), 1)]
    for i in range(n):
        p = f"model.layers.{i}."
        rows += [(p + "input_layernorm.weight", ("blocks", "attn_norm", "scale"), (i,), (n, d), 0),
                 (p + "post_attention_layernorm.weight", ("blocks", "mlp_norm", "scale"), (i,),
                  (n, d), 0),
                 (p + "self_attn.q_proj.weight", ("blocks", "attn", "wq"), (i,), (n, d, h, k), 1),
                 (p + "self_attn.k_proj.weight", ("blocks", "attn", "wk"), (i,), (n, d, g, k), 1),
                 (p + "self_attn.v_proj.weight", ("blocks", "attn", "wv"), (i,), (n, d, g, k), 1),
                 (p + "self_attn.o_proj.weight", ("blocks", "attn", "wo"), (i,), (n, h, k, d), 2)]
        if not e:
            rows += [(p + f"mlp.{hf}_proj.weight", ("blocks", "mlp", ours), (i,), shape, 1)
                     for hf, ours, shape in (("gate", "w_gate", (n, d, f)),
                                             ("up", "w_up", (n, d, f)),
                                             ("down", "w_down", (n, f, d)))]
            continue
        rows.append((p + "block_sparse_moe.gate.weight", ("blocks", "mlp", "router"), (i,),
                     (n, d, e), 1))
        for x in range(e):
            q = f"{p}block_sparse_moe.experts.{x}."
            rows += [(q + "w1.weight", ("blocks", "mlp", "w_gate"), (i, x), (n, e, d, f), 1),
                     (q + "w3.weight", ("blocks", "mlp", "w_up"), (i, x), (n, e, d, f), 1),
                     (q + "w2.weight", ("blocks", "mlp", "w_down"), (i, x), (n, e, f, d), 1)]
    return rows


def _hf_shape(full_shape, index, input_dims) -> tuple[int, ...]:
    shape = full_shape[len(index):]
    if not input_dims:
        return tuple(shape)
    return (math.prod(shape[input_dims:]), math.prod(shape[:input_dims]))


# ---------------------------------------------------------------------------------------------
# jaxtron -> HF


def _check_exportable(config: Config) -> None:
    m, moe = config.model, config.moe
    if m.type != "llama":
        raise ConfigError(f"model.type={m.type} cannot be exported: only llama maps onto "
                          "LlamaForCausalLM / MixtralForCausalLM; export a llama model, or use "
                          "--format orbax.")
    if m.attention != "mha":
        raise ConfigError(f"model.attention={m.attention} cannot be exported: Llama / Mixtral "
                          "have multi-head attention; use --format orbax.")
    if moe.enabled:
        for ok, field, why in ((moe.every == 1, f"moe.every={moe.every}",
                                "Mixtral has an MoE block in every layer; use moe.every=1"),
                               (moe.shared_experts == 0, f"moe.shared_experts={moe.shared_experts}",
                                "Mixtral has no shared experts; use moe.shared_experts=0"),
                               (moe.router == "topk_then_softmax", f"moe.router={moe.router}",
                                "Mixtral renormalises the top-k weights; use "
                                "moe.router=topk_then_softmax"),
                               (moe.score == "softmax", f"moe.score={moe.score}",
                                "Mixtral's router is a softmax; use moe.score=softmax"),
                               (moe.route_groups == 1, f"moe.route_groups={moe.route_groups}",
                                "Mixtral routes over all experts; use moe.route_groups=1"),
                               (moe.route_scale == 1.0, f"moe.route_scale={moe.route_scale}",
                                "Mixtral's weights are unscaled; use moe.route_scale=1")):
            if not ok:
                raise ConfigError(f"{field} cannot be exported as {MIXTRAL}: {why}; change {field} "
                                  "or use --format orbax.")


def _dims(config: Config) -> dict:
    m, moe = config.model, config.moe
    f = (moe.expert_mlp_dim or m.mlp_dim) if moe.enabled else m.mlp_dim
    return {"N": m.num_layers, "D": m.d_model, "H": m.num_heads, "G": m.kv_heads,
            "K": m.resolved_head_dim, "F": f, "V": m.vocab_size, "E": moe.num_experts}


def to_hf(config: Config, params: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """A llama config and its parameters (`nnx.to_pure_dict` of the model layout) -> (HF
    config.json dict, {HF tensor name: numpy array}), arrays in the parameters' dtype."""
    _check_exportable(config)
    m, moe, dims = config.model, config.moe, _dims(config)
    arch = MIXTRAL if moe.enabled else LLAMA
    tensors = {}
    for name, path, index, full_shape, input_dims in _tensor_table(dims):
        node = params
        for key in path:
            if not isinstance(node, dict) or key not in node:
                raise DataError(f"the parameters lack {'/'.join(path)}, which {arch} needs; "
                                "pass nnx.to_pure_dict of the model layout "
                                "(trainer.to_model_params) of this config.")
            node = node[key]
        array = np.asarray(node)
        if array.shape != full_shape:
            raise DataError(f"parameter {'/'.join(path)} has shape {array.shape}; the config "
                            f"implies {full_shape}; export with the config the parameters were "
                            "trained with.")
        w = array[index]
        if input_dims:
            w = w.reshape(math.prod(w.shape[:input_dims]), -1).T
        tensors[name] = np.ascontiguousarray(w)
    hf = {"architectures": [arch], "model_type": MODEL_TYPES[arch],
          "hidden_size": m.d_model, "intermediate_size": dims["F"],
          "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
          "num_key_value_heads": m.kv_heads, "head_dim": m.resolved_head_dim,
          "vocab_size": m.vocab_size, "max_position_embeddings": m.max_seq_len,
          "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_scaling": None,
          "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
          "initializer_range": m.init_std,
          "torch_dtype": str(tensors["model.embed_tokens.weight"].dtype)}
    if moe.enabled:
        hf.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                  router_aux_loss_coef=moe.aux_loss_coef, sliding_window=None)
    else:
        hf.update(mlp_bias=False)
    return hf, tensors


# ---------------------------------------------------------------------------------------------
# HF -> jaxtron


def _read_config(hf: dict) -> tuple[str, dict]:
    """-> (architecture, dims); ConfigError for anything our llama does not compute."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else {v: k for k, v in MODEL_TYPES.items()}.get(hf.get("model_type"))
    if arch not in MODEL_TYPES:
        raise ConfigError(f"unsupported architecture {arch or archs!r} (model_type "
                          f"{hf.get('model_type')!r}) in config.json: jaxtron converts {LLAMA} "
                          f"and {MIXTRAL}; pick a model of one of those architectures.")
    required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size"] + (["num_local_experts", "num_experts_per_tok"]
                                 if arch == MIXTRAL else [])
    missing = [key for key in required if key not in hf]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}, which {arch} needs.")
    unsupported = [(hf.get("hidden_act", "silu") != "silu", f"hidden_act={hf.get('hidden_act')}",
                    "the MLP is SwiGLU (silu)"),
                   (bool(hf.get("attention_bias")), "attention_bias=true",
                    "llama attention has no biases"),
                   (bool(hf.get("mlp_bias")), "mlp_bias=true", "llama MLPs have no biases")]
    scaling = _rope_scaling(hf)
    if scaling is not None:
        unsupported.append((True, scaling, "only plain RoPE is implemented"))
    for bad, field, why in unsupported:
        if bad:
            raise ConfigError(f"config.json sets {field}, which jaxtron cannot convert: {why}; "
                              "convert a model without that setting.")
    h = hf["num_attention_heads"]
    g = hf.get("num_key_value_heads") or h
    if h % g:
        raise ConfigError(f"config.json: num_attention_heads={h} is not a multiple of "
                          f"num_key_value_heads={g}; the file is inconsistent: fix config.json.")
    dims = {"N": hf["num_hidden_layers"], "D": hf["hidden_size"], "H": h, "G": g,
            "K": hf.get("head_dim") or hf["hidden_size"] // h, "F": hf["intermediate_size"],
            "V": hf["vocab_size"], "E": hf["num_local_experts"] if arch == MIXTRAL else 0}
    return arch, dims


def _rope_parameters(hf: dict) -> dict:
    """RoPE settings in either layout transformers writes: top-level `rope_theta` and
    `rope_scaling` (up to 4.x), or one `rope_parameters` dict (5.x)."""
    params = hf.get("rope_parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ConfigError(f"config.json: rope_parameters={params!r} must be an object; fix "
                          "config.json.")
    # Per-attention-type layouts ({"full_attention": {...}}) hold one dict per kind.
    nested = [v for v in params.values() if isinstance(v, dict)]
    if nested:
        raise ConfigError("config.json sets rope_parameters per attention type, which jaxtron "
                          "cannot convert: only one plain RoPE is implemented; convert a model "
                          "without that setting.")
    return params


def _rope_scaling(hf: dict) -> str | None:
    """The config.json setting that asks for RoPE scaling, or None for plain RoPE."""
    old = hf.get("rope_scaling")
    if old is not None and (not isinstance(old, dict)
                            or old.get("rope_type", old.get("type")) not in (None, "default")):
        return f"rope_scaling={old}"
    kind = _rope_parameters(hf).get("rope_type", "default")
    if kind not in (None, "default"):
        return f"rope_parameters.rope_type={kind}"
    return None


def _rope_theta(hf: dict, default: float) -> float:
    theta = hf.get("rope_theta", _rope_parameters(hf).get("rope_theta", default))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"config.json: rope_theta={theta!r} must be a positive number; fix "
                          "config.json.")
    return float(theta)


def _check_names(arch: str, expected: set, state_dict: dict) -> None:
    missing = sorted(expected - state_dict.keys())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DataError(f"missing tensor {missing[0]}{more}, which {arch} with this config.json "
                        "needs.")
    unexpected = sorted(name for name in state_dict.keys() - expected
                        if not name.endswith(IGNORED_TENSORS))
    if unexpected:
        raise DataError(f"unexpected tensors {', '.join(unexpected[:3])}"
                        f"{' ...' if len(unexpected) > 3 else ''}: {arch} as jaxtron builds it "
                        "has no such parameters; check that config.json matches the weights "
                        "(model size, tied embeddings).")


def _overrides(arch: str, dims: dict, hf: dict, dtype: str) -> tuple[dict, dict]:
    defaults = DEFAULTS[arch]
    max_seq_len = hf.get("max_position_embeddings", defaults["max_position_embeddings"])
    # Sliding-window attention equals full causal attention on sequences no longer than the
    # window, so a windowed checkpoint converts with its sequence limit cut to the window.
    if hf.get("sliding_window") is not None:
        max_seq_len = min(max_seq_len, hf["sliding_window"])
    model = {"type": "llama", "num_layers": dims["N"], "d_model": dims["D"],
             "num_heads": dims["H"], "num_kv_heads": dims["G"],
             "head_dim": None if dims["K"] == dims["D"] // dims["H"] else dims["K"],
             "mlp_dim": dims["F"], "vocab_size": dims["V"], "max_seq_len": max_seq_len,
             "rope_theta": _rope_theta(hf, defaults["rope_theta"]),
             "norm_eps": float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
             "param_dtype": dtype}
    moe = {"num_experts": 0}
    if arch == MIXTRAL:
        moe = {"num_experts": dims["E"], "top_k": hf["num_experts_per_tok"], "every": 1,
               "shared_experts": 0, "router": "topk_then_softmax", "expert_mlp_dim": None,
               "mode": "dropless"}
    return model, moe


def from_hf(hf_config: dict, state_dict: dict) -> tuple[dict, dict, dict]:
    """HF config.json dict and tensors -> (model overrides, moe overrides, params pure dict).

    The overrides are `model.*` / `moe.*` config fields (e.g. `make_config(model=..., moe=...)`);
    the MoE runs dropless, as Mixtral does. Tied embeddings are untied by copying the table; a
    `sliding_window` shorter than max_position_embeddings becomes `model.max_seq_len`."""
    arch, dims = _read_config(hf_config)
    state_dict = dict(state_dict)
    if hf_config.get("tie_word_embeddings") and "lm_head.weight" not in state_dict:
        if "model.embed_tokens.weight" in state_dict:
            state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    table = _tensor_table(dims)
    _check_names(arch, {row[0] for row in table}, state_dict)
    arrays = {}
    for name, path, index, full_shape, input_dims in table:
        w = np.asarray(state_dict[name])
        want = _hf_shape(full_shape, index, input_dims)
        if w.shape != want:
            raise DataError(f"tensor {name} has shape {w.shape}; config.json implies {want}: "
                            "fix config.json or the weights so they agree.")
        if path not in arrays:
            arrays[path] = np.empty(full_shape, w.dtype)
        arrays[path][index] = w.T.reshape(full_shape[len(index):]) if input_dims else w
    dtype = str(arrays[("embedder", "embed")].dtype)
    if dtype not in COMPUTE_DTYPES:
        raise DataError(f"the safetensors file holds {dtype} tensors; jaxtron parameters are "
                        f"one of {', '.join(COMPUTE_DTYPES)}: convert the weights to one of "
                        "those first.")
    # Fine-tuning needs fp32 master weights whatever dtype the file was published in (bf16
    # for most): the cast is exact, and param_dtype float32 is what a training config uses.
    params = {}
    for path, array in arrays.items():
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = array.astype(np.float32)
    return (*_overrides(arch, dims, hf_config, "float32"), params)


# ---------------------------------------------------------------------------------------------
# Files


def save_hf_dir(out_dir, hf_config: dict, state_dict: dict, *,
                max_shard_bytes: int | None = None) -> None:
    """Write config.json and model.safetensors, or with `max_shard_bytes` the shards
    model-0000i-of-0000n.safetensors and their model.safetensors.index.json."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    tensors = {name: np.ascontiguousarray(a) for name, a in state_dict.items()}
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    if max_shard_bytes is None:
        save_file(tensors, str(out / SINGLE_FILE), metadata=metadata)
        return
    shards, size = [{}], 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def load_hf_dir(hf_dir) -> tuple[dict, dict[str, np.ndarray]]:
    """-> (config.json dict, {name: numpy array}) from one model.safetensors or shards listed in
    model.safetensors.index.json."""
    src = Path(hf_dir)
    if not (src / "config.json").is_file():
        raise DataError(f"{src} has no config.json: not a Hugging Face model directory; pass "
                        "--from-hf the folder that holds config.json and the safetensors.")
    hf_config = _read_json(src / "config.json")
    if not isinstance(hf_config, dict):
        raise DataError(f"{src / 'config.json'} must hold a JSON object; download the model "
                        "folder again.")
    if (src / SINGLE_FILE).is_file():
        return hf_config, _load_safetensors(src / SINGLE_FILE)
    if not (src / INDEX_FILE).is_file():
        found = ", ".join(sorted(os.listdir(src)))
        raise DataError(f"{src} has neither {SINGLE_FILE} nor {INDEX_FILE} (found: {found}); "
                        "only safetensors weights are read: save the model with "
                        "safe_serialization=True.")
    index = _read_json(src / INDEX_FILE)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise DataError(f"{src / INDEX_FILE} has no weight_map object; download the model "
                        "folder again.")
    tensors = {}
    for filename in sorted(set(weight_map.values())):
        if not (src / filename).is_file():
            raise DataError(f"{INDEX_FILE} lists {filename}, which is missing from {src}; "
                            "download the complete model folder.")
        tensors.update(_load_safetensors(src / filename))
    absent = sorted(set(weight_map) - tensors.keys())
    if absent:
        raise DataError(f"{INDEX_FILE} maps {absent[0]} to {weight_map[absent[0]]}, which does "
                        "not hold it; download the model folder again.")
    return hf_config, tensors


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not valid JSON ({type(err).__name__}: {str(err)[:120]}); "
                        "download the model folder again or fix the file.") from None


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for damaged files
        first = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise DataError(f"{path} could not be read ({first}): it is truncated or damaged; "
                        "download it again.") from None
