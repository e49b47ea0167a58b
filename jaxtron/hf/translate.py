"""Conversion between jaxtron llama parameters and Hugging Face checkpoints.

    hf_config, tensors = to_hf(config, nnx.to_pure_dict(trainer.to_model_params(state.params)))
    save_hf_dir("out/hf", hf_config, tensors)    # loads with AutoModelForCausalLM.from_pretrained
    model, moe, params = from_hf(*load_hf_dir("out/hf"))

Families, chosen on export from the config:
- `LlamaForCausalLM`: a dense llama (Llama 2, 3, 3.1 with `rope_scaling`, 3.2 with tied
  embeddings).
- `MistralForCausalLM`: a dense llama with `model.sliding_window` (Mistral 7B v0.1: 4096;
  later versions null, which imports as a llama and exports as `LlamaForCausalLM`).
- `Qwen3ForCausalLM`: a dense llama with `model.qk_norm`.
- `Qwen2ForCausalLM`: a dense llama with `model.qkv_bias` (q/k/v projection biases).
- `MixtralForCausalLM`: an MoE block in every layer (`moe.every=1`), no shared experts,
  `topk_then_softmax` routing.
- `Qwen3MoeForCausalLM`: as Mixtral plus `model.qk_norm` (Qwen3's per-head q_norm/k_norm);
  `norm_topk_prob` true is `topk_then_softmax`, false is `softmax_then_topk`. Only Qwen3's
  uniform layout converts (`decoder_sparse_step=1`, no `mlp_only_layers`).
- `DeepseekV3ForCausalLM`: `model.attention=mla`, the first `first_k_dense_replace` layers
  dense (`moe.first_dense_layers`, their own stack `dense_blocks`; every layer dense when it is
  >= num_hidden_layers), the rest MoE: sigmoid scores (`moe.score=sigmoid`), group-limited
  routing (`n_group`, `topk_group`), `routed_scaling_factor` as `moe.route_scale`,
  `n_shared_experts` as `moe.shared_experts` and `e_score_correction_bias` as the MoE's
  `router_bias`. Multi-token-prediction layers are dropped.

Sliding windows (`_sliding_window`): Mistral and Mixtral window every layer by `sliding_window`
(query i sees keys i - w < j <= i, as `model.sliding_window`); the Qwen families only with
`use_sliding_window`, and Qwen2 / Qwen3 then only in the layers at or after `max_window_layers`
(or those `layer_types` names `sliding_attention`). One window for every layer or none is what
jaxtron computes: a mix is refused. Export writes a windowed model as Mistral, Mixtral, or a
Qwen family with `use_sliding_window` and `max_window_layers: 0`; Llama and DeepSeek-V3 have no
window.

Layout. A torch `Linear` stores its weight [out, in] and computes x @ W.T; ours are [in, out]
with heads kept as their own axes (wq [D, H, K], wo [H, K, D]), and stacked over layers with a
leading N. So q_proj.weight = wq[i].reshape(D, H*K).T, o_proj.weight = wo[i].reshape(H*K, D).T.

RoPE needs no permutation of Llama's q/k rows: `jaxtron.models.layers.rotary` rotates the pairs
(i, i + K/2) with frequencies theta^(-2i/K), which is HF Llama's `rotate_half` convention with
`inv_freq = 1 / theta^(arange(0, K, 2) / K)`. (Meta's original checkpoints rotate interleaved
pairs (2i, 2i+1); HF's conversion script permutes them into this layout, so HF files need none.)
DeepSeek's checkpoints keep the interleaved rows: with `rope_interleave` (the default) HF
reorders q_rot and k_rot as x.view(d/2, 2).transpose -> [x0, x2, ..., x1, x3, ...] before
`rotate_half`, and never back. Attention scores only need q and k in the same order, so our
rotary rows are HF's rows in that order (`hf_tensors.rope_order`), in q_proj / q_b_proj per head and in
kv_a_proj_with_mqa's last Kr rows. kv_b_proj holds W_uk and W_uv per head ([H, Kn + V, C]).
Mixtral's router (softmax over all experts, top-k, renormalise the k weights) equals a softmax
over the top-k logits, which is our `topk_then_softmax`.
"""

