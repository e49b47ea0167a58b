"""Ring attention over the `sequence` mesh axis (context parallelism), causal load-balanced.

Each of the n devices holds 2L/2n = 2c query, key and value positions. Keys and values travel
round the ring with `ppermute` while every device folds each visiting block into an online
softmax (Liu et al. 2023, "Ring Attention with Blockwise Transformers"). Only k/v blocks move;
no device ever holds the full sequence.

Causal balance uses the zig-zag order (as in Megatron-LM's context parallelism): the sequence
is cut into 2n chunks and device i holds chunks i and 2n-1-i. Then at every ring step after the
first, exactly half of a block is visible — either all queries see the first visiting chunk, or
only the second local chunk sees both — so every device does the same work at every step and
the masked half is skipped rather than computed and discarded. At the first step (its own
block) chunk i sees itself causally and chunk 2n-1-i sees chunk i whole and itself causally:
two bottom-right-aligned causal blocks.

Memory is that of flash attention (Dao et al. 2022; FlashAttention-2 for the backward), as in
Megatron / TransformerEngine context parallelism: a `custom_vjp` keeps only the local q, k, v,
the output and the log-sum-exp per row. The backward runs the ring again: k/v blocks travel as
in the forward, each block's probabilities are recomputed from q, k and the saved log-sum-exp
(p = exp(s - lse)), dq accumulates on the device, and the dk/dv accumulators travel with their
k/v block, one more hop at the end bringing each home. Within a ring step the keys are taken in
tiles of at most `key_tile` columns (about TILE_PAIRS query-key pairs per row block), so the
fp32 scores alive at once grow with the local length L/n, never with its square: per device the
kernel holds what one device holds at L/n. Output and log-sum-exp carry the checkpoint names
ATTENTION_RESIDUALS, so `remat: save_dots` keeps them instead of running the ring forward again.

Only the `sequence` axis is manual inside the shard_map: batch and heads stay sharded by GSPMD
over data, fsdp and tensor.

Inputs in natural order are put in zig-zag order on entry and the output back on exit: four
permutations across the ring in every layer. A train step avoids them by putting its tokens,
targets and positions in zig-zag order once (`jaxtron.sharding.zigzag`); attention then passes
`zigzag=True` and nothing is permuted here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec

from jaxtron.kernels.blockwise import ATTENTION_LSE, ATTENTION_OUT
from jaxtron.sharding.rules import shard_map_mesh
from jaxtron.sharding.zigzag import from_zigzag, to_zigzag

AXIS = "sequence"
NEG = float(jnp.finfo(jnp.float32).min)  # finite: exp(NEG - NEG) is 1, never NaN
# Query-key pairs per (batch row, head) of one score tile, and the narrowest key tile: with
# 2c local rows a tile is max(128, 2^16 / 2c) keys wide, so the fp32 scores (and the
# probabilities and their gradient, in the backward) grow linearly with the local length.
TILE_PAIRS = 2 ** 16
MIN_KEY_TILE = 128


def key_tile(rows: int, keys: int) -> int:
    """Keys per score tile for `rows` queries against `keys` keys: the widest divisor of
    `keys` up to max(MIN_KEY_TILE, TILE_PAIRS / rows)."""
    target = max(MIN_KEY_TILE, TILE_PAIRS // rows)
    return max(d for d in range(1, min(keys, target) + 1) if keys % d == 0)


# --- per-device blocks ----------------------------------------------------------------------
# Layout inside the ring: q/o_BxGxRxLxK (each kv group's query heads beside each other),
# k/v_BxGxSxK, statistics m/l/lse/delta_BxGxRxL. `causal` blocks are bottom-right aligned:
# query row r sees key s <= r + S - L.


def _heads_first(q_BxLxHxK, groups: int):
    b, length, heads, dim = q_BxLxHxK.shape
    return q_BxLxHxK.reshape(b, length, groups, heads // groups, dim).transpose(0, 2, 3, 1, 4)


def _heads_last(x_BxGxRxLxK):
    b, g, r, length, dim = x_BxGxRxLxK.shape
    return x_BxGxRxLxK.transpose(0, 3, 1, 2, 4).reshape(b, length, g * r, dim)


def _tiles(q, k, causal: bool):
    """(tile width, count, scores(j, k_tile) -> masked fp32 scores, mask(j) or None)."""
    rows, keys, scale = q.shape[3], k.shape[2], q.shape[-1] ** -0.5
    width = key_tile(rows, keys)

    def mask(j):
        if not causal:
            return None
        cols = j * width + jnp.arange(width)
        return cols[None, :] <= jnp.arange(rows)[:, None] + (keys - rows)

    def scores(j, k_tile):
        s = jnp.einsum("bgrlk,bgsk->bgrls", q, k_tile,
                       preferred_element_type=jnp.float32) * scale
        return s if not causal else jnp.where(mask(j), s, NEG)

    return width, keys // width, scores, mask


def _varying(*xs):
    """Fresh accumulators, marked as differing between the devices of the ring (as the values
    added to them do), so loop carries and both branches of a cond agree on their type."""
    return tuple(lax.pcast(x, AXIS, to="varying") for x in xs)


def _loop(count: int, body, carry):
    return body(0, carry) if count == 1 else lax.fori_loop(0, count, body, carry)


def _fold(state, q, k, v, causal: bool):
    """Fold the keys k/v into the online softmax state (o fp32 unnormalised, max m, sum l)."""
    width, count, scores, mask = _tiles(q, k, causal)

    def body(j, state):
        o, m, l = state
        k_tile, v_tile = (lax.dynamic_slice_in_dim(x, j * width, width, axis=2) for x in (k, v))
        s = scores(j, k_tile)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        if causal:
            p = jnp.where(mask(j), p, 0.0)
        correction = jnp.exp(m - m_new)
        pv = jnp.einsum("bgrls,bgsk->bgrlk", p.astype(v.dtype), v_tile,
                        preferred_element_type=jnp.float32)
        return o * correction[..., None] + pv, m_new, l * correction + p.sum(axis=-1)

    return _loop(count, body, state)


def _grads(acc, q, k, v, d_out, lse, delta, causal: bool):
    """Add this block's (dq, dk, dv) to acc: p = exp(s - lse), ds = p (dO v^T - delta)."""
    width, count, scores, mask = _tiles(q, k, causal)
    scale = q.shape[-1] ** -0.5

    def body(j, acc):
        dq, dk, dv = acc
        k_tile, v_tile = (lax.dynamic_slice_in_dim(x, j * width, width, axis=2) for x in (k, v))
        p = jnp.exp(scores(j, k_tile) - lse[..., None])
        if causal:
            p = jnp.where(mask(j), p, 0.0)
        dp = jnp.einsum("bgrlk,bgsk->bgrls", d_out, v_tile, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., None])).astype(q.dtype)
        dq = dq + scale * jnp.einsum("bgrls,bgsk->bgrlk", ds, k_tile,
                                     preferred_element_type=jnp.float32)
        dk_tile = scale * jnp.einsum("bgrls,bgrlk->bgsk", ds, q,
                                     preferred_element_type=jnp.float32)
        dv_tile = jnp.einsum("bgrls,bgrlk->bgsk", p.astype(d_out.dtype), d_out,
                             preferred_element_type=jnp.float32)
        dk, dv = (lax.dynamic_update_slice_in_dim(
            acc, lax.dynamic_slice_in_dim(acc, j * width, width, axis=2) + tile, j * width,
            axis=2) for acc, tile in ((dk, dk_tile), (dv, dv_tile)))
        return dq, dk, dv

    return _loop(count, body, acc)


