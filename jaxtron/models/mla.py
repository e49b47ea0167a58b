"""Multi-head latent attention (MLA), `model.attention: mla`.

DeepSeek-V2 (arXiv 2405.04434) and DeepSeek-V3 (arXiv 2412.19437): keys and values are
decompressed per head from one small latent per token, which is all a decoder has to cache.
With C = kv_lora_rank, Kn = qk_nope_head_dim, Kr = qk_rope_head_dim, V = v_head_dim:

    q_BxLxHx(Kn+Kr)   = W_q x, or W_uq RMSNorm(W_dq x) with q_lora_rank > 0
    [c_BxLxC, p_BxLxKr] = W_dkv x                  one latent and one rotary key per token
    k_nope, v         = W_uk RMSNorm(c), W_uv RMSNorm(c)       [B, L, H, Kn], [B, L, H, V]
    k = [k_nope, RoPE(p) for every head],  q = [q_nope, RoPE(q_pe)]
    out = W_o concat_h softmax(q k^T / sqrt(Kn + Kr), causal, same document) v

RoPE rotates pairs (i, i + Kr/2) as `layers.rotary` does for Llama (DeepSeek's checkpoints
interleave the pairs instead: a fixed permutation of W_q's and W_dkv's rotary columns), at the
TokenPositions's positions, so packed documents restart at 0.

Tensor parallelism: W_uq, W_uk, W_uv and W_o carry the `heads` axis (split over `tensor`); the
down-projections, their norms and the latent carry `latent`, which is never split, so every
tensor rank computes the whole (small) latent and decompresses only its own heads. The block
needs one reduction, after W_o, as multi-head attention does.

Kernels: queries and keys are Kn + Kr wide and values V wide. The XLA kernels (blockwise,
reference) and ring attention take the two widths as they are; Pallas (Triton, splash,
interpreted) and cuDNN take one head dim, so `kernels.attention` pads the narrower side with
zeros and slices the output (exact; the kernel moves max(K, V) columns of values).

Decoding (`cached_attention`) caches the normalised latent c and the rotated key part p,
C + Kr numbers per token and layer instead of 2 H K, and absorbs the up-projections as
DeepSeek's inference code does: scores = (q_nope W_uk^T) c^T + q_pe p^T over the cache, the
heads' outputs (softmax c) W_uv, so the cached keys and values are never decompressed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.schema import ModelConfig
from jaxtron.kernels.attention import attention
from jaxtron.kernels.fp8 import einsum
from jaxtron.kernels.reference import visible_keys
from jaxtron.models import rope
from jaxtron.models.layers import fp8_histories, fp8_history, normal, param, rotary
from jaxtron.models.token_positions import PLAIN, TokenPositions
from jaxtron.sharding.rules import constrain

# Extra shape letters here: C latent width (kv_lora_rank), Q compressed query width
# (q_lora_rank), P rotary width (qk_rope_head_dim); K is the query/key head dim Kn + P.


def rms_norm(x, scale, eps: float):
    """RMSNorm over the last axis, statistics in fp32 (as `layers.RMSNorm`)."""
    y = x.astype(jnp.float32)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


class MLAttention(nnx.Module):
    """Multi-head latent attention with the interface of `layers.Attention`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, c = cfg.d_model, cfg.num_heads, cfg.kv_lora_rank
        nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        init, ones, pd = normal(cfg.init_std), nnx.initializers.ones, cfg.param_dtype
        out_init = normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        self.q_lora = bool(cfg.q_lora_rank)
        if self.q_lora:
            q = cfg.q_lora_rank
            self.wq_down = param(rngs, init, (d, q), ("embed", "latent"), pd)
            self.q_norm = param(rngs, ones, (q,), ("latent",), pd)
            self.wq_up = param(rngs, init, (q, h, nope + rope), ("latent", "heads", "head_dim"),
                               pd)
        else:
            self.wq = param(rngs, init, (d, h, nope + rope), ("embed", "heads", "head_dim"), pd)
        self.wkv_down = param(rngs, init, (d, c + rope), ("embed", "latent"), pd)
        self.kv_norm = param(rngs, ones, (c,), ("latent",), pd)
        self.wk_up = param(rngs, init, (c, h, nope), ("latent", "heads", "head_dim"), pd)
        self.wv_up = param(rngs, init, (c, h, v), ("latent", "heads", "head_dim"), pd)
        self.wo = param(rngs, out_init, (h, v, d), ("heads", "head_dim", "embed"), pd)
        # fp8 histories: q down (or q), q up, kv down, out
        self.fp8_amax_history = fp8_histories(cfg, rngs, 4)

    def project(self, x_BxLxD, positions):
        """-> q_BxLxHxK (RoPE on its last P columns), latent_BxLxC (normalised), p_BxLxP
        (the rotated key part every head shares)."""
        cfg, dt, h = self.cfg, x_BxLxD.dtype, self.fp8_amax_history
        if self.q_lora:
            cq_BxLxQ = einsum("bld,dq->blq", x_BxLxD, self.wq_down[...].astype(dt), cfg.fp8,
                              fp8_history(h, 0))
            cq_BxLxQ = rms_norm(cq_BxLxQ, self.q_norm[...], cfg.norm_eps)
            q_BxLxHxK = einsum("blq,qhk->blhk", cq_BxLxQ, self.wq_up[...].astype(dt),
                               cfg.fp8, fp8_history(h, 1))
        else:
            q_BxLxHxK = einsum("bld,dhk->blhk", x_BxLxD, self.wq[...].astype(dt), cfg.fp8,
                               fp8_history(h, 0))
        q_nope, q_pe = jnp.split(q_BxLxHxK, [cfg.qk_nope_head_dim], axis=-1)
        q_BxLxHxK = jnp.concatenate([q_nope, rotary(q_pe, positions, cfg)], axis=-1)
        softmax_factor = rope.latent_softmax_scale(cfg)
        if softmax_factor != 1.0:  # YaRN's softmax scale, carried by the queries
            q_BxLxHxK = q_BxLxHxK * jnp.asarray(softmax_factor, q_BxLxHxK.dtype)
        ckv_BxLxCP = einsum("bld,dc->blc", x_BxLxD, self.wkv_down[...].astype(dt), cfg.fp8,
                            fp8_history(h, 2))
        latent_BxLxC, p_BxLxP = jnp.split(ckv_BxLxCP, [cfg.kv_lora_rank], axis=-1)
        latent_BxLxC = rms_norm(latent_BxLxC, self.kv_norm[...], cfg.norm_eps)
        p_BxLxP = rotary(p_BxLxP[:, :, None, :], positions, cfg)[:, :, 0]
        return q_BxLxHxK, latent_BxLxC, p_BxLxP

    def project_out(self, out_BxLxHxV):
        dt = out_BxLxHxV.dtype
        return einsum("blhv,hvd->bld", out_BxLxHxV, self.wo[...].astype(dt), self.cfg.fp8,
                      fp8_history(self.fp8_amax_history, 3))

    def __call__(self, x_BxLxD, token_pos: TokenPositions = PLAIN):
        """As `Attention.__call__`: RoPE at the given positions, attention within its
        documents, causal."""
        dt = x_BxLxD.dtype
        positions = token_pos.positions_for(x_BxLxD.shape[1])
        q_BxLxHxK, latent_BxLxC, p_BxLxP = self.project(x_BxLxD, positions)
        # Under sequence parallelism the latent, not x, is what is gathered over `tensor`.
        latent_BxLxC = constrain(latent_BxLxC, ("batch", "seq", "latent"))
        k_nope_BxLxHxN = jnp.einsum("blc,chn->blhn", latent_BxLxC, self.wk_up[...].astype(dt))
        v_BxLxHxV = jnp.einsum("blc,chv->blhv", latent_BxLxC, self.wv_up[...].astype(dt))
        p_BxLxHxP = jnp.broadcast_to(p_BxLxP[:, :, None, :],
                                     (*k_nope_BxLxHxN.shape[:3], p_BxLxP.shape[-1]))
        k_BxLxHxK = jnp.concatenate([k_nope_BxLxHxN, p_BxLxHxP], axis=-1)
        names = ("batch", "seq", "heads", "head_dim")
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxV = (constrain(x, names)
                                           for x in (q_BxLxHxK, k_BxLxHxK, v_BxLxHxV))
        out_BxLxHxV = attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, causal=True,
                                segment_ids=token_pos.segment_ids, impl=self.cfg.attention_impl,
                                window=self.cfg.sliding_window)
        return self.project_out(out_BxLxHxV)


