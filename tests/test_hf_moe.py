"""Hugging Face conversion of Qwen3-MoE and DeepSeek-V3: random small models written by the test
in HF's safetensors layout, imported, and their logits compared with an independent numpy
forward pass written from the published modeling code (transformers' modeling_qwen3_moe.py and
modeling_deepseek_v3.py: interleaved rotary rows, group-limited sigmoid routing with the score
correction bias, shared experts); exporting the import gives the same tensors back."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from test_hf import rms_norm, rotate_half, silu, softmax

from jaxtron.errors import ConfigError
from jaxtron.hf.files import load_hf_dir, save_hf_dir
from jaxtron.hf.translate import from_hf, to_hf
from jaxtron.training.trainer import Trainer

from conftest import make_config
from hf_rope_reference import hf_rope_tables

QWEN3 = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
         "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-6, "rope_theta": 1e6, "num_experts": 8, "num_experts_per_tok": 2,
         "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "use_sliding_window": False, "sliding_window": 64, "tie_word_embeddings": False,
         "hidden_act": "silu", "attention_bias": False, "router_aux_loss_coef": 0.001}
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "rope_scaling": None, "q_lora_rank": 24, "kv_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "first_k_dense_replace": 0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False}


def random_hf_tensors(cfg, seed=0, mtp=False):
    """Random tensors under HF's names and [out, in] shapes for `cfg`, norm weights near 1."""
    rng = np.random.default_rng(seed)
    d, n, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    h = cfg["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
              "lm_head.weight": (v, d)}
    for i in range(n + (1 if mtp else 0)):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
        if cfg["model_type"] == "qwen3_moe":
            k, g, e, f = (cfg["head_dim"], cfg["num_key_value_heads"], cfg["num_experts"],
                          cfg["moe_intermediate_size"])
            shapes.update({p + "self_attn.q_proj.weight": (h * k, d),
                           p + "self_attn.k_proj.weight": (g * k, d),
                           p + "self_attn.v_proj.weight": (g * k, d),
                           p + "self_attn.o_proj.weight": (d, h * k),
                           p + "self_attn.q_norm.weight": (k,), p + "self_attn.k_norm.weight": (k,),
                           p + "mlp.gate.weight": (e, d)})
        else:
            q, c = cfg["q_lora_rank"], cfg["kv_lora_rank"]
            kn, kr, vh = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            s = p + "self_attn."
            if q:
                shapes.update({s + "q_a_proj.weight": (q, d), s + "q_a_layernorm.weight": (q,),
                               s + "q_b_proj.weight": (h * (kn + kr), q)})
            else:
                shapes[s + "q_proj.weight"] = (h * (kn + kr), d)
            shapes.update({s + "kv_a_proj_with_mqa.weight": (c + kr, d),
                           s + "kv_a_layernorm.weight": (c,),
                           s + "kv_b_proj.weight": (h * (kn + vh), c),
                           s + "o_proj.weight": (d, h * vh)})
            e, f = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            if i < cfg["first_k_dense_replace"]:
                f_dense = cfg["intermediate_size"]
                shapes.update({p + "mlp.gate_proj.weight": (f_dense, d),
                               p + "mlp.up_proj.weight": (f_dense, d),
                               p + "mlp.down_proj.weight": (d, f_dense)})
                continue
            sf = f * cfg["n_shared_experts"]
            shapes.update({p + "mlp.gate.weight": (e, d),
                           p + "mlp.gate.e_score_correction_bias": (e,),
                           p + "mlp.shared_experts.gate_proj.weight": (sf, d),
                           p + "mlp.shared_experts.up_proj.weight": (sf, d),
                           p + "mlp.shared_experts.down_proj.weight": (d, sf)})
        for x in range(e):
            shapes.update({f"{p}mlp.experts.{x}.gate_proj.weight": (f, d),
                           f"{p}mlp.experts.{x}.up_proj.weight": (f, d),
                           f"{p}mlp.experts.{x}.down_proj.weight": (d, f)})
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = rng.uniform(-0.05, 0.05, shape).astype(np.float32)
        elif len(shape) == 1:
            tensors[name] = rng.normal(1.0, 0.1, shape).astype(np.float32)
        else:
            std = 0.5 if name.endswith("mlp.gate.weight") else 0.2
            tensors[name] = rng.normal(0.0, std, shape).astype(np.float32)
    return tensors


