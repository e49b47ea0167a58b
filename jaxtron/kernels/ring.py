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

Packed documents: segment ids (int32 [B, L], in the order and sharding of q) mask every tile
on top of causality, a query seeing a key only when their ids are equal. The queries' ids stay
on their device; the keys' ids travel with their k/v block round the ring (a few bytes per
token), in the forward and the backward alike. The half-block skip is causal only and stays
as it is; a row or tile that segments mask whole contributes nothing (no NaN).

Sliding window (`window` w, causal only: query i sees keys i - w < j <= i): the band is a
mask on true positions, not on indices within a block, since the zig-zag order puts far-apart
chunks on one device. A device's query positions follow from its index, a visiting block's
key positions from the device it left (me - step mod n), so nothing more travels. The work is
then taken one (row chunk, key chunk) pair at a time, and a pair that cannot meet in the band
(its latest key at or before its earliest query minus w) is skipped with a `lax.cond`: at
L = 32k on a ring of 8 with Mistral's w = 4096, a third of the causal schedule's query-key pairs
are computed (a quarter is the band itself).

Only the `sequence` axis is manual inside the shard_map: batch and heads stay sharded by GSPMD
over data, fsdp and tensor.

Inputs in natural order are put in zig-zag order on entry and the output back on exit: four
permutations across the ring in every layer. A train step avoids them by putting its tokens,
targets and positions in zig-zag order once (`jaxtron.sharding.zigzag`); attention then passes
`zigzag=True` and nothing is permuted here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec

from jaxtron.kernels.blockwise import ATTENTION_LSE, ATTENTION_OUT
from jaxtron.kernels.reference import check_window
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
# k/v_BxGxSxK, statistics m/l/lse/delta_BxGxRxL, segment ids of the queries Bx1x1xL and of the
# keys Bx1xS (so rows and keys are sliced on the axes of q and k). `causal` blocks are
# bottom-right aligned: query row r sees key s <= r + S - L.