# ---------------------------------------------------------------------------------------------
# Decoding against a latent cache (`models/decode.py` calls these for an mla model).


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> dict:
    """Zeroed caches: the normalised latent [N, B, S, C] and the rotated key part [N, B, S, P]."""
    shape = (cfg.num_layers, batch, max_len)
    return {"latent": jnp.zeros((*shape, cfg.kv_lora_rank), dtype),
            "k_pe": jnp.zeros((*shape, cfg.qk_rope_head_dim), dtype)}


def cached_attention(attn: MLAttention, x_BxLxD, cache: dict, position):
    """`MLAttention.__call__` against a cache holding positions 0..position-1 -> (out_BxLxD,
    the new cache rows {"latent", "k_pe"} for the caller to write at `position`)."""
    cfg, dt = attn.cfg, x_BxLxD.dtype
    positions_L = position + jnp.arange(x_BxLxD.shape[1])
    q_BxLxHxK, latent_BxLxC, p_BxLxP = attn.project(x_BxLxD, positions_L)
    rows = {"latent": latent_BxLxC.astype(cache["latent"].dtype),
            "k_pe": p_BxLxP.astype(cache["k_pe"].dtype)}
    latent_BxSxC, p_BxSxP = (
        jax.lax.dynamic_update_slice(cache[name], rows[name], (0, position, 0)).astype(dt)
        for name in ("latent", "k_pe"))
    q_nope_BxLxHxN, q_pe_BxLxHxP = jnp.split(q_BxLxHxK, [cfg.qk_nope_head_dim], axis=-1)
    # W_uk absorbed into the query: q_nope . (W_uk c) = (q_nope W_uk^T) . c
    q_lat_BxLxHxC = jnp.einsum("blhn,chn->blhc", q_nope_BxLxHxN, attn.wk_up[...].astype(dt))
    logits_BxHxLxS = (
        jnp.einsum("blhc,bsc->bhls", q_lat_BxLxHxC, latent_BxSxC,
                   preferred_element_type=jnp.float32)
        + jnp.einsum("blhp,bsp->bhls", q_pe_BxLxHxP, p_BxSxP,
                     preferred_element_type=jnp.float32)) * q_BxLxHxK.shape[-1] ** -0.5
    visible_LxS = visible_keys(positions_L, jnp.arange(latent_BxSxC.shape[1]),
                              cfg.sliding_window)
    logits_BxHxLxS = jnp.where(visible_LxS, logits_BxHxLxS, jnp.finfo(jnp.float32).min)
    probs_BxHxLxS = jax.nn.softmax(logits_BxHxLxS, axis=-1).astype(dt)
    out_BxLxHxC = jnp.einsum("bhls,bsc->blhc", probs_BxHxLxS, latent_BxSxC)
    out_BxLxHxV = jnp.einsum("blhc,chv->blhv", out_BxLxHxC, attn.wv_up[...].astype(dt))
    return attn.project_out(out_BxLxHxV), rows
