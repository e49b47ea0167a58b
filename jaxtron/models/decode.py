"""Incremental decoding with a key/value cache, reusing the training model's parameters.

The training forward (`Transformer.forward`) attends over the whole sequence at once; a decoder
keeps every layer's keys and values of the positions seen so far, so a new token costs one row of
attention instead of a full forward. `forward_cached(model, cache, tokens_BxL, position)` serves
both phases: prefill (the prompt, L tokens at position 0) and decode (L = 1 at the next
position). Everything but attention is the training path's own modules (norms, MLP, MoE, head),
called as they are; attention is rewritten here only because it must read and write the cache,
and it reads the same parameters (`attn.wq`, ...), so training code is untouched.

Cache: `{"k", "v"}` each [N, B, S, G, K] (N layers in execution order, S the longest sequence the
cache holds). New rows are written at `position` with `lax.dynamic_update_slice`, so one compiled
step serves every position; slots past the current position are masked, never read, and so,
with `model.sliding_window` w, are slots w or more before it (the cache still holds every
position: no rolling buffer). A multi-head latent attention model (`model.attention=mla`)
caches `{"latent", "k_pe"}` instead, [N, B, S, C] and [N, B, S, P], and attends with
`mla.cached_attention`.

Mixture of experts: capacity-mode routing lets the tokens of a sequence compete for slots, which a
decoder cannot reproduce (the future tokens do not exist yet). Decoding therefore routes every
token as a sequence of its own: one token sends at most one assignment to each expert and every
expert has at least one slot, so nothing is dropped. Decoding thus computes `moe.mode=dropless`,
which equals the training forward whenever that forward drops nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.schema import ModelConfig
from jaxtron.kernels.reference import visible_keys
from jaxtron.models import mla
from jaxtron.models.blocks import Block
from jaxtron.models.layers import Attention


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> dict:
    """Zeroed k/v caches [N, B, S, G, K] (mla: latent caches) in the compute dtype (or
    `dtype`)."""
    dt = jnp.dtype(dtype or cfg.compute_dtype)
    if cfg.attention == "mla":
        return mla.init_cache(cfg, batch, max_len, dt)
    shape = (cfg.num_layers, batch, max_len, cfg.kv_heads, cfg.resolved_head_dim)
    return {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}


def embed(embedder, tokens_BxL, position):
    """`Embedder.__call__` for tokens that start at `position` rather than at 0."""
    cfg = embedder.cfg
    dt = jnp.dtype(cfg.compute_dtype)
    x_BxLxD = jnp.take(embedder.embed[...], tokens_BxL, axis=0).astype(dt)
    if cfg.type == "gpt2":
        pos_LxD = jax.lax.dynamic_slice_in_dim(embedder.pos_embed[...], position,
                                               tokens_BxL.shape[1])
        x_BxLxD = x_BxLxD + pos_LxD.astype(dt)
    return x_BxLxD


def masked_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, positions_L, window: int | None = None):
    """GQA attention of queries at `positions_L` over cache slots 0..S-1, each query seeing the
    slots at or before its position, and with a sliding window only the last `window` of them
    (the kernels' causal mask assumes the keys end where the queries end, which a partly filled
    cache does not)."""
    b, length, h, k = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(b, length, g, h // g, k)
    logits_BxGxRxLxS = jnp.einsum("blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxSxGxK,
                                  preferred_element_type=jnp.float32) * k ** -0.5
    visible_LxS = visible_keys(positions_L, jnp.arange(k_BxSxGxK.shape[1]), window)
    logits_BxGxRxLxS = jnp.where(visible_LxS, logits_BxGxRxLxS, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits_BxGxRxLxS, axis=-1).astype(v_BxSxGxK.dtype)
    out_BxLxGxRxK = jnp.einsum("bgrls,bsgk->blgrk", probs, v_BxSxGxK)
    return out_BxLxGxRxK.reshape(b, length, h, k)


def cached_attention(attn: Attention, x_BxLxD, cache: dict, position):
    """`Attention.__call__` against a cache holding positions 0..position-1 -> (out_BxLxD,
    {"k": k_BxLxGxK, "v": v_BxLxGxK}): the new rows, for the caller to write at `position`."""
    dt = x_BxLxD.dtype
    k_BxSxGxK, v_BxSxGxK = cache["k"], cache["v"]
    positions_L = position + jnp.arange(x_BxLxD.shape[1])
    q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = attn.project_qkv(x_BxLxD, positions_L)
    k_BxLxGxK, v_BxLxGxK = k_BxLxGxK.astype(k_BxSxGxK.dtype), v_BxLxGxK.astype(v_BxSxGxK.dtype)
    start = (0, position, 0, 0)
    k_BxSxGxK = jax.lax.dynamic_update_slice(k_BxSxGxK, k_BxLxGxK, start)
    v_BxSxGxK = jax.lax.dynamic_update_slice(v_BxSxGxK, v_BxLxGxK, start)
    out_BxLxHxK = masked_attention(q_BxLxHxK, k_BxSxGxK.astype(dt), v_BxSxGxK.astype(dt),
                                   positions_L, attn.cfg.sliding_window)
    out_BxLxD = attn.project_out(out_BxLxHxK)
    return out_BxLxD, {"k": k_BxLxGxK, "v": v_BxLxGxK}


def block_step(block: Block, x_BxLxD, cache: dict, position):
    """`Block.__call__` against one layer's cache -> (x_BxLxD, the new cache rows)."""
    attend = mla.cached_attention if isinstance(block.attn, mla.MLAttention) else cached_attention
    h_BxLxD, rows = attend(block.attn, block.attn_norm(x_BxLxD), cache, position)
    x_BxLxD = x_BxLxD + h_BxLxD
    h_BxLxD = block.mlp_norm(x_BxLxD)
    if block.is_moe:
        b, length, d = h_BxLxD.shape  # each token a sequence of its own: see the module doc
        y_BxLxD = block.mlp(h_BxLxD.reshape(b * length, 1, d))[0].reshape(b, length, d)
    else:
        y_BxLxD = block.mlp(h_BxLxD)
    return x_BxLxD + y_BxLxD, rows


