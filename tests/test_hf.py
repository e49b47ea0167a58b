"""Hugging Face conversion: round trips, and logits equal to an independent numpy forward pass
written from the HF tensor names and config.json alone (Llama and Mixtral semantics)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtron.errors import ConfigError, DataError
from jaxtron.hf.files import load_hf_dir, save_hf_dir
from jaxtron.hf.translate import from_hf, to_hf
from jaxtron.training.trainer import Trainer

from conftest import make_config
from hf_rope_reference import hf_rope_tables

LLAMA = {"model": {"num_layers": 2, "d_model": 64, "num_heads": 4, "num_kv_heads": 2,
                   "mlp_dim": 96, "rope_theta": 500.0}}
MIXTRAL = {"model": {**LLAMA["model"], "num_heads": 8, "head_dim": 16},  # H*K != D
           "moe": {"num_experts": 4, "top_k": 2, "mode": "dropless"}}
QWEN3 = {"model": {**LLAMA["model"], "num_heads": 8, "head_dim": 16, "qk_norm": True}}
QWEN2 = {"model": {**LLAMA["model"], "qkv_bias": True}}
MISTRAL = {"model": {**LLAMA["model"], "sliding_window": 5}}  # shorter than the 12 test tokens
VARIANTS = {"llama": LLAMA, "mixtral": MIXTRAL, "qwen3": QWEN3, "qwen2": QWEN2,
            "mistral": MISTRAL}


@functools.cache
def random_state(name):
    """A Trainer state whose every parameter (norm scales included) is random, so that a
    swapped or transposed tensor cannot go unnoticed. Cached: tests only read it."""
    config = make_config(**VARIANTS[name])
    trainer = Trainer(config)
    state = trainer.init_state()
    pure = nnx.to_pure_dict(state.params)
    rng = np.random.default_rng(0)
    leaves, treedef = jax.tree.flatten(pure)
    pure = jax.tree.unflatten(treedef, [np.asarray(rng.normal(1.0 if a.ndim <= 2 and
                                                              a.shape[-1] == 64 else 0.0,
                                                              0.1, a.shape), np.float32)
                                        for a in leaves])
    nnx.replace_by_pure_dict(state.params, pure)
    return config, trainer, state, pure


# --- an independent Hugging Face forward pass, in numpy (float64) ----------------------------

def rms_norm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def silu(x):
    return x / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def hf_forward(cfg, sd, ids):
    """LlamaForCausalLM / MixtralForCausalLM logits [T, V] for one sequence; a sliding window
    as Mistral and Qwen apply it: keys i - sliding_window < j <= i."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    t, h, g = len(ids), cfg["num_attention_heads"], cfg["num_key_value_heads"]
    k_dim, eps = cfg["head_dim"], cfg["rms_norm_eps"]
    cos, sin = hf_rope_tables(cfg, t, k_dim)  # [T, K], with any rope_scaling
    causal = np.tril(np.ones((t, t), bool))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window is not None:
        causal &= np.triu(np.ones((t, t), bool), 1 - window)
    x = sd["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms_norm(x, sd[p + "input_layernorm.weight"], eps)
        bias = {x: sd.get(f"{p}self_attn.{x}_proj.bias", 0.0) for x in "qkv"}  # Qwen2
        q = (a @ sd[p + "self_attn.q_proj.weight"].T + bias["q"]).reshape(t, h, k_dim)
        k = (a @ sd[p + "self_attn.k_proj.weight"].T + bias["k"]).reshape(t, g, k_dim)
        if p + "self_attn.q_norm.weight" in sd:  # Qwen3: RMSNorm per head, before RoPE
            q = rms_norm(q, sd[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, sd[p + "self_attn.k_norm.weight"], eps)
        q, k = q.transpose(1, 0, 2), k.transpose(1, 0, 2)
        v = (a @ sd[p + "self_attn.v_proj.weight"].T + bias["v"]).reshape(t, g, k_dim).transpose(
            1, 0, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, h // g, axis=0), np.repeat(v, h // g, axis=0)  # repeat_kv
        scores = np.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(k_dim), -np.inf)
        out = (softmax(scores) @ v).transpose(1, 0, 2).reshape(t, h * k_dim)
        x = x + out @ sd[p + "self_attn.o_proj.weight"].T
        a = rms_norm(x, sd[p + "post_attention_layernorm.weight"], eps)
        if "num_local_experts" in cfg:
            probs = softmax(a @ sd[p + "block_sparse_moe.gate.weight"].T)  # [T, E]
            top = np.argsort(-probs, axis=-1)[:, :cfg["num_experts_per_tok"]]
            weights = np.take_along_axis(probs, top, -1)
            weights /= weights.sum(-1, keepdims=True)
            y = np.zeros_like(a)
            for row in range(t):
                for e, w in zip(top[row], weights[row]):
                    q_ = f"{p}block_sparse_moe.experts.{e}."
                    hid = silu(a[row] @ sd[q_ + "w1.weight"].T) * (a[row] @ sd[q_ + "w3.weight"].T)
                    y[row] += w * (hid @ sd[q_ + "w2.weight"].T)
        else:
            y = (silu(a @ sd[p + "mlp.gate_proj.weight"].T) * (a @ sd[p + "mlp.up_proj.weight"].T)
                 ) @ sd[p + "mlp.down_proj.weight"].T
        x = x + y
    return rms_norm(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("variant", ["llama", "mixtral", "qwen3", "qwen2", "mistral"])
def test_logits_equal_an_independent_hf_forward(variant):
    config, trainer, state, pure = random_state(variant)
    hf_config, tensors = to_hf(config, pure)
    ids = np.random.default_rng(1).integers(0, 256, 12)
    ours = np.asarray(jax.jit(lambda m, t: m(t))(trainer.model(state), ids[None]))[0]
    reference = hf_forward(hf_config, tensors, ids)
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)
    assert np.abs(reference).max() > 1.0  # the comparison is not between near-zero numbers


@pytest.mark.parametrize("variant", ["llama", "mixtral", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("shard_bytes", [None, 60_000], ids=["single", "sharded"])
def test_round_trip_through_files_is_exact(variant, shard_bytes, tmp_path):
    config, _, _, pure = random_state(variant)
    hf_config, tensors = to_hf(config, pure)
    assert hf_config["architectures"] == [{"mixtral": "MixtralForCausalLM", "llama":
                                           "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                           "qwen2": "Qwen2ForCausalLM",
                                           "mistral": "MistralForCausalLM"}[variant]]
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (
        config.model.num_heads * config.model.resolved_head_dim, 64)
    save_hf_dir(tmp_path, hf_config, tensors, max_shard_bytes=shard_bytes)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_bytes is not None)
    model, moe, params = from_hf(*load_hf_dir(tmp_path))
    jax.tree.map(np.testing.assert_array_equal, params, pure)
    rebuilt = make_config(model=model, moe=moe)
    assert rebuilt.model == config.model
    assert (rebuilt.moe.num_experts, rebuilt.moe.top_k) == (config.moe.num_experts,
                                                            config.moe.top_k)


def test_errors_name_what_does_not_match():
    config, _, _, pure = random_state("llama")
    hf_config, tensors = to_hf(config, pure)
    with pytest.raises(ConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        from_hf({**hf_config, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
                tensors)
    with pytest.raises(ConfigError, match="rope_scaling.rope_type=dynamic"):
        from_hf({**hf_config, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, tensors)
    with pytest.raises(ConfigError, match="lacks original_max_position_embeddings"):
        from_hf({**hf_config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, tensors)
    name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(DataError, match=f"missing tensor {name}"):
        from_hf(hf_config, {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(DataError, match=rf"{name} has shape \(96, 32\); config.json implies "
                                        r"\(96, 64\)"):
        from_hf(hf_config, {**tensors, name: tensors[name][:, :32]})
    with pytest.raises(DataError, match="unexpected tensors model.layers.0.self_attn.q_proj.bias"):
        from_hf(hf_config, {**tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(64)})
    gpt2 = make_config(model={"type": "gpt2", "num_kv_heads": None})
    with pytest.raises(ConfigError, match="model.type=gpt2 cannot be exported"):
        to_hf(gpt2, pure)
    interleaved = make_config(moe={"num_experts": 4, "every": 2})
    with pytest.raises(ConfigError, match="moe.every=2 cannot be exported"):
        to_hf(interleaved, pure)


def test_tied_and_windowed_checkpoints_and_missing_files(tmp_path):
    config, _, _, pure = random_state("llama")
    hf_config, tensors = to_hf(config, pure)
    tied = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    model, _, params = from_hf({**hf_config, "tie_word_embeddings": True}, tied)
    assert model["tie_embeddings"] and "lm_head" not in params["head"]  # stays tied
    model, _, _ = from_hf({**hf_config, "sliding_window": 128}, tensors)
    assert "sliding_window" not in model  # transformers' Llama has no window: ignored
    mistral = {**hf_config, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
               "sliding_window": 4096}
    model, _, params = from_hf(mistral, tensors)
    assert model["sliding_window"] == 4096  # Mistral 7B v0.1
    assert model["max_seq_len"] == hf_config["max_position_embeddings"]
    model, _, _ = from_hf({**mistral, "sliding_window": None}, tensors)  # v0.2 and later
    assert "sliding_window" not in model
    jax.tree.map(np.testing.assert_array_equal, params, pure)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DataError, match="neither model.safetensors nor"):
        load_hf_dir(tmp_path)


def test_tied_llama_equals_the_hf_forward_and_exports_tied():
    """Llama 3.2 1B/3B tie the head to the table: one matrix in the model, none written."""
    config = make_config(model={**LLAMA["model"], "tie_embeddings": True, "init_std": 0.1})
    trainer = Trainer(config)
    state = trainer.init_state()
    pure = nnx.to_pure_dict(trainer.to_model_params(state.params))
    assert "lm_head" not in pure["head"]
    hf_config, tensors = to_hf(config, pure)
    assert hf_config["tie_word_embeddings"] and "lm_head.weight" not in tensors
    ids = np.random.default_rng(4).integers(0, 256, 12)
    ours = np.asarray(jax.jit(lambda m, t: m(t))(trainer.model(state), ids[None]))[0]
    reference = hf_forward(hf_config, {**tensors, "lm_head.weight":
                                       tensors["model.embed_tokens.weight"]}, ids)
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)
    model, moe, params = from_hf(hf_config, tensors)
    jax.tree.map(np.testing.assert_array_equal, params, pure)
    assert make_config(model={**model, "init_std": 0.1}, moe=moe).model == config.model


def transformers5_layout(hf_config: dict) -> dict:
    """config.json as transformers 5 writes it: RoPE settings in one rope_parameters dict."""
    layout = {k: v for k, v in hf_config.items() if k not in ("rope_theta", "rope_scaling")}
    layout["rope_parameters"] = {"rope_theta": hf_config["rope_theta"], "rope_type": "default"}
    return layout


def test_transformers5_rope_parameters_layout_keeps_rope_theta():
    """rope_theta inside rope_parameters (no top-level key) must not fall back to a default:
    the imported model's logits still equal the HF forward with the file's theta."""
    config, trainer, state, pure = random_state("llama")
    hf_config, tensors = to_hf(config, pure)
    model, moe, params = from_hf(transformers5_layout(hf_config), tensors)
    assert model["rope_theta"] == config.model.rope_theta == 500.0
    imported = Trainer(make_config(model=model, moe=moe))
    restored = imported.init_state()
    nnx.replace_by_pure_dict(restored.params, params)
    ids = np.random.default_rng(2).integers(0, 256, 12)
    ours = np.asarray(jax.jit(lambda m, t: m(t))(imported.model(restored), ids[None]))[0]
    np.testing.assert_allclose(ours, hf_forward(hf_config, tensors, ids), rtol=1e-4, atol=1e-4)
    scaled = {"rope_theta": 500.0, "rope_type": "linear", "factor": 2.0}
    model, _, _ = from_hf({**transformers5_layout(hf_config), "rope_parameters": scaled}, tensors)
    assert (model["rope_scaling"], model["rope_factor"]) == ("linear", 2.0)
    scaled = {"rope_theta": 500.0, "rope_type": "longrope", "factor": 8.0}
    with pytest.raises(ConfigError, match="rope_parameters.rope_type=longrope"):
        from_hf({**transformers5_layout(hf_config), "rope_parameters": scaled}, tensors)


# Llama 3.1's (factor 8 from 8192; here from 16 so that a 12-token test sees all three bands of
# its blend), linear interpolation, and YaRN as Qwen and DeepSeek set it.
SCALED = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
             "beta_fast": 32, "beta_slow": 1},
    "yarn-mscale": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
                    "mscale": 1.0, "mscale_all_dim": 0.707},
}


@pytest.mark.parametrize("kind", list(SCALED))
def test_rope_scaled_checkpoints_equal_the_hf_forward_and_export_back(kind):
    config, _, _, pure = random_state("llama")
    hf_config, tensors = to_hf(config, pure)
    hf_config = {**hf_config, "rope_scaling": SCALED[kind]}
    model, moe, params = from_hf(hf_config, tensors)
    imported = Trainer(make_config(model=model, moe=moe))
    state = imported.init_state()
    nnx.replace_by_pure_dict(state.params, params)
    ids = np.random.default_rng(3).integers(0, 256, 12)
    ours = np.asarray(jax.jit(lambda m, t: m(t))(imported.model(state), ids[None]))[0]
    reference = hf_forward(hf_config, tensors, ids)
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)
    plain = hf_forward({**hf_config, "rope_scaling": None}, tensors, ids)
    assert np.abs(plain - reference).max() > 1e-3  # the scaling changes the logits
    exported, _ = to_hf(imported.config, params)
    again, moe_again, _ = from_hf(exported, tensors)
    assert make_config(model=again, moe=moe_again).model == make_config(model=model,
                                                                         moe=moe).model


def test_bf16_checkpoints_import_with_fp32_master_weights(tmp_path):
    """Published checkpoints are bf16; fine-tuning keeps fp32 master weights, so the import
    casts (exactly) and train.init_from into an fp32 config works."""
    from jaxtron.convert import convert
    
    config, _, _, pure = random_state("llama")
    hf_config, tensors = to_hf(config, pure)
    bf16 = {k: v.astype(jnp.bfloat16) for k, v in tensors.items()}
    save_hf_dir(tmp_path / "hf", hf_config, bf16)
    converted = convert(tmp_path / "hf", tmp_path / "imported")
    assert converted.model.param_dtype == "float32"
    trainer = Trainer(make_config(**LLAMA), devices=jax.devices()[:1])
    params = nnx.to_pure_dict(trainer.params_from(tmp_path / "imported"))
    embed = np.asarray(params["embedder"]["embed"])
    assert embed.dtype == np.float32
    np.testing.assert_array_equal(embed, np.asarray(bf16["model.embed_tokens.weight"],
                                                    np.float32))


def test_damaged_files_are_one_line_errors(tmp_path):
    config, _, _, pure = random_state("llama")
    hf_config, tensors = to_hf(config, pure)
    save_hf_dir(tmp_path, hf_config, tensors)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(DataError, match="model.safetensors could not be read .* truncated"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(DataError, match="config.json is not valid JSON"):
        load_hf_dir(tmp_path)
