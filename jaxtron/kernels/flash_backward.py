"""Flash attention's backward kernels, and the tile geometry both passes share.

FlashAttention-2 backward (Dao 2023, arXiv:2307.08691, Algorithm 2), split into two Pallas
kernels so that neither needs atomics:
  * `dq`: one program per (batch, query head, query block) walks the key blocks, like the forward;
  * `dk/dv`: one program per (batch, kv head, key block) walks the query blocks of every query
    head in its group, so grouped-query gradients are summed on chip and the [B, S, H, K]
    per-query-head dk/dv is never written out.
Both rebuild the probabilities p = exp(s - lse) from q, k and the forward's logsumexp instead of
storing the L x S matrix; delta = rowsum(dO * O) is the softmax-Jacobian term, with
ds = p * (dO v^T - delta).

The geometry lives here (not in `flash.py`) because `flash.py` imports this module: every mask
and loop bound is computed by the same functions in both passes, so the backward can never
visit a different set of tiles than the forward did. With a sliding window (query i sees keys
i - w < j <= i) the loops also start at the band: a query block walks only the key blocks that
hold some key of its band, a key block only the query blocks that can see it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Finite, so a fully masked tile gives exp(0) = 1 terms (discarded by the next correction)
# rather than exp(-inf - -inf) = NaN.
MASK_VALUE = float(jnp.finfo(jnp.float32).min)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static shape of one flash call: hashable, so it can be a custom_vjp nondiff argument."""
    block_q: int
    block_k: int
    q_len: int  # real lengths; the arrays the kernels see are padded to whole blocks
    kv_len: int
    q_padded: int
    kv_padded: int
    causal: bool
    segments: bool
    scale: float  # 1 / sqrt(real head dim), also when the head dim is padded for Triton
    interpret: bool  # True: run the grid as a loop of XLA ops (CPU); False: lower to Triton
    head_dim: int = 0  # padded head dim the kernels see (sizes the Triton launch)
    window: int | None = None  # sliding window (causal only): keys i + offset - window < j

    @property
    def compiler_params(self):
        """Triton launch parameters, given explicitly: a pallas_call without them lowers for
        NVIDIA GPUs through Mosaic GPU, which cannot take these kernels, and ROCm only has
        Triton. Four warps cover a 64-wide tile at head dims up to 64 (as in JAX's own Triton
        attention, `jax.experimental.pallas.ops.gpu.attention`); wider heads get eight so each
        warp's share of the fp32 accumulator stays in registers. Two stages double-buffer the
        key/value loads of the inner loop."""
        if self.interpret:
            return None
        return pltriton.CompilerParams(num_warps=4 if self.head_dim <= 64 else 8, num_stages=2)

    @property
    def num_q_blocks(self) -> int:
        return self.q_padded // self.block_q

    @property
    def num_k_blocks(self) -> int:
        return self.kv_padded // self.block_k

    @property
    def offset(self) -> int:
        """Query i sees keys j <= i + offset: bottom-right aligned, as in reference_attention."""
        return self.kv_len - self.q_len


def k_block_end(t: Tiling, q_block):
    """One past the last key block that query block `q_block` can see: the causal skip."""
    if not t.causal:
        return t.num_k_blocks
    last_visible = jnp.maximum((q_block + 1) * t.block_q + t.offset, 0)
    return jnp.minimum(lax.div(last_visible + t.block_k - 1, t.block_k), t.num_k_blocks)


def k_block_start(t: Tiling, q_block):
    """The first key block that query block `q_block` can see: the sliding window's skip."""
    if t.window is None:
        return 0
    first_visible = jnp.maximum(q_block * t.block_q + t.offset - t.window + 1, 0)
    return jnp.minimum(lax.div(first_visible, t.block_k), t.num_k_blocks)


def q_block_start(t: Tiling, k_block):
    """The first query block that can see key block `k_block`: the causal skip, transposed."""
    if not t.causal:
        return 0
    first_seeing = jnp.maximum(k_block * t.block_k - t.offset, 0)
    return jnp.minimum(lax.div(first_seeing, t.block_q), t.num_q_blocks)


def q_block_end(t: Tiling, k_block):
    """One past the last query block that can see key block `k_block`: the window, transposed."""
    if t.window is None:
        return t.num_q_blocks
    # query i sees key j while i < j - offset + window; the block's last key is the latest
    last_seeing = (k_block + 1) * t.block_k - 1 - t.offset + t.window - 1
    return jnp.clip(lax.div(last_seeing, t.block_q) + 1, 0, t.num_q_blocks)


def tile_mask(t: Tiling, q_block, k_block, seg_q=None, seg_k=None):
    """Which (query, key) pairs of one tile may attend; None when every pair may."""
    q_pos = q_block * t.block_q + jnp.arange(t.block_q)[:, None]
    k_pos = k_block * t.block_k + jnp.arange(t.block_k)[None, :]
    masks = []
    if t.kv_padded != t.kv_len:
        masks.append(k_pos < t.kv_len)
    if t.causal:
        masks.append(k_pos <= q_pos + t.offset)
    if t.window is not None:
        masks.append(k_pos > q_pos + t.offset - t.window)
    if t.segments:
        masks.append(seg_q[:, None] == seg_k[None, :])
    return functools.reduce(jnp.logical_and, masks) if masks else None


