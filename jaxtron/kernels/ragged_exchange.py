"""`ragged_all_to_all` on every platform: XLA's collective where it compiles (GPU, TPU), and
on CPU, whose XLA cannot compile it, the same semantics built from a dense all-to-all.

The semantics (jax.lax.ragged_all_to_all's docstring): with `n` ranks on `axis`, slice i of
the caller's `operand` (rows `input_offsets[i]` to `+ send_sizes[i]`) goes to rank i, which
writes it into its `output` at the caller's `output_offsets[i]`; `recv_sizes[j]` is how many
rows rank j sends the caller. Rows of `output` nothing is written to keep their values.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxtron.config.platforms import target_platform


def dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                            recv_sizes, *, axis_name: str):
    """ragged_all_to_all through an all-to-all of each slice padded to the operand's length:
    n times the bytes of the ragged one, for the platforms whose XLA lacks the collective."""
    rows, n = operand.shape[0], send_sizes.shape[0]
    r = jnp.arange(rows)
    take = jnp.clip(input_offsets[:, None] + r, 0, rows - 1)  # [n, rows]
    sent = jnp.where((r < send_sizes[:, None])[..., None], operand[take],
                     jnp.zeros((), operand.dtype))
    received = lax.all_to_all(sent, axis_name, 0, 0, tiled=True)  # [n, rows, ...] by source
    at = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source writes
    dest = jnp.where(r < recv_sizes[:, None], at[:, None] + r, output.shape[0])
    return output.at[dest.reshape(n * rows)].set(
        received.reshape(n * rows, *operand.shape[1:]), mode="drop")


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      *, axis_name: str):
    """XLA's ragged_all_to_all on GPU and TPU, `dense_ragged_all_to_all` on CPU; the platform
    being built for decides (both, chosen at run time, when none is named)."""
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)

    def dense(*a):
        return dense_ragged_all_to_all(*a, axis_name=axis_name)

    def ragged(*a):
        return lax.ragged_all_to_all(*a, axis_name=axis_name)

    platform = target_platform()
    if platform is not None:
        return (dense if platform == "cpu" else ragged)(*args)
    return lax.platform_dependent(*args, cpu=dense, default=ragged)


def exclusive_cumsum(x, axis: int = -1):
    """Offsets of consecutive blocks of sizes `x` along `axis`."""
    return jnp.cumsum(x, axis=axis) - x