def _heads_first(q_BxLxHxK, groups: int):
    b, length, heads, dim = q_BxLxHxK.shape
    return q_BxLxHxK.reshape(b, length, groups, heads // groups, dim).transpose(0, 2, 3, 1, 4)


def _heads_last(x_BxGxRxLxK):
    b, g, r, length, dim = x_BxGxRxLxK.shape
    return x_BxGxRxLxK.transpose(0, 3, 1, 2, 4).reshape(b, length, g * r, dim)


def _tiles(q, k, causal: bool, segments, band):
    """(tile width, count, scores(j, k_tile) -> masked fp32 scores, mask(j) or None).
    `segments`: None, or (q_seg_Bx1x1xL, k_seg_Bx1xS) for this block's rows and keys; `band`:
    None, or (q_pos_L, k_pos_S, window), the true positions of the rows and keys."""
    rows, keys, scale = q.shape[3], k.shape[2], q.shape[-1] ** -0.5
    width = key_tile(rows, keys)

    def mask(j):
        masks = []
        if causal:
            cols = j * width + jnp.arange(width)
            masks.append(cols[None, :] <= jnp.arange(rows)[:, None] + (keys - rows))
        if segments is not None:
            q_seg, k_seg = segments
            k_tile = lax.dynamic_slice_in_dim(k_seg, j * width, width, axis=2)
            masks.append(q_seg[..., None] == k_tile[:, :, None, None, :])  # Bx1x1xLxW
        if band is not None:
            q_pos, k_pos, window = band
            k_tile = lax.dynamic_slice_in_dim(k_pos, j * width, width)
            masks.append(k_tile[None, :] > q_pos[:, None] - window)  # LxW
        return functools.reduce(jnp.logical_and, masks) if masks else None

    def scores(j, k_tile):
        s = jnp.einsum("bgrlk,bgsk->bgrls", q, k_tile,
                       preferred_element_type=jnp.float32) * scale
        tile_mask = mask(j)
        return s if tile_mask is None else jnp.where(tile_mask, s, NEG)

    return width, keys // width, scores, mask


def _varying(*xs):
    """Fresh accumulators, marked as differing between the devices of the ring (as the values
    added to them do), so loop carries and both branches of a cond agree on their type."""
    return tuple(lax.pcast(x, AXIS, to="varying") for x in xs)


def _loop(count: int, body, carry):
    return body(0, carry) if count == 1 else lax.fori_loop(0, count, body, carry)


def _fold(state, q, k, v, causal: bool, segments=None, band=None):
    """Fold the keys k/v into the online softmax state (o fp32 unnormalised, max m, sum l)."""
    width, count, scores, mask = _tiles(q, k, causal, segments, band)
    masked = causal or segments is not None or band is not None

    def body(j, state):
        o, m, l = state
        k_tile, v_tile = (lax.dynamic_slice_in_dim(x, j * width, width, axis=2) for x in (k, v))
        s = scores(j, k_tile)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        if masked:  # a row masked whole so far has m_new = NEG and exp(0) = 1: zero it
            p = jnp.where(mask(j), p, 0.0)
        correction = jnp.exp(m - m_new)
        pv = jnp.einsum("bgrls,bgsk->bgrlk", p.astype(v.dtype), v_tile,
                        preferred_element_type=jnp.float32)
        return o * correction[..., None] + pv, m_new, l * correction + p.sum(axis=-1)

    return _loop(count, body, state)


def _grads(acc, q, k, v, d_out, lse, delta, causal: bool, segments=None, band=None):
    """Add this block's (dq, dk, dv) to acc: p = exp(s - lse), ds = p (dO v^T - delta)."""
    width, count, scores, mask = _tiles(q, k, causal, segments, band)
    masked = causal or segments is not None or band is not None
    scale = q.shape[-1] ** -0.5

    def body(j, acc):
        dq, dk, dv = acc
        k_tile, v_tile = (lax.dynamic_slice_in_dim(x, j * width, width, axis=2) for x in (k, v))
        p = jnp.exp(scores(j, k_tile) - lse[..., None])
        if masked:
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


@dataclasses.dataclass(frozen=True)
class Ring:
    """The ring's members on the `sequence` axis: n of them, `stride` ranks apart. A stride
    above 1 is hybrid context parallelism (`all_to_all_context.py`): consecutive ranks form a
    group that swapped its sequence split for a head split, and the rings run across groups,
    rank j of every group with rank j of the next."""
    n: int
    stride: int = 1

    def me(self):
        return lax.axis_index(AXIS) // self.stride

    def next_hop(self) -> list[tuple[int, int]]:
        return [(g * self.stride + j, (g + 1) % self.n * self.stride + j)
                for g in range(self.n) for j in range(self.stride)]


# Which (local query rows, visiting keys) pairs a step computes. Step 0 (own chunks): chunk i
# sees itself causally, chunk 2n-1-i sees chunk i whole and itself causally, i.e. the second
# rows against all keys bottom-right aligned. Later steps: a visitor from an earlier device is
# seen, first chunk only, by every row; one from a later device, whole, by the second rows only.

ALL = slice(None)


def _schedule(causal: bool, step: int, c: int, by_chunk: bool = False):
    """-> [(rows, keys, causal)] for step `step` when the visitor comes from an earlier device,
    and the same for a later one (the two agree except under causal masking after step 0).
    `by_chunk` (a sliding window): the same pairs as one entry per (row chunk, key chunk), so
    that each can be skipped on its own."""
    first, second = slice(0, c), slice(c, 2 * c)
    if not causal:
        work = [(ALL, ALL, False)]
        return work, work
    if step == 0:
        if by_chunk:  # chunk 2n-1-i sees chunk i whole and itself causally
            work = [(first, first, True), (second, first, False), (second, second, True)]
        else:
            work = [(first, first, True), (second, ALL, True)]
        return work, work
    if by_chunk:
        return ([(first, first, False), (second, first, False)],
                [(second, first, False), (second, second, False)])
    return [(ALL, first, False)], [(second, ALL, False)]


def _get(x, axis: int, part):
    return x if part == ALL else x[(slice(None),) * axis + (part,)]


def _set(x, axis: int, part, y):
    return y if part == ALL else x.at[(slice(None),) * axis + (part,)].set(y)


def _ring_steps(ring: Ring, causal: bool, carry, blocks, work, send_with_block=None,
                by_chunk: bool = False):
    """Run the ring: at each of the n steps `work(carry, blocks, rows, keys, causal, source)
    -> carry` for every entry of `_schedule` (`source`: the device the visiting blocks came
    from), the blocks (and `send_with_block(carry, send)`, the part of carry that travels with
    them) passed one hop on afterwards. The next blocks are sent before this step's work so the
    transfer can overlap it. `by_chunk`: see `_schedule`."""
    n, me = ring.n, ring.me()
    c = jax.tree.leaves(blocks)[0].shape[2] // 2
    send = functools.partial(lax.ppermute, axis_name=AXIS, perm=ring.next_hop())

    def run(entries, blocks, source):
        def fn(carry):
            for rows, keys, masked in entries:
                carry = work(carry, blocks, rows, keys, masked, source)
            return carry
        return fn

    for step in range(n):
        following = send(blocks) if step < n - 1 else None
        earlier, later = _schedule(causal, step, c, by_chunk)
        source = (me - step) % n
        if earlier == later:
            carry = run(earlier, blocks, source)(carry)
        else:  # the half-block skip: which half depends on where the visitor comes from
            carry = lax.cond(source < me, run(earlier, blocks, source),
                             run(later, blocks, source), carry)
        if send_with_block is not None:
            carry = send_with_block(carry, send)
        blocks = following
    return carry


def _segments(q_seg, blocks, rows, keys):
    """(the rows' ids, the visiting keys' ids) of one work entry, or None without segments."""
    if q_seg is None:
        return None
    return _get(q_seg, 3, rows), _get(blocks[2], 2, keys)


def _positions(device, c: int, n: int):
    """True positions of a device's 2c zig-zag rows: chunks `device` and 2n-1-device."""
    offsets = jnp.arange(c)
    return jnp.concatenate([device * c + offsets, (2 * n - 1 - device) * c + offsets])


def _banded(window, ring: Ring, c: int, rows, keys, source, compute, carry):
    """compute(carry, band) for one work entry; with a window, skipped (carry returned as it
    is) where no row can see any of the keys, and told the rows' and keys' true positions."""
    if window is None:
        return compute(carry, None)
    q_pos = _get(_positions(ring.me(), c, ring.n), 0, rows)
    k_pos = _get(_positions(source, c, ring.n), 0, keys)
    band = (q_pos, k_pos, window)
    return lax.cond(k_pos.max() > q_pos.min() - window, lambda x: compute(x, band),
                    lambda x: x, carry)


def _blocks(k, v, segment_ids_BxL):
    """What travels round the ring, and the local queries' ids: (k, v[, key ids]), q ids."""
    if segment_ids_BxL is None:
        return (k, v), None
    ids = segment_ids_BxL.astype(jnp.int32)
    return (k, v, ids[:, None, :]), ids[:, None, None, :]


def _forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, segment_ids_BxL, ring: Ring, causal: bool,
             window: int | None = None):
    """-> (out_BxLxHxK, lse_BxGxRxL) on this device's 2c rows."""
    groups = k_BxSxGxK.shape[2]
    q = _heads_first(q_BxLxHxK, groups)
    k, v = (x.transpose(0, 2, 1, 3) for x in (k_BxSxGxK, v_BxSxGxK))
    blocks, q_seg = _blocks(k, v, segment_ids_BxL)
    stats = jnp.zeros(q.shape[:-1], jnp.float32)
    o = jnp.zeros((*q.shape[:-1], v.shape[-1]), jnp.float32)  # v's head dim may differ (MLA)
    state = _varying(o, stats + NEG, stats)

    c = q.shape[3] // 2

    def work(state, blocks, rows, keys, masked, source):
        def compute(state, band):
            k, v = (_get(x, 2, keys) for x in blocks[:2])
            new = _fold(tuple(_get(x, 3, rows) for x in state), _get(q, 3, rows), k, v, masked,
                        _segments(q_seg, blocks, rows, keys), band)
            return tuple(_set(x, 3, rows, y) for x, y in zip(state, new))
        return _banded(window, ring, c, rows, keys, source, compute, state)

    o, m, l = _ring_steps(ring, causal, state, blocks, work, by_chunk=window is not None)
    if q_seg is not None:  # a row no key is visible to (none with causal self-attention): 0
        l = jnp.where(l > 0, l, 1.0)
    out = _heads_last(o / l[..., None]).astype(q_BxLxHxK.dtype)
    return out, m + jnp.log(l)