from __future__ import annotations

import math

import numpy as np

from jaxtron.config.schema import COMPUTE_DTYPES, Config
from jaxtron.errors import ConfigError, DataError
from jaxtron.hf.arch import (
    DEEPSEEK_V3,
    DEFAULTS,
    LLAMA,
    MISTRAL,
    MIXTRAL,
    MODEL_TYPES,
    QWEN2,
    QWEN3,
    QWEN3_MOE,
)
from jaxtron.hf.rope import rope_from_hf, rope_theta, rope_to_hf
from jaxtron.hf.tensors import FLAT, deepseek_rows, hf_shape, tensor_table

IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # a buffer older checkpoints saved; recomputed
# DeepSeek-V3's e_score_correction_bias imports as a router_bias, which exists with
# moe.bias_update_rate > 0: the rate DeepSeek-V3 trained with (gamma, arXiv:2412.19437 sec. 4.2).
DEEPSEEK_BIAS_RATE = 1e-3


# ---------------------------------------------------------------------------------------------
# jaxtron -> HF


def _refuse(arch: str, checks) -> None:
    for ok, field, why in checks:
        if not ok:
            raise ConfigError(f"{field} cannot be exported as {arch}: {why}; change {field} or "
                              "use --format orbax.")


def _export_arch(config: Config) -> str:
    """The HF architecture this config maps onto, or ConfigError naming what does not."""
    m, moe = config.model, config.moe
    if m.type != "llama":
        raise ConfigError(f"model.type={m.type} cannot be exported: only llama maps onto "
                          "Hugging Face's Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE / "
                          "DeepSeek-V3; export a llama model, or use --format orbax.")
    if m.attention == "mla":
        arch = DEEPSEEK_V3
    elif moe.enabled:
        arch = QWEN3_MOE if m.qk_norm else MIXTRAL
    else:
        arch = (QWEN3 if m.qk_norm else QWEN2 if m.qkv_bias else
                MISTRAL if m.sliding_window is not None else LLAMA)
    _refuse(arch, [(not (m.qk_norm and m.qkv_bias), "model.qkv_bias=true",
                    "Qwen3 (QK-norm) has no q/k/v biases; use model.qkv_bias=false"),
                   (arch != DEEPSEEK_V3 or m.sliding_window is None,
                    f"model.sliding_window={m.sliding_window}",
                    "DeepSeek-V3 attends to every earlier token; use model.sliding_window=null")])
    if not moe.enabled:
        return arch
    common = [(moe.every == 1, f"moe.every={moe.every}",
               "every layer must be an MoE layer; use moe.every=1")]
    if arch == DEEPSEEK_V3:
        _refuse(arch, common + [
            (moe.score == "sigmoid", f"moe.score={moe.score}",
             "DeepSeek-V3 scores experts with a sigmoid; use moe.score=sigmoid"),
            (moe.num_experts // moe.route_groups >= 2, f"moe.route_groups={moe.route_groups}",
             "HF scores a group by its two best experts, so groups need 2 experts or more")])
        return arch
    _refuse(arch, common + [
        (moe.first_dense_layers == 0, f"moe.first_dense_layers={moe.first_dense_layers}",
         "every layer is an MoE layer; use moe.first_dense_layers=0"),
        (moe.shared_experts == 0, f"moe.shared_experts={moe.shared_experts}",
         "it has no shared experts; use moe.shared_experts=0"),
        (arch == QWEN3_MOE or moe.router == "topk_then_softmax", f"moe.router={moe.router}",
         "Mixtral renormalises the top-k weights; use moe.router=topk_then_softmax"),
        (moe.score == "softmax", f"moe.score={moe.score}",
         "its router is a softmax; use moe.score=softmax"),
        (moe.route_groups == 1, f"moe.route_groups={moe.route_groups}",
         "it routes over all experts; use moe.route_groups=1"),
        (moe.route_scale == 1.0, f"moe.route_scale={moe.route_scale}",
         "its weights are unscaled; use moe.route_scale=1"),
        (moe.bias_update_rate == 0, f"moe.bias_update_rate={moe.bias_update_rate}",
         "its router has no routing bias; use moe.bias_update_rate=0")])
    return arch