def unit_blocks(unit) -> list[Block]:
    """The blocks of one stacked unit in execution order (a Block, or a BlockGroup's dense
    blocks then its MoE block)."""
    return [unit] if isinstance(unit, Block) else [*unit.dense, unit.sparse]


def _run_stack(stack, x_BxLxD, cache: dict, position, first: int):
    """One stack of units against the cache rows first.. -> (x, cache, the next stack's
    first row)."""
    graphdef, stacked = nnx.split(stack)
    units = jax.tree.leaves(stacked)[0].shape[0]
    per_unit = len(unit_blocks(nnx.merge(graphdef, jax.tree.map(lambda a: a[0], stacked))))

    def body(carry, layer):
        x, cache = carry  # each entry [N, B, S, ...]
        layer_state, unit_index = layer
        for j, block in enumerate(unit_blocks(nnx.merge(graphdef, layer_state))):
            n = first + unit_index * per_unit + j
            x, rows = block_step(block, x, {name: c[n] for name, c in cache.items()}, position)
            # Write back only the new rows: with the cache donated the update is in place.
            cache = {name: jax.lax.dynamic_update_slice(
                c, rows[name][None], (n, 0, position) + (0,) * (c.ndim - 3))
                for name, c in cache.items()}
        return (x, cache), None

    (x_BxLxD, cache), _ = jax.lax.scan(body, (x_BxLxD, cache), (stacked, jnp.arange(units)))
    return x_BxLxD, cache, first + units * per_unit


def forward_cached(model, cache: dict, tokens_BxL, position):
    """Tokens at positions position..position+L-1 -> (logits_BxLxV, cache with their rows).

    The cache must already hold positions 0..position-1 (prefill: position 0, empty cache)."""
    position = jnp.asarray(position, jnp.int32)
    x_BxLxD = embed(model.embedder, tokens_BxL, position)
    first = 0  # the cache's index of the stack's first layer
    for stack in ([model.dense_blocks] if hasattr(model, "dense_blocks") else []) + [model.blocks]:
        x_BxLxD, cache, first = _run_stack(stack, x_BxLxD, cache, position, first)
    logits_BxLxV = model.head(x_BxLxD, model.embedder.embed[...])
    return logits_BxLxV, cache