# --- the ring ---------------------------------------------------------------------------------
# Which (local query rows, visiting keys) pairs a step computes. Step 0 (own chunks): chunk i
# sees itself causally, chunk 2n-1-i sees chunk i whole and itself causally, i.e. the second
# rows against all keys bottom-right aligned. Later steps: a visitor from an earlier device is
# seen, first chunk only, by every row; one from a later device, whole, by the second rows only.

ALL = slice(None)


def _schedule(causal: bool, step: int, c: int):
    """-> [(rows, keys, causal)] for step `step` when the visitor comes from an earlier device,
    and the same for a later one (the two agree except under causal masking after step 0)."""
    first, second = slice(0, c), slice(c, 2 * c)
    if not causal:
        work = [(ALL, ALL, False)]
        return work, work
    if step == 0:
        work = [(first, first, True), (second, ALL, True)]
        return work, work
    return [(ALL, first, False)], [(second, ALL, False)]


def _get(x, axis: int, part):
    return x if part == ALL else x[(slice(None),) * axis + (part,)]


def _set(x, axis: int, part, y):
    return y if part == ALL else x.at[(slice(None),) * axis + (part,)].set(y)


def _ring_steps(n: int, causal: bool, carry, blocks, work, send_with_block=None):
    """Run the ring: at each of the n steps `work(carry, blocks, rows, keys, causal) -> carry`
    for every entry of `_schedule`, the blocks (and `send_with_block(carry, send)`, the part of
    carry that travels with them) passed one hop on afterwards. The next blocks are sent before
    this step's work so the transfer can overlap it."""
    me = lax.axis_index(AXIS)
    c = jax.tree.leaves(blocks)[0].shape[2] // 2
    ring = [(s, (s + 1) % n) for s in range(n)]
    send = functools.partial(lax.ppermute, axis_name=AXIS, perm=ring)

    def run(entries, blocks):
        def fn(carry):
            for rows, keys, masked in entries:
                carry = work(carry, blocks, rows, keys, masked)
            return carry
        return fn

    for step in range(n):
        following = send(blocks) if step < n - 1 else None
        earlier, later = _schedule(causal, step, c)
        if earlier == later:
            carry = run(earlier, blocks)(carry)
        else:  # the half-block skip: which half depends on where the visitor comes from
            carry = lax.cond((me - step) % n < me, run(earlier, blocks), run(later, blocks),
                             carry)
        if send_with_block is not None:
            carry = send_with_block(carry, send)
        blocks = following
    return carry


