"""All-to-all context parallelism over the `sequence` axis (DeepSpeed-Ulysses: Jacobs et al.
2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models"; Megatron-Core's `--cp-comm-type a2a`).

Each of the n devices of the axis holds L/n positions of q, k and v for all of its heads. One
all-to-all per tensor swaps that for all L positions of 1/n of the heads; the platform's own
attention kernel (cuDNN, Triton, splash, blockwise XLA) then runs on whole sequences, masks and
windows as on one device, and one more all-to-all brings the output back to the sequence split.
Forward, that is four all-to-alls of (n-1)/n of a tensor each (q, k, v, output); backward, their
transposes (dout in, dq, dk, dv out): traffic that stays flat as n grows while a ring sends k/v
on n-1 hops, and no per-step kernel, at the price of n dividing the heads.

Grouped-query attention with fewer kv heads on a device than n: each kv head is repeated until
there are n of them before the exchange, so every device receives the one its query heads
read (query head h reads kv head h // group, and a device's H/n query heads never straddle a
group). Megatron-Core repeats them the same way; the repeat is counted in the traffic.

Packed documents: the int32 segment ids of the whole sequence are all-gathered (4 bytes a
token). Sliding windows and causality are the kernel's own, on true positions, because the
sequence arrives whole and in natural order: the train step puts it in zig-zag order only for
a ring (`sharding/zigzag.py`).

Hybrid (`group` g < n, Megatron's `a2a+p2p`): the exchange runs within groups of g
consecutive ranks, and rings of n / g members carry each group's share across the groups
(`ring.Ring`), or, inside pipeline stages, one all-gather does (`context_gather.py`).

Every mesh axis is manual inside: each device exchanges only its own rows of the batch and its
own tensor-parallel heads (kv heads replicated over tensor are first cut to those its query
heads read, as for the Pallas kernels, `per_device.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxtron.kernels.per_device import split_heads
from jaxtron.sharding.rules import manual_axes, shard_map_mesh

AXIS = "sequence"


def all_to_all_attention(attend, q, k, v, segment_ids, *, mesh: Mesh, group: int | None = None):
    """attend(q, k, v, segment_ids) -> out: the per-device kernel, on whole sequences of a
    share of the heads. q_BxLxHxK, k/v_BxLxGxK sequence-split over `mesh`'s `sequence` axis
    in natural order; segment_ids_BxL (or None) alike.

    `group` (hybrid): the exchange runs within groups of that many consecutive ranks, which
    then hold a contiguous 1/(n/group) of the sequence for 1/group of the heads each; `attend`
    runs inside the region where `sequence` is manual and passes that share round the rings
    across the groups (`ring.ring_on_this_device` with `Ring(n / group, stride=group)`)."""
    ranks = mesh.shape[AXIS]
    n = group or ranks  # devices in one exchange
    groups = (None if n == ranks
              else [list(range(g * n, (g + 1) * n)) for g in range(ranks // n)])
    q_spec, kv_spec, own_kv_heads = split_heads(q, k, mesh, seq="seq")
    seg_spec = None if segment_ids is None else PartitionSpec(q_spec[0], q_spec[1])

    def to_heads(x):  # [b, L/n, h, k] -> [b, L, h/n, k] (within a group: L/rings)
        return lax.all_to_all(x, AXIS, split_axis=2, concat_axis=1, tiled=True,
                              axis_index_groups=groups)

    def local(q, k, v, segment_ids):
        k, v = own_kv_heads(k, v)
        heads, kv_heads = q.shape[2], k.shape[2]
        if heads % n or (kv_heads % n and n % kv_heads):
            raise ValueError(f"all-to-all attention over {n} devices needs {heads} query heads "
                             f"a multiple of {n} and {kv_heads} kv heads dividing or divided "
                             "by it")
        if kv_heads % n:  # repeat each kv head so every device receives the one it reads
            k, v = (jnp.repeat(x, n // kv_heads, axis=2) for x in (k, v))
        if segment_ids is not None:
            segment_ids = lax.all_gather(segment_ids, AXIS, axis=1, tiled=True,
                                         axis_index_groups=groups)
        out = attend(to_heads(q), to_heads(k), to_heads(v), segment_ids)
        return lax.all_to_all(out, AXIS, split_axis=1, concat_axis=2, tiled=True,
                              axis_index_groups=groups)

    mapped = jax.shard_map(local, mesh=shard_map_mesh(mesh),
                           in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                           axis_names=set(mesh.axis_names) - manual_axes(), check_vma=False)
    return mapped(q, k, v, segment_ids)
