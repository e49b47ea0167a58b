"""Context parallelism by gathering keys and values, for attention inside pipeline stages.

Each of the n devices of the `sequence` axis keeps its L/n queries and all-gathers the keys and
values (and their segment ids) of the whole sequence, then attends with a mask built from every
token's true position: the all-gather form of context parallelism that Llama 3 trained with
(Dubey et al. 2024, sec. 3.3.2), where ring attention (`ring.py`) sends k/v blocks round the
ring instead. With grouped-query attention k/v are a fraction of q, so the gathered copy costs
less than the queries' activations; its backward is the reduce-scatter of dk/dv.

Why a second form: a pipeline runs each stage's work in one branch of a conditional per tick
(forward, backward or idle), and on XLA:CPU a collective-permute, ring attention's hop, is a
rendezvous of every device of the module, not of its pairs: devices of another stage, in
another branch, never arrive and the step deadlocks. All-gathers rendezvous within their
replica groups (one stage's sequence ranks, which take the same branch), so inside a pipeline
stage context parallelism gathers. The scores of a device's queries against every key,
[B, H, L/n, L] in fp32, are its memory price. A sliding window (query i sees keys
i - w < j <= i) is one more condition on the true positions, which the mask is built from
already; the gathered keys are computed whole, band or not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxtron.kernels.reference import check_window, visible_keys
from jaxtron.sharding.rules import shard_map_mesh
from jaxtron.sharding.zigzag import zigzag_order

AXIS = "sequence"


def _attend(q_BxLxHxK, k_BxSxGxK, v_BxSxGxV, visible_BxLxS):
    b, length, heads, dim = q_BxLxHxK.shape
    groups = k_BxSxGxK.shape[2]
    q = q_BxLxHxK.reshape(b, length, groups, heads // groups, dim)
    logits = jnp.einsum("blgrk,bsgk->bgrls", q, k_BxSxGxK,
                        preferred_element_type=jnp.float32) * dim ** -0.5
    logits = jnp.where(visible_BxLxS[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BxSxGxV.dtype)
    out = jnp.einsum("bgrls,bsgk->blgrk", probs, v_BxSxGxV)
    return out.reshape(b, length, heads, v_BxSxGxV.shape[-1])


def gathered_context_attention(q, k, v, *, mesh: Mesh, causal: bool = True,
                               zigzag: bool = False, segment_ids=None,
                               window: int | None = None):
    """q_BxLxHxK, k/v_BxLxGxK sequence-sharded over `mesh`'s `sequence` axis, in natural order or
    (`zigzag`) in ring attention's zig-zag order; segment_ids_BxL (or None) alike. `window`
    (causal only): query i sees keys i - window < j <= i."""
    check_window(window, causal)
    n = mesh.shape[AXIS]
    length = q.shape[1]
    order = zigzag_order(length, n) if zigzag else jnp.arange(length)
    positions_L = jnp.asarray(order, jnp.int32)
    segments = (jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None
                else segment_ids.astype(jnp.int32))
    spec = PartitionSpec(None, AXIS)

    def local(q, k, v, segments, positions):
        return _gather_and_attend(q, k, v, segments, positions, causal, window)

    mapped = jax.shard_map(local, mesh=shard_map_mesh(mesh),
                           in_specs=(spec, spec, spec, spec, PartitionSpec(AXIS)),
                           out_specs=spec, axis_names={AXIS}, check_vma=False)
    return mapped(q, k, v, segments, positions_L)


def _gather_and_attend(q, k, v, segments, positions, causal: bool, window, groups=None):
    """This device's queries against the keys and values of every rank of its `groups` (all
    of `sequence` when None), masked by segments and true positions."""
    def gather(x, axis=1):
        return jax.lax.all_gather(x, AXIS, axis=axis, tiled=True, axis_index_groups=groups)

    k_all, v_all, segments_all = gather(k), gather(v), gather(segments)
    positions_all = gather(positions, axis=0)
    visible = segments[:, :, None] == segments_all[:, None, :]
    if causal:
        visible = visible & visible_keys(positions, positions_all, window)[None]
    return _attend(q, k_all, v_all, visible)


def gathered_across_groups(q, k, v, segment_ids, *, rings: int, stride: int, causal: bool,
                           window: int | None = None):
    """Hybrid context parallelism inside pipeline stages, per device in a region where
    `sequence` is manual: after the all-to-all within its group of `stride` ranks, a device
    holds the group's contiguous 1/rings of the sequence (natural order) for its heads, and
    gathers k/v from rank j of every other group, which hold the same heads: what the ring
    across groups sends, as one all-gather (see the module doc for why)."""
    length = q.shape[1]
    group = jax.lax.axis_index(AXIS) // stride
    positions = (group * length + jnp.arange(length)).astype(jnp.int32)
    segments = (jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None
                else segment_ids.astype(jnp.int32))
    members = [[g * stride + j for g in range(rings)] for j in range(stride)]
    return _gather_and_attend(q, k, v, segments, positions, causal, window, members)