def dot(a, b, contract=(1, 0)):
    """a @ b contracting a's axis contract[0] with b's contract[1], accumulated in fp32."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           preferred_element_type=jnp.float32)


def probs(t: Tiling, q_QxK, k_CxK, lse_Q, q_block, k_block, seg_q, seg_k):
    """Recompute the forward's softmax tile p_QxC = exp(s - lse), exactly 0 where masked."""
    p_QxC = jnp.exp(dot(q_QxK, k_CxK, (1, 1)) * t.scale - lse_Q[:, None])
    mask = tile_mask(t, q_block, k_block, seg_q, seg_k)
    return p_QxC if mask is None else jnp.where(mask, p_QxC, 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, t: Tiling):
    """One query block of one head: dq = scale * sum_j ds_j k_j over the visible key blocks."""
    seg_q_ref, seg_k_ref, dq_ref = refs if t.segments else (None, None, *refs)
    q_block = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    seg_q = seg_q_ref[...] if t.segments else None

    def body(k_block, dq_QxK):
        keys = pl.ds(k_block * t.block_k, t.block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        seg_k = seg_k_ref[keys] if t.segments else None
        p = probs(t, q, k, lse, q_block, k_block, seg_q, seg_k)
        ds = p * (dot(do, v, (1, 1)) - delta[:, None])
        return dq_QxK + dot(ds.astype(k.dtype), k)

    dq_QxK = lax.fori_loop(k_block_start(t, q_block), k_block_end(t, q_block), body,
                           jnp.zeros(q_ref.shape, jnp.float32))
    dq_ref[...] = (dq_QxK * t.scale).astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, t: Tiling):
    """One key block of one kv head, summed over its R query heads and visible query blocks."""
    seg_q_ref, seg_k_ref, dk_ref, dv_ref = refs if t.segments else (None, None, *refs)
    k_block = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    seg_k = seg_k_ref[...] if t.segments else None
    group = q_ref.shape[1]  # q_ref is [L, R, K]: the query heads that share this kv head

    def head(r, carry):
        def body(q_block, carry):
            dk_CxK, dv_CxK = carry
            queries = pl.ds(q_block * t.block_q, t.block_q)
            q, do = q_ref[queries, r, :], do_ref[queries, r, :]
            seg_q = seg_q_ref[queries] if t.segments else None
            p = probs(t, q, k, lse_ref[r, queries], q_block, k_block, seg_q, seg_k)
            ds = p * (dot(do, v, (1, 1)) - delta_ref[r, queries][:, None])
            return (dk_CxK + dot(ds.astype(q.dtype), q, (0, 0)),
                    dv_CxK + dot(p.astype(do.dtype), do, (0, 0)))

        return lax.fori_loop(q_block_start(t, k_block), q_block_end(t, k_block), body, carry)

    zeros = jnp.zeros(k_ref.shape, jnp.float32)
    dk_CxK, dv_CxK = lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk_CxK * t.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_CxK.astype(dv_ref.dtype)


def flash_backward(t: Tiling, q, k, v, segments, out, lse_BxHxL, do):
    """Padded q/out/do_BxLxHxK, k/v_BxSxGxK, lse_BxHxL -> (dq, dk, dv) in the input dtypes."""
    batch, _, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    delta_BxHxL = jnp.einsum("blhk,blhk->bhl", do.astype(jnp.float32), out.astype(jnp.float32))
    seg_args = list(segments) if t.segments else []

    # dq: the forward's grid and blocks, plus dO / lse / delta blocks of the same query rows.
    q_block = pl.BlockSpec((None, t.block_q, None, head_dim), lambda b, h, i: (b, i, h, 0))
    kv_whole = pl.BlockSpec((None, t.kv_padded, None, head_dim),
                            lambda b, h, i: (b, 0, h // group, 0))
    row_block = pl.BlockSpec((None, None, t.block_q), lambda b, h, i: (b, h, i))
    seg_specs = [pl.BlockSpec((None, t.block_q), lambda b, h, i: (b, i)),
                 pl.BlockSpec((None, t.kv_padded), lambda b, h, i: (b, 0))]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, t=t),
        grid=(batch, heads, t.num_q_blocks),
        in_specs=[q_block, kv_whole, kv_whole, q_block, row_block, row_block,
                  *(seg_specs if t.segments else [])],
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=t.interpret,
        compiler_params=t.compiler_params,
        name="flash_attention_dq",
    )(q, k, v, do, lse_BxHxL, delta_BxHxL, *seg_args)

    # dk/dv: a kv head's block index g along the H axis, with block size R, selects exactly the
    # query heads g*R .. g*R+R-1 that read it.
    q_group = pl.BlockSpec((None, t.q_padded, group, head_dim), lambda b, g, j: (b, 0, g, 0))
    kv_block = pl.BlockSpec((None, t.block_k, None, head_dim), lambda b, g, j: (b, j, g, 0))
    row_group = pl.BlockSpec((None, group, t.q_padded), lambda b, g, j: (b, g, 0))
    seg_specs = [pl.BlockSpec((None, t.q_padded), lambda b, g, j: (b, 0)),
                 pl.BlockSpec((None, t.block_k), lambda b, g, j: (b, j))]
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, t=t),
        grid=(batch, kv_heads, t.num_k_blocks),
        in_specs=[q_group, kv_block, kv_block, q_group, row_group, row_group,
                  *(seg_specs if t.segments else [])],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=t.interpret,
        compiler_params=t.compiler_params,
        name="flash_attention_dkdv",
    )(q, k, v, do, lse_BxHxL, delta_BxHxL, *seg_args)
    return dq, dk, dv
