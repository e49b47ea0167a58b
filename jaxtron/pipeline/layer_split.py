"""Which layers live on which pipeline rank: virtual stage `c * p + d` holds a contiguous run of
layers, chunk c of device d (in a V, `zbv`, chunk 1 of device d is virtual stage 2p-1-d:
`schedule.virtual_stage`).

Stacked layer parameters `[N, ...]` are stored in the pipeline layout `[p, v, Lmax, ...]`
(sharded over the `stage` axis on the first dimension), where Lmax is the longest run; shorter
runs are padded with copies of layer 0 that the `active` mask turns into the identity. So 10
layers on 4 ranks run as 3, 3, 2, 2.

The parameters outside the layer stack (embedding, head) are stored split evenly over the ranks
by their first dimension, `[n, ...] -> [p, ceil(n/p), ...]` (zero rows pad the last part), and
the engine sends them whole to the ranks that use them (`split_over_stages`, `join_stages`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.pipeline.ticks import owner


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    layer_index: np.ndarray  # int [p, v, Lmax]: layer held in each slot (0 for padding)
    active: np.ndarray  # bool [p, v, Lmax]

    @property
    def stages(self) -> int:
        return self.layer_index.shape[0]

    @property
    def virtual(self) -> int:
        return self.layer_index.shape[1]

    def to_pipeline(self, stacked_N):
        """[N, ...] -> [p, v, Lmax, ...] (padding slots repeat layer 0)."""
        index = jnp.asarray(self.layer_index)
        return jax.tree.map(lambda a: a[index], stacked_N)

    def from_pipeline(self, stacked_PxVxL):
        """[p, v, Lmax, ...] -> [N, ...], dropping padding slots."""
        flat = np.flatnonzero(self.active.reshape(-1))
        order = np.argsort(self.layer_index.reshape(-1)[flat])
        take = jnp.asarray(flat[order])
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:])[take], stacked_PxVxL)


def split_layers(num_layers: int, stages: int, virtual: int = 1,
                 counts: tuple[int, ...] | None = None, v_shape: bool = False) -> LayerSplit:
    """Contiguous runs per virtual stage: `counts` if given, else as even as possible with the
    extra layers on the earliest virtual stages."""
    n_virtual = stages * virtual
    if counts is None:
        base, extra = divmod(num_layers, n_virtual)
        counts = tuple(base + (1 if i < extra else 0) for i in range(n_virtual))
    if len(counts) != n_virtual or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"layer counts {counts} must be {n_virtual} positive numbers summing "
                         f"to {num_layers}")
    longest = max(counts)
    index = np.zeros((stages, virtual, longest), np.int32)
    active = np.zeros((stages, virtual, longest), bool)
    start = 0
    for vs, count in enumerate(counts):
        device, chunk = owner(vs, stages, v_shape)
        index[device, chunk, :count] = np.arange(start, start + count)
        active[device, chunk, :count] = True
        start += count
    return LayerSplit(index, active)


def split_over_stages(a_Nx, stages: int, multiple: int = 1):
    """[N, ...] -> [p, K, ...], K = N / p rounded up to a multiple of `multiple`; padding rows
    are zeros (they get zero gradients and stay zero)."""
    k = -(-a_Nx.shape[0] // (stages * multiple)) * multiple
    pad = [(0, stages * k - a_Nx.shape[0])] + [(0, 0)] * (a_Nx.ndim - 1)
    return jnp.pad(a_Nx, pad).reshape(stages, k, *a_Nx.shape[1:])


def join_stages(a_PxKx, n: int):
    """[p, K, ...] -> [n, ...]: undoes `split_over_stages`."""
    return a_PxKx.reshape(-1, *a_PxKx.shape[2:])[:n]