def _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, n: int, causal: bool):
    """-> (out_BxLxHxK, lse_BxGxRxL) on this device's 2c rows."""
    groups = k_BxSxGxK.shape[2]
    q = _heads_first(q_BxLxHxK, groups)
    k, v = (x.transpose(0, 2, 1, 3) for x in (k_BxSxGxK, v_BxSxGxK))
    stats = jnp.zeros(q.shape[:-1], jnp.float32)
    state = _varying(jnp.zeros(q.shape, jnp.float32), stats + NEG, stats)

    def work(state, blocks, rows, keys, masked):
        k, v = (_get(x, 2, keys) for x in blocks)
        new = _fold(tuple(_get(x, 3, rows) for x in state), _get(q, 3, rows), k, v, masked)
        return tuple(_set(x, 3, rows, y) for x, y in zip(state, new))

    o, m, l = _ring_steps(n, causal, state, (k, v), work)
    out = _heads_last(o / l[..., None]).astype(q_BxLxHxK.dtype)
    return out, m + jnp.log(l)


def _backward(n: int, causal: bool, residuals, d_out_BxLxHxK):
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, out_BxLxHxK, lse = residuals
    groups = k_BxSxGxK.shape[2]
    q, d_out, out = (_heads_first(x, groups) for x in (q_BxLxHxK, d_out_BxLxHxK, out_BxLxHxK))
    k, v = (x.transpose(0, 2, 1, 3) for x in (k_BxSxGxK, v_BxSxGxK))
    # FlashAttention-2's delta = rowsum(dO * O) = rowsum(P * dP): a sum over K, not the keys.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    acc = _varying(jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                   jnp.zeros(v.shape, jnp.float32))

    def work(acc, blocks, rows, keys, masked):
        dq, dk, dv = acc
        k, v = (_get(x, 2, keys) for x in blocks)
        dq_rows, dk_keys, dv_keys = _grads(
            (_get(dq, 3, rows), _get(dk, 2, keys), _get(dv, 2, keys)), _get(q, 3, rows), k, v,
            *(_get(x, 3, rows) for x in (d_out, lse, delta)), masked)
        return _set(dq, 3, rows, dq_rows), _set(dk, 2, keys, dk_keys), _set(dv, 2, keys, dv_keys)

    def send_with_block(acc, send):  # dk/dv travel with their block; after step n-1, home
        dq, dk, dv = acc
        return (dq, *send((dk, dv)))

    dq, dk, dv = _ring_steps(n, causal, acc, (k, v), work, send_with_block)
    return (_heads_last(dq).astype(q_BxLxHxK.dtype),
            dk.transpose(0, 2, 1, 3).astype(k_BxSxGxK.dtype),
            dv.transpose(0, 2, 1, 3).astype(v_BxSxGxK.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ring(q, k, v, n: int, causal: bool):
    """Per-device body: q/k/v hold this device's two zig-zag chunks (2c positions)."""
    return _forward(q, k, v, n, causal)[0]


def _ring_fwd(q, k, v, n: int, causal: bool):
    out, lse = _forward(q, k, v, n, causal)
    out, lse = checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_LSE)
    return out, (q, k, v, out, lse)


_ring.defvjp(_ring_fwd, _backward)


def ring_attention(q, k, v, *, mesh: Mesh, causal: bool = True, zigzag: bool = False):
    """q_BxLxHxK, k/v_BxLxGxK, sequence-sharded over `mesh`'s `sequence` axis. `zigzag`: the
    sequence axis of q, k and v is already in zig-zag order for this ring, and the output is
    returned in that order."""
    n = mesh.shape[AXIS]
    if q.shape[1] % (2 * n):
        raise ValueError(f"ring attention needs the sequence length {q.shape[1]} to be a "
                         f"multiple of 2 x mesh.sequence = {2 * n} (zig-zag chunks).")
    spec = PartitionSpec(None, AXIS)
    body = jax.shard_map(functools.partial(_ring, n=n, causal=causal), mesh=shard_map_mesh(mesh),
                         in_specs=(spec, spec, spec), out_specs=spec, axis_names={AXIS})
    if zigzag:
        return body(q, k, v)
    return from_zigzag(body(to_zigzag(q, n), to_zigzag(k, n), to_zigzag(v, n)), n)
