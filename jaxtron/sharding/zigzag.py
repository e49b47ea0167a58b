"""The zig-zag sequence order of ring attention, set once per step instead of in every layer.

Ring attention (`kernels/ring.py`) balances causal work by giving device i of the `sequence`
axis chunks i and 2n-1-i of the sequence cut into 2n chunks. Sharding the sequence axis
contiguously gives device i chunks 2i and 2i+1 instead, so on its own the kernel reorders q, k
and v into zig-zag order and its output back in every layer, forward and backward: traffic
across the ring that exceeded the ring's own (all-to-alls, all-gathers, collective permutes).

A train step does it once instead. `in_zigzag_order` puts the inputs, the targets, their loss
weights and the positions (RoPE, learned position embeddings) and segment ids of packed
documents of every sequence in zig-zag order before the model runs. Contiguous sharding then hands each device its zig-zag pair, every
position-dependent computation sees the true positions, and the loss is a mean over tokens, so
neither it nor its gradients change. While the model is traced, `zigzag_ring()` tells the
attention kernel that its inputs are already in that order, and no layer permutes anything.
The model itself only learns that tokens may come with a `TokenPositions`; the mesh stays here.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import jax.numpy as jnp
import numpy as np

_RING: contextvars.ContextVar[int | None] = contextvars.ContextVar("jaxtron_zigzag_ring",
                                                                   default=None)


def zigzag_order(length: int, n: int) -> np.ndarray:
    """The positions 0..length-1 in zig-zag order for a ring of n: entry j is the position of
    the token that index j holds, 2c of them per device (c = length / 2n)."""
    chunks = np.arange(length).reshape(2 * n, length // (2 * n))
    return np.stack([chunks[:n], chunks[::-1][:n]], axis=1).reshape(length)


def to_zigzag(x_BxL, n: int):
    """Reorder axis 1 so that consecutive blocks of 2c hold chunks (i, 2n-1-i)."""
    b, length, rest = x_BxL.shape[0], x_BxL.shape[1], x_BxL.shape[2:]
    c = length // (2 * n)
    halves = x_BxL.reshape(b, 2, n, c, *rest)
    paired = jnp.stack([halves[:, 0], jnp.flip(halves[:, 1], axis=1)], axis=2)
    return paired.reshape(b, length, *rest)


def from_zigzag(x_BxL, n: int):
    """The inverse of `to_zigzag`."""
    b, length, rest = x_BxL.shape[0], x_BxL.shape[1], x_BxL.shape[2:]
    c = length // (2 * n)
    paired = x_BxL.reshape(b, n, 2, c, *rest)
    halves = jnp.concatenate([paired[:, :, 0], jnp.flip(paired[:, :, 1], axis=1)], axis=1)
    return halves.reshape(b, length, *rest)


@contextlib.contextmanager
def zigzag_ordered(n: int) -> Iterator[None]:
    """Trace inside this when the sequence axis of everything is in zig-zag order for a ring
    of n (see `in_zigzag_order`, which sets it)."""
    token = _RING.set(n)
    try:
        yield
    finally:
        _RING.reset(token)


def zigzag_ring() -> int | None:
    """The ring size the sequence being traced is in zig-zag order for; None: natural order."""
    return _RING.get()


def in_zigzag_order(loss: Callable, n: int) -> Callable:
    """loss(inputs_BxL, targets_BxL, token_pos, weights_BxL) -> loss of the same arguments in
    natural order, evaluated with the sequence in zig-zag order for a ring of n: inputs,
    targets, loss weights, positions and segment ids permuted alike, the token positions told each
    token's natural index (`order`), and the attention kernel told so. `loss` must be a mean
    (or any function) over tokens that does not depend on their order."""

    def ordered(inputs_BxL, targets_BxL, token_pos, weights_BxL=None):
        # Token rows are whole on every device of the ring (the batch is split over the data
        # axes only), so this reordering moves no data; the model's first sharding constraint
        # then keeps each device's 2c tokens.
        order_L = zigzag_order(inputs_BxL.shape[1], n)
        zigzag = lambda a: None if a is None else to_zigzag(a, n)  # noqa: E731
        positions = token_pos.positions
        positions = order_L if positions is None else (
            positions[order_L] if positions.ndim == 1 else zigzag(positions))
        token_pos = token_pos.replace(positions=positions,
                                      segment_ids=zigzag(token_pos.segment_ids),
                                      order=order_L)
        with zigzag_ordered(n):
            return loss(zigzag(inputs_BxL), zigzag(targets_BxL), token_pos, zigzag(weights_BxL))

    return ordered
