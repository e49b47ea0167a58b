"""Plain-jnp attention: the reference every other implementation is tested against.

Grouped-query attention is computed by folding the query heads of each kv group into an extra
axis, so k and v are never repeated in memory. Shapes: q_BxLxHxK, k/v_BxSxGxK with H = G * R;
v may have its own head dim (multi-head latent attention), the output then has v's.

Masks, all bottom-right aligned (query i stands at key position i + S - L):
  * causal: query i sees keys j <= i + S - L;
  * window w (sliding-window attention, Mistral's `sliding_window`, with causal): also
    j > i + S - L - w, so each query sees the w keys ending at its own position, itself
    included (Hugging Face's `kv_idx > q_idx - sliding_window`);
  * segment_ids_BxL (packed documents): only keys of the query's own document.
"""

import jax
import jax.numpy as jnp


def check_window(window: int | None, causal: bool) -> None:
    """Every kernel's guard: a window is a number of keys (at least one, the query's own) and
    only means something for causal attention."""
    if window is not None and (not causal or window < 1):
        raise ValueError(f"a sliding window needs causal attention and at least one key; got "
                         f"window={window}, causal={causal}.")


def visible_keys(q_pos_L, k_pos_S, window: int | None = None):
    """LxS: which keys (at true positions k_pos_S) each query (at q_pos_L) sees, causally and
    within the window; for callers that know positions rather than alignment (a KV cache, a
    gathered or chunked sequence)."""
    visible_LxS = k_pos_S[None, :] <= q_pos_L[:, None]
    if window is not None:
        visible_LxS &= k_pos_S[None, :] > q_pos_L[:, None] - window
    return visible_LxS


def reference_attention(q, k, v, *, causal: bool, segment_ids=None, window: int | None = None):
    check_window(window, causal)
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    q_BxLxGxRxK = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    scale = head_dim ** -0.5
    logits_BxGxRxLxS = jnp.einsum("blgrk,bsgk->bgrls", q_BxLxGxRxK, k,
                                  preferred_element_type=jnp.float32) * scale
    mask_LxS = jnp.ones((q_len, kv_len), dtype=bool)
    if causal:
        mask_LxS = jnp.tril(mask_LxS, k=kv_len - q_len)
    if window is not None:
        mask_LxS = jnp.triu(mask_LxS, k=kv_len - q_len - window + 1)
    mask = mask_LxS[None, None, None]
    if segment_ids is not None:
        same_BxLxS = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = mask & same_BxLxS[:, None, None]
    logits_BxGxRxLxS = jnp.where(mask, logits_BxGxRxLxS, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits_BxGxRxLxS, axis=-1).astype(v.dtype)
    out_BxLxGxRxK = jnp.einsum("bgrls,bsgk->blgrk", probs, v)
    return out_BxLxGxRxK.reshape(batch, q_len, num_heads, v.shape[-1])
