"""TPU attention: JAX's maintained splash attention kernel, in jaxtron's layout and semantics.

Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`, the kernel MaxText runs on
TPUs) is a flash-attention forward and backward in Mosaic TPU that skips fully masked blocks
from a mask description built at trace time. This module only adapts it:

  * layout: jaxtron passes q_BxLxHxK, k/v_BxSxGxK; splash takes one example as q_HxLxK,
    k/v_GxSxK (grouped-query attention natively, H a multiple of G), so heads move first and
    the batch is vmapped;
  * scale: splash computes softmax(q k^T) without 1/sqrt(K); q is scaled first (as MaxText does);
  * lengths: TPU tiles are 128 lanes wide, so sequences are padded to whole blocks. Padded keys
    are masked by segment ids (padding is its own segment) unless causality already hides them
    from every real query; padded query rows are sliced off;
  * causal masks are bottom-right aligned when L != S, like `reference_attention`; a sliding
    window is splash's LocalMask with window (w - 1, 0): keys i - w < j <= i, from which splash
    builds its block-sparse schedule, so blocks outside the band are skipped;
  * the output and log-sum-exp carry ATTENTION_OUT's checkpoint name, so `remat: save_dots`
    keeps them as it does for the other kernels.

`interpret=True` runs the same kernels on CPU through Pallas' TPU interpreter: that is how the
tests check its numbers against the reference without a TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from jaxtron.kernels.blockwise import ATTENTION_OUT
from jaxtron.kernels.reference import check_window

LANES = 128  # a TPU vector register's lane count: the smallest legal key block
MAX_BLOCK = 512  # splash's blocks at long lengths (MaxText's default sa_block_* sizes)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def block_size(length: int, largest: int = MAX_BLOCK) -> int:
    """The tile length for a sequence of `length`: up to `largest`, a multiple of 128."""
    return min(largest, _round_up(length, LANES))


def _kernel(heads: int, q_len: int, kv_len: int, bq: int, bkv: int, q_padded: int,
            kv_padded: int, causal: bool, interpret: bool, window: int | None = None):
    if window is not None:  # left w - 1 keys, right none: causal within the band
        mask = splash.LocalMask((q_padded, kv_padded), (window - 1, 0), offset=kv_len - q_len)
    elif causal:
        # Query i sees keys j <= i + (S - L): bottom-right aligned.
        mask = splash.CausalMask((q_padded, kv_padded), offset=kv_len - q_len)
    else:
        mask = splash.FullMask((q_padded, kv_padded))
    blocks = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                               block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                               block_q_dq=bq, block_kv_dq=bkv)
    return splash.make_splash_mha(splash.MultiHeadMask([mask] * heads), block_sizes=blocks,
                                  head_shards=1, q_seq_shards=1,
                                  residual_checkpoint_name=ATTENTION_OUT, interpret=interpret)


def splash_attention(q, k, v, *, causal: bool, segment_ids=None, interpret: bool = False,
                     max_block: int = MAX_BLOCK, window: int | None = None):
    """q_BxLxHxK, k/v_BxSxGxK -> out_BxLxHxK (G divides H); segment_ids_BxL needs L == S.
    `max_block` (a multiple of 128) caps the tile length, e.g. to test several blocks;
    `window` (causal only): query i sees keys i - window < j <= i."""
    check_window(window, causal)
    batch, q_len, heads, head_dim = q.shape
    kv_len = k.shape[1]
    bq, bkv = block_size(q_len, max_block), block_size(kv_len, max_block)
    q_padded, kv_padded = _round_up(q_len, bq), _round_up(kv_len, bkv)
    # Causal and equal lengths: padded keys come after every real query, so causality hides
    # them. Otherwise padding needs its own segment.
    pad_keys = kv_padded != kv_len and not (causal and q_len == kv_len and q_padded == kv_padded)
    segments = None
    if segment_ids is not None or pad_keys:
        ids_q = (segment_ids if segment_ids is not None
                 else jnp.zeros((batch, q_len), jnp.int32)).astype(jnp.int32)
        ids_kv = ids_q if segment_ids is not None else jnp.zeros((batch, kv_len), jnp.int32)
        # Padding gets a segment id below every real one: it attends only to itself.
        pad_id = jnp.iinfo(jnp.int32).min
        segments = (jnp.pad(ids_q, ((0, 0), (0, q_padded - q_len)), constant_values=pad_id),
                    jnp.pad(ids_kv, ((0, 0), (0, kv_padded - kv_len)),
                            constant_values=pad_id))
    kernel = _kernel(heads, q_len, kv_len, bq, bkv, q_padded, kv_padded, causal, interpret,
                     window)
    q = (q * jnp.asarray(head_dim ** -0.5, q.dtype))
    q_BxHxLxK = jnp.pad(q, ((0, 0), (0, q_padded - q_len), (0, 0), (0, 0))).swapaxes(1, 2)
    k_BxGxSxK, v_BxGxSxK = (jnp.pad(x, ((0, 0), (0, kv_padded - kv_len), (0, 0), (0, 0)))
                            .swapaxes(1, 2) for x in (k, v))
    if segments is None:
        out = jax.vmap(kernel)(q_BxHxLxK, k_BxGxSxK, v_BxGxSxK)
    else:
        def one(q, k, v, ids_q, ids_kv):
            return kernel(q, k, v, segment_ids=splash.SegmentIds(q=ids_q, kv=ids_kv))

        out = jax.vmap(one)(q_BxHxLxK, k_BxGxSxK, v_BxGxSxK, *segments)
    return out.swapaxes(1, 2)[:, :q_len]