def _dims(config: Config, arch: str) -> dict:
    m, moe = config.model, config.moe
    f = (moe.expert_mlp_dim or m.mlp_dim) if moe.enabled else m.mlp_dim
    dims = {"N": m.num_layers, "D": m.d_model, "H": m.num_heads, "G": m.kv_heads,
            "K": m.resolved_head_dim, "F": f, "V": m.vocab_size, "E": moe.num_experts,
            "arch": arch, "qk_norm": m.qk_norm,
            "shared": moe.shared_experts * f if moe.enabled else 0,
            "bias": moe.enabled and moe.bias_update_rate > 0,
            "first_dense": moe.dense_prefix, "dense_F": m.mlp_dim,
            "tied": m.tied_embeddings, "qkv_bias": m.qkv_bias}
    if m.attention == "mla":
        dims["mla"] = {"Q": m.q_lora_rank or 0, "C": m.kv_lora_rank, "Kn": m.qk_nope_head_dim,
                       "Kr": m.qk_rope_head_dim, "Vh": m.v_head_dim, "interleave": True}
    return dims


def to_hf(config: Config, params: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """A llama config and its parameters (`nnx.to_pure_dict` of the model layout) -> (HF
    config.json dict, {HF tensor name: numpy array}), arrays in the parameters' dtype."""
    arch = _export_arch(config)
    m, moe, dims = config.model, config.moe, _dims(config, arch)
    tensors = {}
    for name, path, index, full_shape, input_dims in tensor_table(dims):
        node = params
        for key in path:
            if not isinstance(node, dict) or key not in node:
                raise DataError(f"the parameters lack {'/'.join(path)}, which {arch} needs; "
                                "pass the model layout of this config's parameters "
                                "(nnx.to_pure_dict of trainer.to_model_params) instead.")
            node = node[key]
        array = np.asarray(node)
        if array.shape != full_shape:
            raise DataError(f"parameter {'/'.join(path)} has shape {array.shape}; the config "
                            f"implies {full_shape}; export with the same config the parameters "
                            "were trained with.")
        w = array[index]
        if input_dims == FLAT:
            w = w.reshape(-1)
        elif input_dims:
            w = w.reshape(math.prod(w.shape[:input_dims]), -1).T
        tensors[name] = np.ascontiguousarray(w)
    dtype = str(tensors["model.embed_tokens.weight"].dtype)
    hf = {"architectures": [arch], "model_type": MODEL_TYPES[arch],
          "hidden_size": m.d_model, "intermediate_size": dims["F"] if arch != DEEPSEEK_V3
          else m.mlp_dim,
          "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
          "num_key_value_heads": m.kv_heads, "head_dim": m.resolved_head_dim,
          "vocab_size": m.vocab_size, "max_position_embeddings": m.max_seq_len,
          "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_scaling": rope_to_hf(m),
          "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": m.tied_embeddings,
          "initializer_range": m.init_std, "torch_dtype": dtype}
    window = m.sliding_window
    # Qwen: windowed layers are those from max_window_layers on, so 0 windows every layer.
    qwen_window = dict(use_sliding_window=window is not None, sliding_window=window)
    if window is not None:
        qwen_window["max_window_layers"] = 0
    if arch == MISTRAL:
        hf.update(sliding_window=window)
    elif arch == MIXTRAL:
        hf.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                  router_aux_loss_coef=moe.aux_loss_coef, sliding_window=window)
    elif arch in (QWEN3, QWEN2):
        hf.update(qwen_window)
    elif arch == QWEN3_MOE:
        hf.update(intermediate_size=m.mlp_dim, moe_intermediate_size=dims["F"],
                  num_experts=moe.num_experts, num_local_experts=moe.num_experts,
                  num_experts_per_tok=moe.top_k,
                  norm_topk_prob=moe.router == "topk_then_softmax", decoder_sparse_step=1,
                  mlp_only_layers=[], router_aux_loss_coef=moe.aux_loss_coef, **qwen_window)
    elif arch == DEEPSEEK_V3:
        mla = dims["mla"]
        del hf["head_dim"]  # transformers derives it (qk_rope_head_dim)
        hf.update(num_key_value_heads=m.num_heads, q_lora_rank=mla["Q"] or None,
                  kv_lora_rank=mla["C"], qk_nope_head_dim=mla["Kn"],
                  qk_rope_head_dim=mla["Kr"], v_head_dim=mla["Vh"], rope_interleave=True,
                  first_k_dense_replace=dims["first_dense"] if moe.enabled else m.num_layers,
                  moe_layer_freq=1, num_nextn_predict_layers=0)
        if moe.enabled:
            hf.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                      moe_intermediate_size=dims["F"], n_shared_experts=moe.shared_experts,
                      n_group=moe.route_groups, topk_group=moe.route_top_groups,
                      routed_scaling_factor=moe.route_scale, norm_topk_prob=moe.top_k > 1,
                      scoring_func="sigmoid", topk_method="noaux_tc")
            if not dims["bias"]:  # HF always has the buffer: zero is no bias
                for i in range(dims["first_dense"], m.num_layers):
                    tensors[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = np.zeros(
                        moe.num_experts, np.float32)
        tensors = deepseek_rows(tensors, dims, to_ours=False)
    else:
        hf.update(mlp_bias=False)
    return hf, tensors


# ---------------------------------------------------------------------------------------------
# HF -> jaxtron


def _arch(hf: dict) -> str:
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else {v: k for k, v in MODEL_TYPES.items()}.get(hf.get("model_type"))
    if arch not in MODEL_TYPES:
        raise ConfigError(f"unsupported architecture {arch or archs!r} (model_type "
                          f"{hf.get('model_type')!r}) in config.json: jaxtron converts "
                          f"{', '.join(MODEL_TYPES)}; pick a model of one of those "
                          "architectures.")
    return arch


REQUIRED = {LLAMA: ["intermediate_size"], QWEN3: ["intermediate_size"],
            QWEN2: ["intermediate_size"],
            MISTRAL: ["intermediate_size"], MIXTRAL: ["intermediate_size", "num_local_experts",
                                                    "num_experts_per_tok"],
            QWEN3_MOE: ["moe_intermediate_size", "num_experts", "num_experts_per_tok"],
            DEEPSEEK_V3: ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]}


