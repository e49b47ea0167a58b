"""Dropless expert parallelism: each rank sends each expert's owner exactly the assignments
routed there, and gets their outputs back, by two ragged all-to-alls (MaxText's and Megatron's
dropless dispatch).

Per rank, with T tokens, k choices each and n ranks on the `expert` axis (E/n experts each):
1. sort the T k assignments by expert; the counts per expert go to every rank (an all-gather of
   E integers), so every rank knows the [source, destination] matrix of rows;
2. a ragged all-to-all sends each owner its rows into a buffer of R rows: `moe.ep_buffer_factor`
   x T k (the mean a rank receives), or with the factor null every row that could come (n T
   min(k, E/n)), so nothing can be dropped. Rows past R are dropped in a fixed order (later
   sources, then later experts of a block) and counted in `moe_dropped`;
3. the owner groups what it received by local expert and runs each FFN matrix as one grouped
   matmul (`ragged_dot`) over the rows;
4. a second ragged all-to-all returns the outputs to where the rows came from.
The buffers hold O(T k) rows per rank, where padding every expert to one slot per position
(the capacity path with C = L) holds E L per sequence.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxtron.kernels.activations import swiglu
from jaxtron.kernels.experts import AXIS, expert_manual_axes
from jaxtron.kernels.fp8 import grouped_matmul
from jaxtron.kernels.ragged_exchange import exclusive_cumsum, ragged_all_to_all
from jaxtron.sharding.rules import active_mesh, active_spec, shard_map_mesh


def receive_rows(tokens: int, top_k: int, ranks: int, local_experts: int,
                 buffer_factor: float | None) -> int:
    """Rows of a rank's receive buffer: `buffer_factor` x the mean a rank receives (T k), at
    most the most that can come (every source's tokens, each with min(k, E/n) choices here)."""
    most = ranks * tokens * min(top_k, local_experts)
    if buffer_factor is None:
        return most
    return max(1, min(most, math.ceil(buffer_factor * tokens * top_k)))


def dropless_expert_ffn(x_BxLxD, experts_BxLxK, w_gate, w_up, w_down, *,
                        buffer_factor: float | None = None, fp8: str = "none"):
    """-> (y_BxLxKxD, kept_BxLxK): each assignment's expert output (zero where dropped) and
    whether it was computed. Every batch axis and `expert` are manual, as in `expert_ffn`."""
    mesh = active_mesh()
    rows = active_spec(("batch", None, None), x_BxLxD.shape)
    experts = PartitionSpec(AXIS)
    exchange = functools.partial(_exchange, ranks=mesh.shape[AXIS],
                                 buffer_factor=buffer_factor, fp8=fp8)
    mapped = jax.shard_map(exchange, mesh=shard_map_mesh(mesh),
                           in_specs=(rows, rows, experts, experts, experts),
                           out_specs=(PartitionSpec(rows[0], None, None, None), rows),
                           axis_names=expert_manual_axes(rows))
    return mapped(x_BxLxD, experts_BxLxK, w_gate, w_up, w_down)


def _exchange(x_BxLxD, experts_BxLxK, w_gate, w_up, w_down, *, ranks, buffer_factor, fp8):
    b, length, d = x_BxLxD.shape
    k, local = experts_BxLxK.shape[-1], w_gate.shape[0]
    tokens, total = b * length, ranks * local
    assignments = tokens * k
    # 1. this rank's assignments sorted by expert, so each destination's rows are one block
    expert_A = experts_BxLxK.reshape(assignments)
    order_A = jnp.argsort(expert_A, stable=True)
    x_AxD = x_BxLxD.reshape(tokens, d)[order_A // k]
    counts_E = jnp.zeros(total, jnp.int32).at[expert_A].add(1)
    counts_SxJxE = lax.all_gather(counts_E, AXIS).reshape(ranks, ranks, local)
    rows_SxJ = counts_SxJxE.sum(axis=-1)  # rows source s has for destination j
    # 2. what fits: each destination takes its sources in order until its buffer is full
    buffer = receive_rows(tokens, k, ranks, local, buffer_factor)
    sent_SxJ = jnp.clip(buffer - exclusive_cumsum(rows_SxJ, axis=0), 0, rows_SxJ)
    lands_SxJ = exclusive_cumsum(sent_SxJ, axis=0)  # where s's rows start in j's buffer
    starts_SxJ = exclusive_cumsum(rows_SxJ, axis=1)  # where s's block for j starts in its sort
    me = lax.axis_index(AXIS)
    destination_A = expert_A[order_A] // local
    kept_A = (jnp.arange(assignments) - starts_SxJ[me][destination_A]
              < sent_SxJ[me][destination_A])
    received_RxD = ragged_all_to_all(x_AxD, jnp.zeros((buffer, d), x_AxD.dtype),
                                     starts_SxJ[me], sent_SxJ[me], lands_SxJ[me],
                                     sent_SxJ[:, me], axis_name=AXIS)
    # 3. group the received rows by local expert (unfilled rows last, in no group)
    mine_SxE = counts_SxJxE[:, me]
    kept_SxE = jnp.clip(sent_SxJ[:, me, None] - exclusive_cumsum(mine_SxE, axis=1), 0, mine_SxE)
    segment_R = jnp.repeat(jnp.arange(ranks * local), kept_SxE.reshape(-1),
                           total_repeat_length=buffer)
    local_expert_R = jnp.where(jnp.arange(buffer) < kept_SxE.sum(), segment_R % local, local)
    group_order_R = jnp.argsort(local_expert_R, stable=True)
    sizes_1xE = kept_SxE.sum(axis=0)[None]
    grouped = received_RxD[group_order_R][None]
    hidden = swiglu(grouped_matmul(grouped, w_gate, sizes_1xE, fp8),
                    grouped_matmul(grouped, w_up, sizes_1xE, fp8))
    y_RxD = jnp.zeros_like(received_RxD).at[group_order_R].set(
        grouped_matmul(hidden, w_down, sizes_1xE, fp8)[0])
    # 4. back to the ranks the rows came from, at the places they were sent from
    returned_AxD = ragged_all_to_all(y_RxD, jnp.zeros((assignments, d), y_RxD.dtype),
                                     lands_SxJ[:, me], sent_SxJ[:, me], starts_SxJ[:, me],
                                     sent_SxJ[me], axis_name=AXIS)
    y_AxD = jnp.zeros_like(returned_AxD).at[order_A].set(returned_AxD)
    kept = jnp.zeros(assignments, bool).at[order_A].set(kept_A)
    return y_AxD.reshape(b, length, k, d), kept.reshape(b, length, k)
