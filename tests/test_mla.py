"""Multi-head latent attention: the layer against a numpy rendering of DeepSeek-V3's equations,
the kernels with values narrower than keys, sharded == one device, latent-cache decoding ==
the full forward, packed rows == their documents run alone, and config errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtron.config.platforms import building_for
from jaxtron.data.pipeline import open_dataset, train_batches
from jaxtron.errors import ConfigError
from jaxtron.kernels.attention import attention
from jaxtron.kernels.blockwise import blockwise_causal_attention
from jaxtron.models.generation import decode_step, generate, prefill
from jaxtron.models.mla import MLAttention
from jaxtron.models.token_positions import TokenPositions
from jaxtron.models.transformer import Transformer
from jaxtron.training.flops import matmul_params, training_flops_per_token
from jaxtron.training.trainer import Trainer

from attention_oracle import reference_attention
from conftest import initial_state, make_config

# Kn = 16, P = 8 (q/k head dim 24), V = 12: values narrower than keys, as in DeepSeek-V3.
MLA = {"attention": "mla", "num_kv_heads": None, "num_heads": 4, "d_model": 64,
       "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12}


# --- numpy, from the equations (rotating pairs (i, i + P/2), as the model's RoPE does) -------


def np_rms(x, scale, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_rope(x, pos, theta=10000.0):
    """x [..., L, P] at positions pos [L]."""
    half = x.shape[-1] // 2
    angle = pos[:, None] * theta ** (-np.arange(half) / half)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                           x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)


def np_mla(p, x, pos, seg, nope, rope, rank, q_lora):
    """One sequence: x [L, D], positions [L], segment ids [L] -> [L, D]."""
    q = np_rms(x @ p["wq_down"], p["q_norm"]) @ p["wq_up"].reshape(q_lora, -1) if q_lora else \
        x @ p["wq"].reshape(x.shape[1], -1)
    heads = p["wo"].shape[0]
    q = q.reshape(len(x), heads, nope + rope).transpose(1, 0, 2)         # [H, L, K]
    q = np.concatenate([q[..., :nope], np_rope(q[..., nope:], pos)], axis=-1)
    ckv = x @ p["wkv_down"]
    c, k_pe = np_rms(ckv[:, :rank], p["kv_norm"]), np_rope(ckv[:, rank:], pos)
    k_nope = np.einsum("lc,chn->hln", c, p["wk_up"])
    v = np.einsum("lc,chv->hlv", c, p["wv_up"])
    k = np.concatenate([k_nope, np.broadcast_to(k_pe, (heads, *k_pe.shape))], axis=-1)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(nope + rope)
    allowed = np.tril(np.ones((len(x), len(x)), bool)) & (seg[:, None] == seg[None, :])
    s = np.where(allowed, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    out = (w / w.sum(-1, keepdims=True)) @ v                             # [H, L, V]
    return np.einsum("hlv,hvd->ld", out, p["wo"])


@pytest.mark.parametrize("q_lora", [None, 24])
def test_layer_matches_numpy_from_the_equations(q_lora):
    cfg = make_config(model={**MLA, "q_lora_rank": q_lora, "init_std": 0.2}).model
    layer = MLAttention(cfg, nnx.Rngs(0))
    # q_norm / kv_norm scales away from 1, so that they are tested too.
    for name in ("q_norm", "kv_norm") if q_lora else ("kv_norm",):
        scale = getattr(layer, name)
        scale[...] = 1 + 0.3 * jax.random.normal(jax.random.key(5), scale.shape)
    params = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(layer)).items()}
    x = jax.random.normal(jax.random.key(1), (2, 20, 64))
    # Row 0 plain; row 1 packed: documents of 7 and 13 tokens, positions restarting.
    positions = np.stack([np.arange(20), np.r_[np.arange(7), np.arange(13)]])
    segments = np.stack([np.zeros(20, int), np.r_[np.zeros(7, int), np.ones(13, int)]])
    layout = TokenPositions(positions=jnp.asarray(positions), segment_ids=jnp.asarray(segments))
    got = jax.jit(lambda m, x: m(x, layout))(layer, x)
    for b in range(2):
        want = np_mla(params, np.asarray(x[b], np.float64), positions[b], segments[b],
                      16, 8, 32, q_lora)
        np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-5)


# --- kernels with a value head dim of its own --------------------------------------------------


def qkv(length, k_dim=24, v_dim=12, heads=4, kv_heads=2):
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (2, length, heads, k_dim)),
            jax.random.normal(keys[1], (2, length, kv_heads, k_dim)),
            jax.random.normal(keys[2], (2, length, kv_heads, v_dim)))


def segments(length):
    return jnp.broadcast_to((jnp.arange(length) >= length // 3).astype(jnp.int32), (2, length))


@pytest.mark.parametrize("v_dim", [12, 32])  # narrower than q/k (DeepSeek), and wider
@pytest.mark.parametrize("kernel", ["blockwise", "pallas-interpret"])
def test_kernels_take_a_value_head_dim_of_their_own(kernel, v_dim):
    length = 128 if kernel == "blockwise" else 32  # 128: four row blocks
    q, k, v = qkv(length, v_dim=v_dim)
    ids = segments(length)
    if kernel == "blockwise":
        def run(q, k, v):
            return blockwise_causal_attention(q, k, v, segment_ids=ids)
    else:
        def run(q, k, v):
            with building_for("cpu"):
                return attention(q, k, v, segment_ids=ids, impl="pallas")

    def want(q, k, v):
        return reference_attention(q, k, v, causal=True, segment_ids=ids)

    out = jax.jit(run)(q, k, v)
    assert out.shape == (2, length, 4, v_dim)
    np.testing.assert_allclose(out, want(q, k, v), rtol=1e-5, atol=1e-5)
    cotangent = jax.random.normal(jax.random.key(9), out.shape)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a) * cotangent), argnums=(0, 1, 2)))
    grads_want = jax.grad(lambda *a: jnp.sum(want(*a) * cotangent), argnums=(0, 1, 2))
    for g, w in zip(grads(q, k, v), grads_want(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


# --- the model ---------------------------------------------------------------------------------


def loss_and_grads(layout: dict, devices, model=MLA):
    config = make_config(layout, model=model, train={"batch_size": 4})
    trainer = Trainer(config, devices=devices)
    batch = trainer.put_batch(next(train_batches(config, open_dataset(config))))
    loss, grads = trainer.loss_and_grads(initial_state(trainer).params, batch)
    return trainer, float(loss), jax.device_get(nnx.to_pure_dict(grads))


def test_tensor_and_context_parallel_match_one_device():
    _, loss1, grads1 = loss_and_grads({"mesh.data": 1}, jax.devices()[:1])
    layouts = {"tensor2": ({"mesh.data": 1, "mesh.tensor": 2}, 2),
               "data2_tensor2": ({"mesh.data": 2, "mesh.tensor": 2}, 4),
               "sequence2_tensor2_sp": ({"mesh.data": 1, "mesh.sequence": 2, "mesh.tensor": 2,
                                         "mesh.sequence_parallel": True}, 4)}
    for name, (layout, n) in layouts.items():
        trainer, loss, grads = loss_and_grads(layout, jax.devices()[:n])
        np.testing.assert_allclose(loss, loss1, rtol=1e-5, err_msg=name)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=name)
    # Heads split over tensor; the down-projection and the latent's norm replicated.
    attn = trainer.abstract_state().params["blocks"]["attn"]
    assert tuple(attn["wk_up"].sharding.spec) == (None, None, "tensor", None)
    assert tuple(attn["wo"].sharding.spec) == (None, "tensor", None, None)
    assert tuple(attn["wkv_down"].sharding.spec) == (None, None, None)
    assert tuple(attn["kv_norm"].sharding.spec) == (None, None)


def build(**model):
    config = make_config(model={**MLA, "init_std": 0.1, **model})
    return Transformer(config.model, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("q_lora", [None, 24])
def test_latent_cache_decoding_equals_the_full_forward(q_lora):
    model = build(q_lora_rank=q_lora)
    tokens_BxT = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
    full_BxTxV = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens_BxT))
    split = 5
    logits_BxLxV, cache = prefill(model, tokens_BxT[:, :split], max_len=tokens_BxT.shape[1])
    assert set(cache) == {"latent", "k_pe"}  # C + P numbers per token and layer
    assert cache["latent"].shape == (2, 2, 12, 32) and cache["k_pe"].shape == (2, 2, 12, 8)
    np.testing.assert_allclose(logits_BxLxV, full_BxTxV[:, :split], rtol=1e-5, atol=1e-5)
    for t in range(split, tokens_BxT.shape[1]):
        logits_BxV, cache = decode_step(model, cache, tokens_BxT[:, t:t + 1], t)
        np.testing.assert_allclose(logits_BxV, full_BxTxV[:, t], rtol=1e-5, atol=1e-5,
                                   err_msg=f"position {t}")
    ids = generate(model, [1, 2, 3], max_new_tokens=3)
    assert len(ids) == 3 and all(0 <= t < 256 for t in ids)


def test_packed_row_equals_its_documents_run_alone():
    model = build()
    apply = jax.jit(lambda m, t, layout: m(t, layout))
    docs = [jax.random.randint(jax.random.key(i), (1, n), 0, 256) for i, n in ((2, 9), (3, 15))]
    row = jnp.concatenate(docs, axis=1)
    layout = TokenPositions(positions=jnp.concatenate([jnp.arange(9), jnp.arange(15)])[None],
                         segment_ids=jnp.repeat(jnp.arange(2), jnp.array([9, 15]),
                                                total_repeat_length=24)[None])
    packed = apply(model, row, layout)
    alone = jnp.concatenate([apply(model, d, TokenPositions()) for d in docs], axis=1)
    assert bool(jnp.all(jnp.isfinite(packed)))
    np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lora", [None, 24])
def test_flop_count_covers_every_matrix(q_lora):
    """P_matmul = every parameter but the embedding table and the norms' scales; attention
    costs H (K_qk + V) multiply-adds per attended key."""
    model = build(q_lora_rank=q_lora)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    matrices = sum(v.size for path, v in flat
                   if path[-1] != "embed" and not any("norm" in str(p) for p in path))
    m = model.cfg
    assert matmul_params(m) == matrices
    attention = 2 * m.num_layers * 4 * (24 + 12) * (32 + 1) / 2
    assert training_flops_per_token(m, 32) == 6 * matrices + 3 * attention


@pytest.mark.parametrize("model, fragment", [
    ({"type": "gpt2"}, "model.attention=mla needs model.type=llama"),
    ({"num_kv_heads": 2}, "model.num_kv_heads=2 does not apply"),
    ({"kv_lora_rank": 0}, "model.kv_lora_rank=0 must be a positive"),
    ({"v_head_dim": -1}, "model.v_head_dim=-1 must be a positive"),
    ({"qk_rope_head_dim": 7}, "model.qk_rope_head_dim=7 must be even"),
    ({"q_lora_rank": -4}, "model.q_lora_rank=-4 must be positive"),
    ({"attention": "gqa"}, "model.attention='gqa' is not supported"),
])
def test_config_errors_name_the_field(model, fragment):
    with pytest.raises(ConfigError, match=fragment):
        make_config(model={**MLA, **model})
