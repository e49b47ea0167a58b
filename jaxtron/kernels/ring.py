"""Ring attention over the `sequence` mesh axis (context parallelism), causal load-balanced.

Each of the n devices holds 2L/2n = 2c query, key and value positions. Keys and values travel
round the ring with `ppermute` while every device folds each visiting block into an online
softmax (Liu et al. 2023, "Ring Attention with Blockwise Transformers"). Only k/v blocks move;
no device ever holds the full sequence.

Causal balance uses the zig-zag order (as in Megatron-LM's context parallelism): the sequence
is cut into 2n chunks and device i holds chunks i and 2n-1-i. Then at every ring step after the
first, exactly half of a block is visible — either all queries see the first visiting chunk, or
only the second local chunk sees both — so every device does the same work at every step and
the masked half is skipped rather than computed and discarded.

Only the `sequence` axis is manual inside the shard_map: batch and heads stay sharded by GSPMD
over data, fsdp and tensor. Gradients come from differentiating the ring (the transpose of a
ppermute is the reverse ppermute).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

AXIS = "sequence"
NEG = jnp.finfo(jnp.float32).min


def to_zigzag(x_BxL, n: int):
    """Reorder axis 1 so that consecutive blocks of 2c hold chunks (i, 2n-1-i)."""
    b, length, rest = x_BxL.shape[0], x_BxL.shape[1], x_BxL.shape[2:]
    c = length // (2 * n)
    halves = x_BxL.reshape(b, 2, n, c, *rest)
    paired = jnp.stack([halves[:, 0], jnp.flip(halves[:, 1], axis=1)], axis=2)
    return paired.reshape(b, length, *rest)


def from_zigzag(x_BxL, n: int):
    b, length, rest = x_BxL.shape[0], x_BxL.shape[1], x_BxL.shape[2:]
    c = length // (2 * n)
    paired = x_BxL.reshape(b, n, 2, c, *rest)
    halves = jnp.concatenate([paired[:, :, 0], jnp.flip(paired[:, :, 1], axis=1)], axis=1)
    return halves.reshape(b, length, *rest)


def _fold(carry, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_LxS=None):
    """Fold one key/value block into the running (output, max, sum) of an online softmax."""
    o, m, l = carry  # o_BxLxHxK (fp32, unnormalised), m/l_BxLxH
    b, q_len, heads, dim = q_BxLxHxK.shape
    kv_len, groups = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(b, q_len, groups, heads // groups, dim)
    s = jnp.einsum("blgrk,bsgk->blgrs", q_BxLxGxRxK, k_BxSxGxK,
                   preferred_element_type=jnp.float32) * dim ** -0.5
    if mask_LxS is not None:
        s = jnp.where(mask_LxS[None, :, None, None, :], s, NEG)
    s_BxLxHxS = s.reshape(b, q_len, heads, kv_len)
    m_new = jnp.maximum(m, s_BxLxHxS.max(axis=-1))
    p = jnp.exp(s_BxLxHxS - m_new[..., None])
    correction = jnp.exp(m - m_new)
    l_new = l * correction + p.sum(axis=-1)
    p_BxLxGxRxS = p.reshape(b, q_len, groups, heads // groups, kv_len).astype(v_BxSxGxK.dtype)
    pv = jnp.einsum("blgrs,bsgk->blgrk", p_BxLxGxRxS, v_BxSxGxK,
                    preferred_element_type=jnp.float32).reshape(o.shape)
    return o * correction[..., None] + pv, m_new, l_new


def _ring(q, k, v, *, n: int, causal: bool):
    """Per-device body: q/k/v hold this device's two zig-zag chunks (2c positions)."""
    me = jax.lax.axis_index(AXIS)
    c = q.shape[1] // 2
    b, length, heads, _ = q.shape
    carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((b, length, heads), NEG, jnp.float32),
             jnp.zeros((b, length, heads), jnp.float32))

    def positions(device):
        return jnp.concatenate([device * c + jnp.arange(c), (2 * n - 1 - device) * c +
                                jnp.arange(c)])

    own_mask = positions(me)[:, None] >= positions(me)[None, :] if causal else None
    carry = _fold(carry, q, k, v, own_mask)
    ring = [(s, (s + 1) % n) for s in range(n)]
    for step in range(1, n):
        k, v = jax.lax.ppermute((k, v), AXIS, ring)
        if not causal:
            carry = _fold(carry, q, k, v)
            continue
        source = (me - step) % n

        def earlier(carry, k=k, v=v):  # every local query sees the visiting first chunk
            return _fold(carry, q, k[:, :c], v[:, :c])

        def later(carry, k=k, v=v):  # only the second local chunk sees the visitor, all of it
            o, m, l = carry
            tail = _fold((o[:, c:], m[:, c:], l[:, c:]), q[:, c:], k, v)
            return tuple(jnp.concatenate([x[:, :c], t], axis=1) for x, t in zip(carry, tail))

        carry = jax.lax.cond(source < me, earlier, later, carry)
    o, _, l = carry
    return (o / l[..., None]).astype(q.dtype)


def ring_attention(q, k, v, *, mesh: Mesh, causal: bool = True):
    """q_BxLxHxK, k/v_BxLxGxK, sequence-sharded over `mesh`'s `sequence` axis."""
    n = mesh.shape[AXIS]
    if q.shape[1] % (2 * n):
        raise ValueError(f"ring attention needs the sequence length {q.shape[1]} to be a "
                         f"multiple of 2 x mesh.sequence = {2 * n} (zig-zag chunks).")
    spec = PartitionSpec(None, AXIS)
    body = jax.shard_map(functools.partial(_ring, n=n, causal=causal), mesh=mesh,
                         in_specs=(spec, spec, spec), out_specs=spec, axis_names={AXIS})
    out = body(to_zigzag(q, n), to_zigzag(k, n), to_zigzag(v, n))
    return from_zigzag(out, n)