def _backward(ring: Ring, causal: bool, window: int | None, residuals, d_out_BxLxHxK):
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, segment_ids_BxL, out_BxLxHxK, lse = residuals
    groups = k_BxSxGxK.shape[2]
    q, d_out, out = (_heads_first(x, groups) for x in (q_BxLxHxK, d_out_BxLxHxK, out_BxLxHxK))
    k, v = (x.transpose(0, 2, 1, 3) for x in (k_BxSxGxK, v_BxSxGxK))
    blocks, q_seg = _blocks(k, v, segment_ids_BxL)
    # FlashAttention-2's delta = rowsum(dO * O) = rowsum(P * dP): a sum over K, not the keys.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    acc = _varying(jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                   jnp.zeros(v.shape, jnp.float32))

    c = q.shape[3] // 2

    def work(acc, blocks, rows, keys, masked, source):
        def compute(acc, band):
            dq, dk, dv = acc
            k, v = (_get(x, 2, keys) for x in blocks[:2])
            dq_rows, dk_keys, dv_keys = _grads(
                (_get(dq, 3, rows), _get(dk, 2, keys), _get(dv, 2, keys)), _get(q, 3, rows), k,
                v, *(_get(x, 3, rows) for x in (d_out, lse, delta)), masked,
                _segments(q_seg, blocks, rows, keys), band)
            return (_set(dq, 3, rows, dq_rows), _set(dk, 2, keys, dk_keys),
                    _set(dv, 2, keys, dv_keys))
        return _banded(window, ring, c, rows, keys, source, compute, acc)

    def send_with_block(acc, send):  # dk/dv travel with their block; after step n-1, home
        dq, dk, dv = acc
        return (dq, *send((dk, dv)))

    dq, dk, dv = _ring_steps(ring, causal, acc, blocks, work, send_with_block,
                             by_chunk=window is not None)
    return (_heads_last(dq).astype(q_BxLxHxK.dtype),
            dk.transpose(0, 2, 1, 3).astype(k_BxSxGxK.dtype),
            dv.transpose(0, 2, 1, 3).astype(v_BxSxGxK.dtype),
            None)  # segment ids are integers: no cotangent


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def ring_on_this_device(q, k, v, segment_ids, ring: Ring, causal: bool, window: int | None):
    """Per-device body, inside a region where `sequence` is manual: q/k/v (and segment ids,
    or None) hold this ring member's two zig-zag chunks (2c positions)."""
    return _forward(q, k, v, segment_ids, ring, causal, window)[0]


