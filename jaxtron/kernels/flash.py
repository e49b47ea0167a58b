"""Flash attention in Pallas: tiled online softmax that never holds the L x S logits.

FlashAttention-2 (Dao 2023, arXiv:2307.08691): each program owns one block of queries of one
head, walks the key/value blocks with a running (max, sum, output) — the online softmax of
Milakov & Gimelshein 2018 — and writes out the output and the per-row logsumexp, which is all
the backward (`flash_backward.py`) needs to rebuild the probabilities tile by tile.

  * Grouped-query attention: query head h reads kv head h // R through the BlockSpec index map,
    so k and v are never repeated in memory (H = G * R).
  * Causal: a query block's key loop stops at its diagonal block, so the upper triangle is
    skipped, not computed and masked; only the diagonal tile is masked.
  * Sliding window (`window` w, causal only): query i sees keys i - w < j <= i; a query
    block's loop also starts at the first key block of its band, so the work is O(L w).
  * Packed documents: segment_ids_BxL mask pairs from different documents.
  * Any length: the wrapper pads to whole blocks, the kernels mask padded keys, the output is
    sliced back. Padding and slicing happen outside the custom_vjp, so JAX differentiates them.
  * fp32 or bf16 inputs; logits, softmax statistics and accumulators are fp32.

On NVIDIA and AMD GPUs the kernels lower through Triton, with its launch parameters given
explicitly (`Tiling.compiler_params`); on CPU, interpret mode runs the same kernels as a loop of
XLA ops over the grid (tests check numerics that way). Which of the two a call becomes is
decided when the program is lowered, not when it is traced (`jax.lax.platform_dependent`): one
jitted function lowers to Triton for `cuda` and `rocm` and to the interpreted loop for `cpu`,
whatever machine traces it. TPUs run JAX's splash attention instead (`splash.py`); the grid here
breaks Mosaic TPU's tiling rules. Inside the kernels Q and C name the query-block and key-block
lengths, e.g. s_QxC is one tile of logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from jaxtron.kernels.blockwise import ATTENTION_LSE, ATTENTION_OUT
from jaxtron.kernels.flash_backward import (
    MASK_VALUE,
    Tiling,
    dot,
    flash_backward,
    k_block_end,
    k_block_start,
    tile_mask,
)
from jaxtron.kernels.reference import check_window

# Interpret mode executes every grid step as a loop iteration on the host: small tiles keep
# CPU tests fast. On a GPU, 64-wide tiles fit the shared memory of every recent NVIDIA part
# for head dims up to 128 in both passes.
CPU_BLOCK = 16
GPU_BLOCK = 64
TRITON_MIN_DIM = 16  # tl.dot needs every matmul dimension >= 16


def _forward_kernel(q_ref, k_ref, v_ref, *refs, t: Tiling):
    """One query block of one head: online softmax over the visible key blocks."""
    seg_q_ref, seg_k_ref, o_ref, lse_ref = refs if t.segments else (None, None, *refs)
    q_block = pl.program_id(2)
    q_QxK = q_ref[...]
    seg_q = seg_q_ref[...] if t.segments else None

    def body(k_block, carry):
        o_QxK, m_Q, l_Q = carry  # unnormalised output, running row max, running row sum
        keys = pl.ds(k_block * t.block_k, t.block_k)
        k_CxK, v_CxK = k_ref[keys, :], v_ref[keys, :]
        s_QxC = dot(q_QxK, k_CxK, (1, 1)) * t.scale
        mask = tile_mask(t, q_block, k_block, seg_q, seg_k_ref[keys] if t.segments else None)
        if mask is not None:
            s_QxC = jnp.where(mask, s_QxC, MASK_VALUE)
        m_new = jnp.maximum(m_Q, s_QxC.max(axis=1))
        p_QxC = jnp.exp(s_QxC - m_new[:, None])
        correction = jnp.exp(m_Q - m_new)  # rescales what earlier blocks summed
        l_Q = l_Q * correction + p_QxC.sum(axis=1)
        o_QxK = o_QxK * correction[:, None] + dot(p_QxC.astype(v_CxK.dtype), v_CxK)
        return o_QxK, m_new, l_Q

    init = (jnp.zeros(q_ref.shape, jnp.float32), jnp.full((t.block_q,), MASK_VALUE, jnp.float32),
            jnp.zeros((t.block_q,), jnp.float32))
    o_QxK, m_Q, l_Q = lax.fori_loop(k_block_start(t, q_block), k_block_end(t, q_block), body,
                                    init)
    o_ref[...] = (o_QxK / l_Q[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m_Q + jnp.log(l_Q)


def _forward(t: Tiling, q, k, v, segments):
    """Padded q_BxLxHxK, k/v_BxSxGxK -> (out_BxLxHxK, lse_BxHxL fp32)."""
    batch, _, heads, head_dim = q.shape
    group = heads // k.shape[2]
    q_block = pl.BlockSpec((None, t.block_q, None, head_dim), lambda b, h, i: (b, i, h, 0))
    # The whole padded key sequence of this head's kv head; the kernel slices it block by
    # block, so a causal program never reads the blocks above its diagonal.
    kv_whole = pl.BlockSpec((None, t.kv_padded, None, head_dim),
                            lambda b, h, i: (b, 0, h // group, 0))
    seg_specs = [pl.BlockSpec((None, t.block_q), lambda b, h, i: (b, i)),
                 pl.BlockSpec((None, t.kv_padded), lambda b, h, i: (b, 0))]
    return pl.pallas_call(
        functools.partial(_forward_kernel, t=t),
        grid=(batch, heads, t.num_q_blocks),
        in_specs=[q_block, kv_whole, kv_whole, *(seg_specs if t.segments else [])],
        out_specs=[q_block, pl.BlockSpec((None, None, t.block_q), lambda b, h, i: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, t.q_padded), jnp.float32)],
        interpret=t.interpret,
        compiler_params=t.compiler_params,
        name="flash_attention_forward",
    )(q, k, v, *(segments if t.segments else ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(t: Tiling, q, k, v, segments):
    return _forward(t, q, k, v, segments)[0]


def _flash_fwd(t: Tiling, q, k, v, segments):
    out, lse_BxHxL = _forward(t, q, k, v, segments)
    # Named so that `remat: save_dots` keeps them rather than running the kernel again.
    out, lse_BxHxL = checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse_BxHxL,
                                                                          ATTENTION_LSE)
    return out, (q, k, v, segments, out, lse_BxHxL)


def _flash_bwd(t: Tiling, residuals, do):
    q, k, v, segments, out, lse_BxHxL = residuals
    dq, dk, dv = flash_backward(t, q, k, v, segments, out, lse_BxHxL, do)
    return dq, dk, dv, None  # segment ids are integers: no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)


def _block(requested: int | None, length: int, interpret: bool) -> int:
    """The tile length: the default for the backend, no longer than the padded sequence."""
    block = requested or (CPU_BLOCK if interpret else GPU_BLOCK)
    block = min(block, pl.next_power_of_2(length))
    return block if interpret else max(block, TRITON_MIN_DIM)


def _pad_axis(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def flash_attention(q, k, v, *, causal: bool, segment_ids=None, block_q: int | None = None,
                    block_k: int | None = None, interpret: bool | None = None,
                    window: int | None = None):
    """q_BxLxHxK, k/v_BxSxGxK -> out_BxLxHxK in q.dtype (G divides H: grouped-query attention).

    segment_ids_BxL (int32, needs L == S) restricts attention to tokens of the same packed
    document. Causal masking is bottom-right aligned when L != S, like reference_attention;
    `window` (causal only) keeps the last `window` keys up to each query's own position.
    Block sizes default to 16 in interpret mode and 64 under Triton. interpret=None leaves the
    choice to lowering: Triton for cuda and rocm, interpret mode for any other platform.
    """
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if (heads % kv_heads or k.shape != v.shape or k.shape[0] != batch
            or k.shape[3] != head_dim):
        raise ValueError(f"flash_attention needs q_BxLxHxK and k/v_BxSxGxK with G dividing H; "
                         f"got q {q.shape}, k {k.shape}, v {v.shape}.")
    if segment_ids is not None and (segment_ids.shape != (batch, q_len) or kv_len != q_len):
        raise ValueError(f"segment_ids must be [batch, length] = {(batch, q_len)} for "
                         f"self-attention; got {segment_ids.shape} with {kv_len} keys.")
    if causal and q_len > kv_len:
        raise ValueError(f"causal flash_attention with {q_len} queries but {kv_len} keys: the "
                         "first queries would have no key to attend to.")
    check_window(window, causal)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    call = functools.partial(_padded_flash, causal=causal, block_q=block_q, block_k=block_k,
                             window=window)
    if interpret is not None:
        return call(q, k, v, segment_ids, interpret=interpret)
    triton = functools.partial(call, interpret=False)
    return lax.platform_dependent(q, k, v, segment_ids, cuda=triton, rocm=triton,
                                  default=functools.partial(call, interpret=True))


def _padded_flash(q, k, v, segment_ids, *, causal: bool, block_q, block_k, interpret: bool,
                  window: int | None):
    """Pad to whole tiles (and, for Triton, to a power-of-two head dim), run, slice back."""
    q_len, head_dim, kv_len = q.shape[1], q.shape[3], k.shape[1]
    bq, bk = _block(block_q, q_len, interpret), _block(block_k, kv_len, interpret)
    # Triton tiles must be powers of two and >= 16 wide: zero head-dim columns change no logit
    # (q.k sums over them) and give zero output columns, which are sliced off.
    dim = head_dim if interpret else max(pl.next_power_of_2(head_dim), TRITON_MIN_DIM)
    t = Tiling(block_q=bq, block_k=bk, q_len=q_len, kv_len=kv_len,
               q_padded=pl.cdiv(q_len, bq) * bq, kv_padded=pl.cdiv(kv_len, bk) * bk,
               causal=causal, segments=segment_ids is not None, scale=head_dim ** -0.5,
               interpret=interpret, head_dim=dim, window=window)
    q = _pad_axis(_pad_axis(q, 1, t.q_padded), 3, dim)
    k, v = (_pad_axis(_pad_axis(x, 1, t.kv_padded), 3, dim) for x in (k, v))
    segments = None
    if segment_ids is not None:
        # Padded keys are masked by position already; -1 just keeps them out of every document.
        segments = (_pad_axis(segment_ids, 1, t.q_padded, -1),
                    _pad_axis(segment_ids, 1, t.kv_padded, -1))
    return _flash(t, q, k, v, segments)[:, :q_len, :, :head_dim]