def _sliding_window(arch: str, hf: dict) -> int | None:
    """The window every layer of the HF model uses (None: full causal attention), or
    ConfigError where some layers are windowed and others not (see the module doc)."""
    if arch in (QWEN2, QWEN3, QWEN3_MOE):
        if not hf.get("use_sliding_window", False):
            return None
    elif arch not in (MISTRAL, MIXTRAL):
        return None  # transformers' Llama and DeepSeek-V3 ignore a sliding_window key
    window = hf.get("sliding_window", DEFAULTS[arch]["sliding_window"])
    if window is None or arch in (MISTRAL, MIXTRAL, QWEN3_MOE):  # every layer alike
        return window
    n, first = hf["num_hidden_layers"], hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                      for i in range(n)]
    windowed = sum(kind == "sliding_attention" for kind in types)
    if windowed == 0:
        return None
    if windowed < len(types):
        where = ("layer_types" if hf.get("layer_types") else f"max_window_layers={first}")
        raise ConfigError(f"config.json windows {windowed} of {len(types)} layers "
                          f"(use_sliding_window with {where}), which jaxtron cannot convert: "
                          "model.sliding_window applies to every layer; convert a model that "
                          "windows all layers or none.")
    return window


# Fields transformers 5 renamed: (architecture, name before, name since). Both are read.
RENAMED = ((QWEN3_MOE, "num_experts", "num_local_experts"),)


def _older_names(arch: str, hf: dict) -> dict:
    """`hf` with each renamed field also under its earlier name, which the code below reads."""
    hf = dict(hf)
    for where, before, since in RENAMED:
        if where == arch and before not in hf and since in hf:
            hf[before] = hf[since]
    return hf