def _ring_fwd(q, k, v, segment_ids, ring: Ring, causal: bool, window: int | None):
    out, lse = _forward(q, k, v, segment_ids, ring, causal, window)
    out, lse = checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_LSE)
    return out, (q, k, v, segment_ids, out, lse)


ring_on_this_device.defvjp(_ring_fwd, _backward)


def ring_attention(q, k, v, *, mesh: Mesh, causal: bool = True, zigzag: bool = False,
                   segment_ids=None, window: int | None = None):
    """q_BxLxHxK, k/v_BxLxGxK, sequence-sharded over `mesh`'s `sequence` axis; segment_ids_BxL
    (packed documents, or None) in the order and sharding of q. `zigzag`: the sequence axis of
    q, k, v and segment_ids is already in zig-zag order for this ring, and the output is
    returned in that order. `window` (causal only): query i sees keys i - window < j <= i."""
    n = mesh.shape[AXIS]
    check_window(window, causal)
    if q.shape[1] % (2 * n):
        raise ValueError(f"ring attention needs the sequence length {q.shape[1]} to be a "
                         f"multiple of 2 x mesh.sequence = {2 * n} (zig-zag chunks).")
    spec = PartitionSpec(None, AXIS)
    inputs = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)

    def local(q, k, v, segment_ids=None):
        return ring_on_this_device(q, k, v, segment_ids, Ring(n), causal, window)

    body = jax.shard_map(local, mesh=shard_map_mesh(mesh), in_specs=(spec,) * len(inputs),
                         out_specs=spec, axis_names={AXIS})
    if zigzag:
        return body(*inputs)
    return from_zigzag(body(*(to_zigzag(x, n) for x in inputs)), n)
