"""Content fingerprints of a train state: what a checkpoint must give back, bit for bit.

A fingerprint of an array is sum_i bits(x_i) * (2 i + 1) mod 2^32 over its elements in
row-major order, with bits() the element's raw bits as unsigned integers. Every weight is odd,
so flipping any one bit of any element changes the sum; integer addition wraps exactly, so the
value does not depend on how the array is sharded or in which order devices add their parts.
The index is built from per-axis iotas and strides rather than by flattening, so a sharded array
is reduced where it lives (one all-reduce of a scalar), never gathered.

Checkpoints store the fingerprints of the state they hold; a restore recomputes them on the
restored arrays (whatever the new mesh) and compares. This checks the whole path, files and
resharding alike, which Orbax does not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bits(x) -> jax.Array:
    """The array's raw bits as uint32, one or more words per element (trailing axis for 8 bytes)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    if size == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    return lax.bitcast_convert_type(x, _UNSIGNED[size]).astype(jnp.uint32)


def _fingerprint(x) -> jax.Array:
    if x.aval.memory_space == jax.memory.Space.Host:  # `optim.host_moments`: read on the device
        x = jax.device_put(x, jax.memory.Space.Device)
    bits = _bits(x)
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(bits.ndim)):
        index = index + lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * np.uint32(stride)
        stride = (stride * bits.shape[axis]) % 2**32
    return jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32)


@jax.jit
def _fingerprints(leaves):
    return [_fingerprint(x) for x in leaves]


def fingerprints(tree) -> dict[str, int]:
    """{leaf path: fingerprint} of every array in `tree`."""
    paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(tree)) if jax.tree.leaves(
        tree) else ((), ())
    values = jax.device_get(_fingerprints(list(leaves)))
    return {jax.tree_util.keystr(path): int(v) for path, v in zip(paths, values)}


def mismatches(saved: dict[str, int], tree) -> list[str]:
    """Leaf paths whose fingerprint differs from `saved` (or that one side lacks)."""
    now = fingerprints(tree)
    return sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