# --- independent forward passes, numpy float64 ------------------------------------------------

def rope_tables(t, dim, theta):
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    emb = np.concatenate([np.outer(np.arange(t), inv_freq)] * 2, axis=-1)
    return np.cos(emb), np.sin(emb)


def attend(q, k, v, scale):
    """q, k [H, T, Kq], v [H, T, V] -> [T, H*V], causal."""
    t = q.shape[1]
    scores = np.where(np.tril(np.ones((t, t), bool)), q @ k.transpose(0, 2, 1) * scale, -np.inf)
    return (softmax(scores) @ v).transpose(1, 0, 2).reshape(t, -1)


def swiglu_mlp(x, sd, prefix):
    return (silu(x @ sd[prefix + "gate_proj.weight"].T) * (x @ sd[prefix + "up_proj.weight"].T)
            ) @ sd[prefix + "down_proj.weight"].T


def qwen3_moe_forward(cfg, sd, ids):
    """Qwen3MoeForCausalLM: q_norm/k_norm per head before RoPE, softmax router, top-k,
    renormalised when norm_topk_prob."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    t, h, g, k = len(ids), cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    cos, sin = rope_tables(t, k, cfg["rope_theta"])
    x = sd["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms_norm(x, sd[p + "input_layernorm.weight"], eps)
        q = rms_norm((a @ sd[p + "self_attn.q_proj.weight"].T).reshape(t, h, k),
                     sd[p + "self_attn.q_norm.weight"], eps).transpose(1, 0, 2)
        kk = rms_norm((a @ sd[p + "self_attn.k_proj.weight"].T).reshape(t, g, k),
                      sd[p + "self_attn.k_norm.weight"], eps).transpose(1, 0, 2)
        v = (a @ sd[p + "self_attn.v_proj.weight"].T).reshape(t, g, k).transpose(1, 0, 2)
        q, kk = q * cos + rotate_half(q) * sin, kk * cos + rotate_half(kk) * sin
        out = attend(q, np.repeat(kk, h // g, 0), np.repeat(v, h // g, 0), k ** -0.5)
        x = x + out @ sd[p + "self_attn.o_proj.weight"].T
        a = rms_norm(x, sd[p + "post_attention_layernorm.weight"], eps)
        probs = softmax(a @ sd[p + "mlp.gate.weight"].T)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :cfg["num_experts_per_tok"]]
        weights = np.take_along_axis(probs, top, -1)
        if cfg["norm_topk_prob"]:
            weights /= weights.sum(-1, keepdims=True)
        y = np.zeros_like(a)
        for row in range(t):
            for e, w in zip(top[row], weights[row]):
                y[row] += w * swiglu_mlp(a[row], sd, f"{p}mlp.experts.{e}.")
        x = x + y
    return rms_norm(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T


def deepseek_gate(cfg, logits, bias):
    """DeepseekV3MoE.route_tokens_to_experts for one token's router logits [E]."""
    e, groups = cfg["n_routed_experts"], cfg["n_group"]
    scores = 1.0 / (1.0 + np.exp(-logits))
    for_choice = scores + bias
    group_scores = np.sort(for_choice.reshape(groups, -1), axis=-1)[:, -2:].sum(-1)
    keep = np.zeros(groups, bool)
    keep[np.argsort(-group_scores, kind="stable")[:cfg["topk_group"]]] = True
    masked = np.where(np.repeat(keep, e // groups), for_choice, 0.0)  # masked_fill(~mask, 0)
    top = np.argsort(-masked, kind="stable")[:cfg["num_experts_per_tok"]]
    weights = scores[top]
    if cfg["norm_topk_prob"]:
        weights = weights / (weights.sum() + 1e-20)
    return top, weights * cfg["routed_scaling_factor"]


def deepseek_v3_forward(cfg, sd, ids):
    """DeepseekV3ForCausalLM: MLA with the rotary rows reordered x.view(d/2, 2).transpose
    (rope_interleave), scaling 1/sqrt(Kn + Kr); dense layers below first_k_dense_replace, then
    routed experts plus shared experts."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    t, h, eps = len(ids), cfg["num_attention_heads"], cfg["rms_norm_eps"]
    kn, kr, vh, c = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"],
                     cfg["kv_lora_rank"])
    cos, sin = hf_rope_tables(cfg, t, kr)
    scale = (kn + kr) ** -0.5
    yarn = cfg.get("rope_scaling") or {}
    if yarn.get("mscale_all_dim"):  # DeepseekV3Attention: softmax scale x mscale^2
        scale *= (0.1 * yarn["mscale_all_dim"] * np.log(yarn["factor"]) + 1.0) ** 2

    def rope(x):  # [..., T, Kr]
        if cfg.get("rope_interleave", True):
            x = x.reshape(*x.shape[:-1], kr // 2, 2).swapaxes(-1, -2).reshape(x.shape)
        return x * cos + rotate_half(x) * sin

    x = sd["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        s = p + "self_attn."
        a = rms_norm(x, sd[p + "input_layernorm.weight"], eps)
        if cfg["q_lora_rank"]:
            cq = rms_norm(a @ sd[s + "q_a_proj.weight"].T, sd[s + "q_a_layernorm.weight"], 1e-6)
            q = cq @ sd[s + "q_b_proj.weight"].T
        else:
            q = a @ sd[s + "q_proj.weight"].T
        q = q.reshape(t, h, kn + kr).transpose(1, 0, 2)
        q_pass, q_rot = q[..., :kn], q[..., kn:]
        ckv = a @ sd[s + "kv_a_proj_with_mqa.weight"].T
        k_pass, k_rot = ckv[:, :c], ckv[:, c:]
        kv = (rms_norm(k_pass, sd[s + "kv_a_layernorm.weight"], 1e-6)
              @ sd[s + "kv_b_proj.weight"].T).reshape(t, h, kn + vh).transpose(1, 0, 2)
        k_pass, v = kv[..., :kn], kv[..., kn:]
        q_rot, k_rot = rope(q_rot), rope(k_rot[None])
        query = np.concatenate([q_pass, q_rot], -1)
        key = np.concatenate([k_pass, np.broadcast_to(k_rot, (h, t, kr))], -1)
        x = x + attend(query, key, v, scale) @ sd[s + "o_proj.weight"].T
        a = rms_norm(x, sd[p + "post_attention_layernorm.weight"], eps)
        if i < cfg["first_k_dense_replace"]:
            x = x + swiglu_mlp(a, sd, p + "mlp.")
            continue
        logits = a @ sd[p + "mlp.gate.weight"].T
        y = swiglu_mlp(a, sd, p + "mlp.shared_experts.")
        for row in range(t):
            top, weights = deepseek_gate(cfg, logits[row],
                                         sd[p + "mlp.gate.e_score_correction_bias"])
            for e, w in zip(top, weights):
                y[row] += w * swiglu_mlp(a[row], sd, f"{p}mlp.experts.{e}.")
        x = x + y
    return rms_norm(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T


# --- tests ----------------------------------------------------------------------------------

def imported_logits(model, moe, params, ids):
    trainer = Trainer(make_config(model=model, moe=moe), devices=jax.devices()[:1])
    state = trainer.init_state()
    nnx.replace_by_pure_dict(state.params, params)
    return np.asarray(jax.jit(lambda m, t: m(t))(trainer.model(state), ids[None]))[0], trainer


CASES = {
    "qwen3-moe": (QWEN3, qwen3_moe_forward),
    "qwen3-moe-unnormalised": ({**QWEN3, "norm_topk_prob": False}, qwen3_moe_forward),
    "deepseek-v3": (DEEPSEEK, deepseek_v3_forward),
    "deepseek-v3-plain-q-halves": ({**DEEPSEEK, "q_lora_rank": None, "rope_interleave": False},
                                   deepseek_v3_forward),
    "deepseek-v3-dense": ({**DEEPSEEK, "first_k_dense_replace": 2}, deepseek_v3_forward),
    "deepseek-v3-dense-first": ({**DEEPSEEK, "num_hidden_layers": 3, "first_k_dense_replace": 1},
                                deepseek_v3_forward),
    # DeepSeek-V3's YaRN (factor 40, mscale = mscale_all_dim = 1), context cut to this test's
    "deepseek-v3-yarn": ({**DEEPSEEK, "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}, deepseek_v3_forward),
}


@pytest.mark.parametrize("case", list(CASES))
def test_import_equals_the_published_forward_and_export_gives_the_files_back(case, tmp_path,
                                                                             capsys):
    cfg, forward = CASES[case]
    deepseek = cfg["model_type"] == "deepseek_v3"
    tensors = random_hf_tensors(cfg, mtp=deepseek)
    save_hf_dir(tmp_path, cfg, tensors)
    model, moe, params = from_hf(*load_hf_dir(tmp_path))
    if deepseek:
        n = cfg["num_hidden_layers"]
        assert f"multi-token-prediction layers [{n}]" in capsys.readouterr().out
        tensors = {k: v for k, v in tensors.items() if not k.startswith(f"model.layers.{n}.")}
    ids = np.random.default_rng(1).integers(0, cfg["vocab_size"], 12)
    ours, trainer = imported_logits(model, moe, params, ids)
    reference = forward(cfg, tensors, ids)
    np.testing.assert_allclose(ours, reference, rtol=2e-4, atol=2e-4)
    assert np.abs(reference).max() > 1.0
    # Export of the import: the same tensors (rotary rows back in the file's order) and a
    # config.json that imports to the same model.
    hf_config, exported = to_hf(trainer.config, params)
    if not cfg.get("rope_interleave", True):  # we always write interleaved rows
        hf_config = {**hf_config, "rope_interleave": True}
        again = from_hf(hf_config, exported)
        jax.tree.map(np.testing.assert_array_equal, again[2], params)
        return
    assert exported.keys() == tensors.keys()
    for name, array in tensors.items():
        np.testing.assert_array_equal(exported[name], array, err_msg=name)
    json.dumps(hf_config)
    model2, moe2, params2 = from_hf(hf_config, exported)
    rebuilt, original = make_config(model=model2, moe=moe2), make_config(model=model, moe=moe)
    assert rebuilt.model == original.model and rebuilt.moe == original.moe
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_imported_settings():
    model, moe, _ = from_hf(QWEN3, random_hf_tensors(QWEN3))
    assert model["qk_norm"] and model["head_dim"] == 16 and model["max_seq_len"] == 512
    assert (moe["router"], moe["expert_mlp_dim"], moe["num_experts"]) == (
        "topk_then_softmax", 32, 8)
    model, moe, params = from_hf(DEEPSEEK, random_hf_tensors(DEEPSEEK))
    assert model["attention"] == "mla" and model["q_lora_rank"] == 24
    assert (moe["score"], moe["route_groups"], moe["route_top_groups"], moe["route_scale"],
            moe["shared_experts"]) == ("sigmoid", 4, 2, 2.5, 1)
    assert moe["bias_update_rate"] > 0 and params["blocks"]["mlp"]["router_bias"].shape == (2, 8)
    zero_bias = {k: (np.zeros_like(v) if k.endswith("e_score_correction_bias") else v)
                 for k, v in random_hf_tensors(DEEPSEEK).items()}
    _, moe, params = from_hf(DEEPSEEK, zero_bias)
    assert moe["bias_update_rate"] == 0 and "router_bias" not in params["blocks"]["mlp"]


@pytest.mark.parametrize("cfg, field", [
    ({**DEEPSEEK, "norm_topk_prob": False}, "norm_topk_prob=False"),
    ({**DEEPSEEK, "scoring_func": "softmax"}, "scoring_func=softmax"),
    ({**DEEPSEEK, "rope_scaling": {"type": "yarn", "factor": 40, "attention_factor": 1.0}},
     "rope_scaling.attention_factor"),
    ({**DEEPSEEK, "quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({**DEEPSEEK, "quantization_config": "fp8"}, r"quantization_config \(quant_method=fp8\)"),
    ({**QWEN3, "decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({**QWEN3, "mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]"),
    ({k: v for k, v in QWEN3.items() if k != "rope_theta"}
     | {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}},
     "rope_parameters.rope_type=dynamic"),
])
def test_unconvertible_settings_are_one_line_errors(cfg, field):
    with pytest.raises(ConfigError, match=f"config.json sets {field}") as err:
        from_hf(cfg, random_hf_tensors(QWEN3 if cfg["model_type"] == "qwen3_moe" else DEEPSEEK))
    assert "\n" not in str(err.value)


def test_transformers5_layout():
    """transformers 5 writes `rope_parameters` and Qwen3-MoE's `num_local_experts` (checked
    against Qwen3MoeConfig().to_dict() of transformers 5.25)."""
    layout = {k: v for k, v in QWEN3.items() if k not in ("rope_theta", "num_experts")}
    layout["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    layout["num_local_experts"] = QWEN3["num_experts"]
    model, moe, _ = from_hf(layout, random_hf_tensors(QWEN3))
    assert model["rope_theta"] == 1e6 and moe["num_experts"] == 8
    del layout["num_local_experts"]
    with pytest.raises(ConfigError, match=r"lacks num_experts \(or num_local_experts\)"):
        from_hf(layout, random_hf_tensors(QWEN3))


def test_export_refusals_name_the_field():
    softmax_mla = make_config(model={"attention": "mla", "num_kv_heads": None},
                              moe={"num_experts": 4})
    with pytest.raises(ConfigError, match="moe.score=softmax cannot be exported as "
                                          "DeepseekV3ForCausalLM"):
        to_hf(softmax_mla, {})
    biased = make_config(model={"qk_norm": True}, moe={"num_experts": 4, "bias_update_rate": 1e-3})
    with pytest.raises(ConfigError, match="moe.bias_update_rate=0.001 cannot be exported as "
                                          "Qwen3MoeForCausalLM"):
        to_hf(biased, {})


def test_qk_norm_layer_equals_numpy():
    """model.qk_norm: each head's q and k RMS-normalised over head_dim before RoPE."""
    from jaxtron.models.layers import Attention

    cfg = make_config(model={"qk_norm": True, "num_heads": 4, "num_kv_heads": 2,
                             "head_dim": 16, "rope_theta": 100.0}).model
    attn = Attention(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    attn.q_norm[...] = rng.normal(1.0, 0.2, 16).astype(np.float32)
    attn.k_norm[...] = rng.normal(1.0, 0.2, 16).astype(np.float32)
    x = rng.normal(size=(1, 10, 64)).astype(np.float32)
    q, k, v = (np.asarray(a)[0].transpose(1, 0, 2)
               for a in attn.project_qkv(x, np.arange(10)))
    cos, sin = rope_tables(10, 16, 100.0)
    for got, w, scale in ((q, attn.wq, attn.q_norm), (k, attn.wk, attn.k_norm)):
        proj = np.einsum("ld,dhk->hlk", x[0].astype(np.float64), np.asarray(w[...]))
        normed = rms_norm(proj, np.asarray(scale[...]), cfg.norm_eps)
        np.testing.assert_allclose(got, normed * cos + rotate_half(normed) * sin, rtol=1e-5,
                                   atol=1e-5)
    with pytest.raises(ConfigError, match="model.qk_norm=true needs"):
        make_config(model={"qk_norm": True, "attention": "mla", "num_kv_heads": None})
