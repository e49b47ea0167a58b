"""Where each token of a batch sits, when that is more than "position j of one document".

Two callers need it. Packed rows (`data.packing: documents`) hold several documents one after
another: each token's RoPE / learned position restarts at its document's start, and attention
never crosses a document boundary (`segment_ids`, which every attention kernel takes). Context
parallelism reorders each row once per step (`jaxtron.sharding.zigzag`): then the positions are
a permutation, and the MoE capacity mode, which lets earlier tokens claim expert slots first,
needs each token's index in the row's natural order (`order`).

A model called without token positions sees the plain case: positions 0..L-1, one document per row,
natural order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class TokenPositions:
    positions: jax.Array | None = None    # [L] or [B, L]: position within the document
    segment_ids: jax.Array | None = None  # [B, L]: which document of the row a token is in
    order: jax.Array | None = None        # [L]: index in the row's natural order

    def positions_for(self, length: int) -> jax.Array:
        """Positions for RoPE and learned embeddings: given, else the order, else 0..L-1."""
        if self.positions is not None:
            return self.positions
        return self.order if self.order is not None else jnp.arange(length)


PLAIN = TokenPositions()