def _read_config(hf: dict) -> tuple[str, dict]:
    """-> (architecture, dims); ConfigError for anything our llama does not compute."""
    arch = _arch(hf)
    hf = _older_names(arch, hf)
    _check_required(arch, hf)
    rope_from_hf(hf)  # refuses a scaling it cannot map before anything is read
    for bad, field, why in _settings_refused(arch, hf):
        if bad:
            raise ConfigError(f"config.json sets {field}, which jaxtron cannot convert: {why}; "
                              "convert a model without that setting.")
    return arch, _dims_from_hf(arch, hf)


def _setting(arch: str, hf: dict, key: str):
    """A config.json field, or the architecture's default where the file leaves it out."""
    return hf.get(key, DEFAULTS[arch].get(key))


def _check_required(arch: str, hf: dict) -> None:
    required = ["hidden_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size"] + REQUIRED[arch]
    missing = [key for key in required if key not in hf]
    if missing:
        since = {before: f"{before} (or {after})" for where, before, after in RENAMED
                 if where == arch}
        raise ConfigError(f"config.json lacks {', '.join(since.get(k, k) for k in missing)}, "
                          f"which {arch} needs; use the config.json saved with the weights, or "
                          "add the field from the model's published config.")


def _settings_refused(arch: str, hf: dict) -> list[tuple[bool, str, str]]:
    """(refused?, the field as set, why) for each setting the conversion cannot compute."""
    get = lambda key: _setting(arch, hf, key)  # noqa: E731
    quantized = hf.get("quantization_config")
    refused = [(hf.get("hidden_act", "silu") != "silu", f"hidden_act={hf.get('hidden_act')}",
                "the MLP is SwiGLU (silu)"),
               (bool(hf.get("attention_bias")), "attention_bias=true",
                "llama attention has no biases"),
               (bool(hf.get("mlp_bias")), "mlp_bias=true", "llama MLPs have no biases"),
               (quantized is not None,
                f"quantization_config (quant_method="
                f"{quantized.get('quant_method') if isinstance(quantized, dict) else quantized})",
                "weights are read in bf16/fp16/fp32; dequantize the checkpoint first")]
    if arch == QWEN3_MOE:
        step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
        refused += [(step != 1, f"decoder_sparse_step={step}",
                     "only every layer an MoE layer converts (decoder_sparse_step=1)"),
                    (bool(only), f"mlp_only_layers={only}",
                     "only every layer an MoE layer converts (mlp_only_layers=[])")]
    if arch == DEEPSEEK_V3:
        n, first = hf["num_hidden_layers"], get("first_k_dense_replace")
        k, norm = hf.get("num_experts_per_tok", 8), get("norm_topk_prob")
        refused += [
            (hf.get("moe_layer_freq", 1) != 1, f"moe_layer_freq={hf.get('moe_layer_freq')}",
             "only every layer an MoE layer converts"),
            (hf.get("scoring_func", "sigmoid") != "sigmoid",
             f"scoring_func={hf.get('scoring_func')}", "DeepSeek-V3 routing is sigmoid"),
            (hf.get("topk_method", "noaux_tc") != "noaux_tc",
             f"topk_method={hf.get('topk_method')}", "DeepSeek-V3 routing is noaux_tc"),
            (first < n and norm != (k > 1), f"norm_topk_prob={norm}",
             "jaxtron normalises the chosen sigmoid scores exactly when num_experts_per_tok > 1"),
            (get("rms_norm_eps") != 1e-6, f"rms_norm_eps={hf.get('rms_norm_eps')}",
             "HF's latent norms keep eps 1e-6 while jaxtron uses one epsilon for all norms")]
    return refused


