"""Fused output projection + cross-entropy that never holds the [B, L, V] logits.

With a large vocabulary the logits dominate activation memory: 16k tokens x 128k vocabulary is
8 GiB in fp32, plus as much again for their gradient. Like Liger Kernel's fused linear
cross-entropy (Hsu et al. 2024, arXiv:2410.10989) and Apple's Cut Cross-Entropy (Wijmans et al.
2024, arXiv:2411.09009), we walk the tokens in chunks with `lax.scan`: each step computes one
chunk's logits, keeps only its logsumexp and target logit, and drops the rest. A `custom_vjp`
makes the backward do the same: it recomputes each chunk's logits and turns them straight into
that chunk's d_x and its contribution to d_head (softmax - onehot), so it never holds [T, V]
either. The price is one extra [T, D] x [D, V] matmul (the recompute), ~1/3 more head FLOPs.

Chunks are strided, not contiguous: chunk j holds positions j, j + N, j + 2N, ... of every row.
A sequence split in contiguous blocks over the mesh (context or sequence parallelism), and a
batch split over the data axes, therefore stay split inside every chunk: the scan walks an axis
no device owns a part of, so slicing a chunk moves no data and every device computes only its
own tokens. A head sharded over the vocabulary works through GSPMD unchanged: the logsumexp
and the target logit are reductions over V (the target logit is a masked sum rather than a
gather for that reason), so only [B, C] statistics cross devices, as in `cross_entropy_loss`.

Summing d_head over chunks is where a naive loop loses: under GSPMD each chunk's x^T @ d_logits,
contracted over tokens split across the batch (and sequence) mesh axes, would be all-reduced
inside the loop, N times the traffic of the unfused loss. So the accumulator keeps one partial
sum per token shard, d_head[P, S, D, V] split like the tokens (P batch shards, S sequence shards,
read from the active sharding rules): every device adds only its own tokens' contribution, and
the one reduction over P and S happens after the loop.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxtron.sharding.rules import active_mesh, active_spec

# Global tokens per chunk (all batch rows together). The live chunk costs about three fp32
# [chunk_tokens / token_shards, V / vocab_shards] buffers in the backward (logits, softmax,
# its gradient): 2048 tokens x 128k vocabulary on one device is ~3 GiB, against ~2 x 4 bytes x
# T x V for the unfused loss's logits and their gradient.
DEFAULT_CHUNK_TOKENS = 2048


def _logits(x_BxCxD, head_DxV):
    """One chunk's logits in x's dtype with fp32 accumulation, returned in fp32."""
    return jnp.einsum("bcd,dv->bcv", x_BxCxD, head_DxV, preferred_element_type=jnp.float32)


def _is_target(targets_BxC, vocab: int):
    # A comparison with an iota, not a gather: it partitions over a vocab-sharded V.
    return targets_BxC[..., None] == jnp.arange(vocab, dtype=targets_BxC.dtype)


def _forward(x_NxBxCxD, head_DxV, targets_NxBxC, weights_NxBxC):
    """(weighted NLL summed per row, fp32 [B]; logsumexp_NxBxC fp32 for the backward)."""
    head = head_DxV.astype(x_NxBxCxD.dtype)

    def chunk(nll_B, xs):
        x_BxCxD, targets_BxC, weights_BxC = xs
        logits_BxCxV = _logits(x_BxCxD, head)
        lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
        target_BxC = jnp.sum(jnp.where(_is_target(targets_BxC, head.shape[1]), logits_BxCxV,
                                       0.0), axis=-1)
        # Per-row sums stay split like the batch: no collective per chunk for the loss either.
        return nll_B + jnp.sum((lse_BxC - target_BxC) * weights_BxC, axis=1), lse_BxC

    nll_B = jnp.zeros(x_NxBxCxD.shape[1], jnp.float32)
    return lax.scan(chunk, nll_B, (x_NxBxCxD, targets_NxBxC, weights_NxBxC))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _nll_sum(shards, x_NxBxCxD, head_DxV, targets_NxBxC, weights_NxBxC):
    return jnp.sum(_forward(x_NxBxCxD, head_DxV, targets_NxBxC, weights_NxBxC)[0])


def _nll_sum_fwd(shards, x_NxBxCxD, head_DxV, targets_NxBxC, weights_NxBxC):
    nll_B, lse_NxBxC = _forward(x_NxBxCxD, head_DxV, targets_NxBxC, weights_NxBxC)
    # Residuals are the inputs plus T fp32 statistics: nothing of size V beyond the head.
    return jnp.sum(nll_B), (x_NxBxCxD, head_DxV, targets_NxBxC, weights_NxBxC, lse_NxBxC)


def _nll_sum_bwd(shards, residuals, g):
    x_NxBxCxD, head_DxV, targets_NxBxC, weights_NxBxC, lse_NxBxC = residuals
    dtype = x_NxBxCxD.dtype
    head = head_DxV.astype(dtype)
    batch_shards, seq_shards = shards
    _, batch, length, dim = x_NxBxCxD.shape

    def by_shard(a_BxCx):
        """[B, C, ...] -> [P, B/P, S, C/S, ...]: device-local tokens share (p, s) indices."""
        return a_BxCx.reshape(batch_shards, batch // batch_shards, seq_shards,
                              length // seq_shards, *a_BxCx.shape[2:])

    def chunk(d_head_PxSxDxV, xs):
        x_BxCxD, targets_BxC, weights_BxC, lse_BxC = xs
        probs_BxCxV = jnp.exp(_logits(x_BxCxD, head) - lse_BxC[..., None])
        d_logits = probs_BxCxV - _is_target(targets_BxC, head.shape[1])
        # The matmuls take their inputs in x's dtype, as the unfused loss's backward does.
        d_logits_BxCxV = (d_logits * (g * weights_BxC)[..., None]).astype(dtype)
        d_x_BxCxD = jnp.einsum("bcv,dv->bcd", d_logits_BxCxV, head,
                               preferred_element_type=jnp.float32).astype(dtype)
        # p and s are batch dimensions of this matmul, so the sum over tokens stays local.
        d_head_PxSxDxV = d_head_PxSxDxV + jnp.einsum(
            "pbscd,pbscv->psdv", by_shard(x_BxCxD), by_shard(d_logits_BxCxV),
            preferred_element_type=jnp.float32)
        return d_head_PxSxDxV, d_x_BxCxD

    # d_head is summed over chunks in fp32, whatever the parameter dtype.
    zeros = jnp.zeros((batch_shards, seq_shards, *head.shape), jnp.float32)
    zeros = _split_like_tokens(zeros, shards)
    d_head_PxSxDxV, d_x_NxBxCxD = lax.scan(
        chunk, zeros, (x_NxBxCxD, targets_NxBxC, weights_NxBxC, lse_NxBxC))
    d_head_DxV = jnp.sum(d_head_PxSxDxV, axis=(0, 1)).astype(head_DxV.dtype)
    # Targets are integers and weights are masks: neither gets a gradient.
    return d_x_NxBxCxD, d_head_DxV, None, None


_nll_sum.defvjp(_nll_sum_fwd, _nll_sum_bwd)


def _token_shards(batch: int, positions: int) -> tuple[int, int]:
    """How many ways the active rules split the batch and each chunk's C positions (1, 1 when
    no mesh is active, or when a split would not divide evenly: then GSPMD reduces per chunk)."""
    mesh, spec = active_mesh(), active_spec(("batch", "seq"))
    if mesh is None:
        return 1, 1

    def ways(entry, size):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        n = math.prod(mesh.shape[a] for a in axes)
        return n if size % n == 0 else 1

    return ways(spec[0], batch), ways(spec[1], positions)


def _split_like_tokens(a_PxSx, shards: tuple[int, int]):
    """Pin a [P, S, ...] accumulator's leading axes to the mesh axes that split the tokens; the
    rest (D, and V when the head is vocab-parallel) is left to GSPMD to match the head."""
    mesh = active_mesh()
    if mesh is None:
        return a_PxSx
    spec = active_spec(("batch", "seq"))
    entries = [entry if ways > 1 else None for entry, ways in zip(spec, shards)]
    free = [PartitionSpec.UNCONSTRAINED] * (a_PxSx.ndim - 2)
    return lax.with_sharding_constraint(a_PxSx, NamedSharding(mesh, PartitionSpec(*entries,
                                                                                  *free)))


def _to_chunks(a_BxL, chunks: int, padded: int, value=0):
    """[B, L, ...] -> [N, B, C, ...]: chunk j takes positions j, j + N, j + 2N, ... of each row."""
    batch, length, rest = a_BxL.shape[0], a_BxL.shape[1], a_BxL.shape[2:]
    if padded != length:
        widths = [(0, 0)] * a_BxL.ndim
        widths[1] = (0, padded - length)
        a_BxL = jnp.pad(a_BxL, widths, constant_values=value)
    a_BxCxN = a_BxL.reshape(batch, padded // chunks, chunks, *rest)
    return jnp.moveaxis(a_BxCxN, 2, 0)


def chunked_cross_entropy(x_BxLxD, head_DxV, targets_BxL, *, weights_BxL=None,
                          denominator=None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
    """Mean fp32 cross-entropy of the logits x @ head against targets, without the logits.

    Equals `cross_entropy_loss(x_BxLxD @ head_DxV.astype(x.dtype), targets_BxL, weights_BxL)`
    (the logits here are accumulated and kept in fp32 rather than rounded to x's dtype first).
    Tokens are processed about `chunk_tokens` at a time, counted over the whole batch: the
    sequence is cut into N = ceil(B * L / chunk_tokens) strided chunks of C = ceil(L / N)
    positions per row (zero-weight padding when N does not divide L; at least one position per
    row). Gradients flow to x and head; weights_BxL (optional, e.g. a loss mask) gets none.
    The weighted sum is divided by `denominator` (default: the sum of the weights).
    """
    batch, length, dim = x_BxLxD.shape
    if head_DxV.ndim != 2 or head_DxV.shape[0] != dim or targets_BxL.shape != (batch, length):
        raise ValueError(f"chunked_cross_entropy needs x_BxLxD, head_DxV and targets_BxL; got x "
                         f"{x_BxLxD.shape}, head {head_DxV.shape}, targets {targets_BxL.shape}.")
    if weights_BxL is not None and weights_BxL.shape != (batch, length):
        raise ValueError(f"weights_BxL must be {(batch, length)}; got {weights_BxL.shape}.")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive; got {chunk_tokens}.")
    chunks = min(length, -(-batch * length // chunk_tokens))
    padded = -(-length // chunks) * chunks
    # Sequence shards line up with whole groups of a chunk's positions only without padding.
    shards = _token_shards(batch, padded // chunks if padded == length else 1)
    weights = (jnp.ones((batch, length), jnp.float32) if weights_BxL is None
               else weights_BxL.astype(jnp.float32))
    to_chunks = functools.partial(_to_chunks, chunks=chunks, padded=padded)
    total = _nll_sum(shards, to_chunks(x_BxLxD), head_DxV,
                     to_chunks(targets_BxL.astype(jnp.int32)), to_chunks(weights))
    if weights_BxL is None:
        return total / (batch * length)
    if denominator is None:
        denominator = jnp.maximum(jnp.sum(weights), 1.0)
    return total / denominator
