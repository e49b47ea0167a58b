"""Run a Pallas attention kernel on each device's own rows and heads of a sharded batch.

A Pallas call has no SPMD partitioning rule: GSPMD can only replicate it (each device computing
every head of every row) or refuse it. On a mesh the Pallas kernels (Triton, interpret mode and
TPU splash alike) therefore run inside a `shard_map` over the batch axes and the tensor axis,
each device calling the kernel on its own rows and query heads. With grouped-query attention the
kv heads are split alongside the query heads when the tensor degree divides them; otherwise they
are replicated (see REPLICATE_IF_INDIVISIBLE in sharding/rules.py) and each device picks out the
kv heads its query heads read, so no query head is ever paired with another group's keys.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxtron.errors import ConfigError
from jaxtron.sharding.rules import active_spec, manual_axes, shard_map_mesh


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def per_device(kernel, q, k, v, segment_ids, mesh: Mesh):
    """kernel(q, k, v, segment_ids) per device: batch and heads split as the activation rules say.

    Sequence and head-dim splits are not taken into the shard_map (GSPMD gathers them first):
    each device needs whole rows of keys, and the kernel whole head vectors.
    """
    q_spec, kv_spec, own_kv_heads = split_heads(q, k, mesh)

    def local(q, k, v, segment_ids):
        return kernel(q, *own_kv_heads(k, v), segment_ids)

    # Inside another shard_map (the pipeline's over `stage`) the context mesh has that axis
    # manual already: map over the rest of it, so the kernel sits in a fully manual region.
    # check_vma=False because pallas_call's output types carry no varying-axes annotation;
    # shard_map then transposes the replicated kv heads' cotangents with a psum over tensor.
    seg_spec = None if segment_ids is None else PartitionSpec(q_spec[0])
    mapped = jax.shard_map(local, mesh=shard_map_mesh(mesh),
                           in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                           axis_names=set(mesh.axis_names) - manual_axes(), check_vma=False)
    return mapped(q, k, v, segment_ids)


def split_heads(q, k, mesh: Mesh, seq: str | None = None):
    """How q_BxLxHxK and k_BxSxGxK split over `mesh` by the activation rules (the sequence
    by the rule `seq`, or not at all): -> (q spec, kv spec, own_kv_heads), where
    own_kv_heads(k, v), called inside a shard_map over those specs, keeps the kv heads this
    rank's query heads read (whole kv heads replicated over tensor otherwise)."""
    q_spec = active_spec(("batch", seq, "heads", None), q.shape)
    kv_spec = active_spec(("batch", seq, "kv_heads", None), k.shape)
    head_axes, kv_head_axes = _axes(q_spec[2]), _axes(kv_spec[2])
    if kv_head_axes not in ((), head_axes):
        raise ConfigError(f"pallas attention needs kv heads split like query heads or not at "
                          f"all; the sharding rules split heads over {head_axes} and kv heads "
                          f"over {kv_head_axes}; set model.attention_impl=xla, or choose "
                          "mesh.tensor dividing model.num_kv_heads.")
    heads, kv_heads = q.shape[2], k.shape[2]
    local_heads = heads // math.prod(mesh.shape[a] for a in head_axes)
    group = heads // kv_heads  # query heads per kv head

    def own_kv_heads(k, v):
        if not head_axes or kv_head_axes:
            return k, v
        # Whole kv heads on every device: keep those this device's query heads
        # first .. first + local_heads - 1 read (query head h reads kv head h // group).
        first = lax.axis_index(head_axes) * local_heads
        if group % local_heads == 0:  # all of them read one kv head
            return tuple(lax.dynamic_slice_in_dim(x, first // group, 1, axis=2) for x in (k, v))
        index = (first + jnp.arange(local_heads)) // group  # one kv head per query head
        return tuple(jnp.take(x, index, axis=2) for x in (k, v))

    return q_spec, kv_spec, own_kv_heads