def _dims_from_hf(arch: str, hf: dict) -> dict:
    """The model's sizes and features from config.json, by the names `to_config` reads."""
    h = hf["num_attention_heads"]
    g = hf.get("num_key_value_heads") or h
    if arch == DEEPSEEK_V3:
        g = h  # MLA: every head decompresses its own keys and values
    if h % g:
        raise ConfigError(f"config.json: num_attention_heads={h} is not a multiple of "
                          f"num_key_value_heads={g}; the file is inconsistent: fix config.json.")
    dims = {"N": hf["num_hidden_layers"], "D": hf["hidden_size"], "H": h, "G": g,
            "K": hf.get("head_dim") or hf["hidden_size"] // h,
            "F": hf.get("intermediate_size", 0), "V": hf["vocab_size"], "E": 0, "arch": arch,
            "dense_F": hf.get("intermediate_size", 0),
            "tied": bool(hf.get("tie_word_embeddings", False)),
            "window": _sliding_window(arch, hf)}
    if arch == MIXTRAL:
        dims["E"] = hf["num_local_experts"]
    elif arch == QWEN3_MOE:
        dims.update(E=hf["num_experts"], F=hf["moe_intermediate_size"], qk_norm=True)
    elif arch == QWEN3:
        dims["qk_norm"] = True
    elif arch == QWEN2:
        dims["qkv_bias"] = True
    elif arch == DEEPSEEK_V3:
        dims.update(_deepseek_dims_from_hf(arch, hf, dims["N"]), K=hf["hidden_size"] // h)
    return dims


def _deepseek_dims_from_hf(arch: str, hf: dict, layers: int) -> dict:
    """DeepSeek-V3's latent attention sizes, and its experts after the dense layers."""
    get = lambda key: _setting(arch, hf, key)  # noqa: E731
    dims = {"mla": {"Q": get("q_lora_rank") or 0, "C": hf["kv_lora_rank"],
                    "Kn": hf["qk_nope_head_dim"], "Kr": hf["qk_rope_head_dim"],
                    "Vh": hf["v_head_dim"], "interleave": bool(get("rope_interleave"))}}
    if get("first_k_dense_replace") < layers:  # MoE layers after the dense ones
        dims["first_dense"] = get("first_k_dense_replace")
        missing = [key for key in ("n_routed_experts", "moe_intermediate_size") if key not in hf]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}, which {arch} "
                              "needs; use the config.json saved with the weights, or add "
                              "the field from the model's published config.")
        f = hf["moe_intermediate_size"]
        dims.update(E=hf["n_routed_experts"], F=f, shared=get("n_shared_experts") * f)
    elif "intermediate_size" not in hf:
        raise ConfigError(f"config.json lacks intermediate_size, which {arch} needs; use "
                          "the config.json saved with the weights, or add the field from "
                          "the model's published config.")
    return dims


def _check_names(arch: str, expected: set, state_dict: dict) -> None:
    missing = sorted(expected - state_dict.keys())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DataError(f"missing tensor {missing[0]}{more}, which {arch} with this config.json "
                        "needs; give the folder every safetensors shard the index lists, or "
                        "use the config.json saved with these weights.")
    unexpected = sorted(name for name in state_dict.keys() - expected
                        if not name.endswith(IGNORED_TENSORS))
    if unexpected:
        raise DataError(f"unexpected tensors {', '.join(unexpected[:3])}"
                        f"{' ...' if len(unexpected) > 3 else ''}: {arch} as jaxtron builds it "
                        "has no such parameters; use the config.json saved with these "
                        "weights (model size, tied embeddings).")


def _overrides(arch: str, dims: dict, hf: dict, dtype: str) -> tuple[dict, dict]:
    defaults = DEFAULTS[arch]
    get = lambda key: hf.get(key, defaults.get(key))  # noqa: E731
    max_seq_len = get("max_position_embeddings")
    model = {"type": "llama", "num_layers": dims["N"], "d_model": dims["D"],
             "num_heads": dims["H"], "num_kv_heads": dims["G"],
             "head_dim": None if dims["K"] == dims["D"] // dims["H"] else dims["K"],
             "mlp_dim": dims["dense_F"] or dims["F"], "vocab_size": dims["V"],
             "max_seq_len": max_seq_len, "rope_theta": rope_theta(hf, defaults["rope_theta"]),
             "norm_eps": float(get("rms_norm_eps")), "param_dtype": dtype,
             "qk_norm": bool(dims.get("qk_norm")), **rope_from_hf(hf),
             **({"tie_embeddings": True} if dims.get("tied") else {}),
             **({"sliding_window": dims["window"]} if dims.get("window") is not None else {}),
             **({"qkv_bias": True} if dims.get("qkv_bias") else {})}
    if "mla" in dims:
        mla = dims["mla"]
        model.update(attention="mla", num_kv_heads=None, head_dim=None,
                     q_lora_rank=mla["Q"] or None, kv_lora_rank=mla["C"],
                     qk_nope_head_dim=mla["Kn"], qk_rope_head_dim=mla["Kr"],
                     v_head_dim=mla["Vh"])
    if not dims["E"]:
        return model, {"num_experts": 0}
    moe = {"num_experts": dims["E"], "top_k": hf["num_experts_per_tok"], "every": 1,
           "shared_experts": 0, "router": "topk_then_softmax", "expert_mlp_dim": None,
           "mode": "dropless"}
    if "router_aux_loss_coef" in hf:  # Mixtral's and Qwen3-MoE's Switch balance loss weight
        moe["aux_loss_coef"] = float(hf["router_aux_loss_coef"])
    if arch == QWEN3_MOE:
        moe.update(expert_mlp_dim=dims["F"], router="topk_then_softmax" if get("norm_topk_prob")
                   else "softmax_then_topk")
    elif arch == DEEPSEEK_V3:
        moe.update(expert_mlp_dim=dims["F"], shared_experts=get("n_shared_experts"),
                   score="sigmoid", route_groups=get("n_group"),
                   route_top_groups=get("topk_group"),
                   route_scale=float(get("routed_scaling_factor")),
                   bias_update_rate=DEEPSEEK_BIAS_RATE if dims.get("bias") else 0.0,
                   first_dense_layers=dims.get("first_dense", 0))
    return model, moe


def _drop_deepseek_extras(hf_config: dict, dims: dict, state_dict: dict) -> dict:
    """Multi-token-prediction layers (index >= num_hidden_layers) dropped with a note; an
    all-zero e_score_correction_bias (no bias) dropped, any other kept as the router bias."""
    n, kept, dropped = dims["N"], {}, set()
    for name, array in state_dict.items():
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= n:
            dropped.add(int(parts[2]))
            continue
        kept[name] = array
    if dropped:
        print(f"note: ignoring multi-token-prediction layers {sorted(dropped)} (index >= "
              f"num_hidden_layers={n}): jaxtron trains next-token prediction only.", flush=True)
    biases = [name for name in kept if name.endswith(".mlp.gate.e_score_correction_bias")]
    dims["bias"] = any(np.any(np.asarray(kept[name]) != 0) for name in biases)
    if not dims["bias"]:
        for name in biases:
            del kept[name]
    return kept


def from_hf(hf_config: dict, state_dict: dict) -> tuple[dict, dict, dict]:
    """HF config.json dict and tensors -> (model overrides, moe overrides, params pure dict).

    The overrides are `model.*` / `moe.*` config fields (e.g. `make_config(model=..., moe=...)`);
    the MoE runs dropless, as the HF models do. Tied embeddings stay tied (`model.tie_embeddings`); a
    `sliding_window` that HF applies to every layer becomes `model.sliding_window`. A nonzero
    DeepSeek `e_score_correction_bias` becomes the router bias, with moe.bias_update_rate=1e-3."""
    arch, dims = _read_config(hf_config)
    state_dict = dict(state_dict)
    if dims.get("tied"):  # transformers ties the head to the table whatever the file holds
        state_dict.pop("lm_head.weight", None)
    if arch == DEEPSEEK_V3:
        state_dict = deepseek_rows(_drop_deepseek_extras(hf_config, dims, state_dict), dims,
                                    to_ours=True)
    table = tensor_table(dims)
    _check_names(arch, {row[0] for row in table}, state_dict)
    arrays = {}
    for name, path, index, full_shape, input_dims in table:
        w = np.asarray(state_dict[name])
        want = hf_shape(full_shape, index, input_dims)
        if w.shape != want:
            raise DataError(f"tensor {name} has shape {w.shape}; config.json implies {want}: "
                            "fix config.json or the weights so they agree.")
        if path not in arrays:
            arrays[path] = np.empty(full_shape, w.dtype)
        if input_dims == FLAT:
            w = w.reshape(full_shape[len(index):])
        elif input_dims:
            w = w.T.reshape(full_shape[len(index):])
        arrays[path][index] = w
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
