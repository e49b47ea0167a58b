"""The one attention entry point the model calls, dispatching on an enum.

`xla` is plain XLA (causal self-attention skips the masked blocks, `blockwise.py`; anything
else runs the reference, `reference.py`); `cudnn` is JAX's fused cuDNN path (NVIDIA GPUs only); `pallas`
is our flash attention (`flash.py`: Triton on a GPU, slow interpret mode elsewhere, for tests);
`auto` takes cuDNN on a GPU and plain XLA elsewhere. When the step is traced on a mesh with a
`sequence` axis (context parallelism), every implementation runs as ring attention.

A Pallas call has no SPMD partitioning rule: GSPMD can only replicate it (each device computing
every head of every row) or refuse it. On a mesh, `pallas` therefore runs inside a `shard_map`
over the batch axes and the tensor axis, each device calling the kernel on its own rows and
query heads. With grouped-query attention the kv heads are split alongside the query heads when
the tensor degree divides them; otherwise they are replicated (see REPLICATE_IF_INDIVISIBLE in
sharding/rules.py) and each device picks out the kv heads its query heads read, so no query
head is ever paired with another group's keys.
"""

from __future__ import annotations

import enum
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxtron.errors import ConfigError
from jaxtron.kernels.blockwise import blockwise_causal_attention
from jaxtron.kernels.flash import flash_attention
from jaxtron.kernels.reference import reference_attention
from jaxtron.kernels.ring import ring_attention
from jaxtron.sharding.rules import active_mesh, active_spec


class AttentionImpl(str, enum.Enum):
    AUTO = "auto"
    XLA = "xla"
    CUDNN = "cudnn"
    PALLAS = "pallas"


def impl_on(impl: str | AttentionImpl, platform: str) -> AttentionImpl:
    """What `impl` runs as on `platform` ("gpu", "cpu", "tpu"), e.g. for predictions made
    without that platform's devices."""
    impl = AttentionImpl(impl)
    if impl is AttentionImpl.AUTO:
        return AttentionImpl.CUDNN if platform == "gpu" else AttentionImpl.XLA
    return impl


def resolve_impl(impl: str | AttentionImpl) -> AttentionImpl:
    impl = impl_on(impl, jax.default_backend())
    if impl is AttentionImpl.CUDNN and jax.default_backend() != "gpu":
        raise ConfigError("model.attention_impl=cudnn needs an NVIDIA GPU, but the backend is "
                          f"{jax.default_backend()}; use model.attention_impl=auto or xla.")
    return impl


def attention(q, k, v, *, causal: bool = True, segment_ids=None, impl="auto"):
    """q_BxLxHxK, k/v_BxSxGxK -> out_BxLxHxK (G divides H: grouped-query attention)."""
    impl = resolve_impl(impl)
    mesh = active_mesh()
    if mesh is not None and mesh.shape.get("sequence", 1) > 1:
        if segment_ids is not None:
            raise ConfigError("packed segments are not supported with context parallelism; "
                              "set mesh.sequence=1 or train on unpacked windows.")
        return ring_attention(q, k, v, mesh=mesh, causal=causal)
    if impl is AttentionImpl.PALLAS:
        if mesh is not None and any(size > 1 for size in mesh.shape.values()):
            return _flash_on_mesh(q, k, v, mesh, causal=causal, segment_ids=segment_ids)
        return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids)
    if impl is AttentionImpl.CUDNN and segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    # Packed segments are not expressible through jax.nn's cuDNN arguments: use plain XLA.
    if causal and q.shape[1] == k.shape[1]:
        return blockwise_causal_attention(q, k, v, segment_ids=segment_ids)
    return reference_attention(q, k, v, causal=causal, segment_ids=segment_ids)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _flash_on_mesh(q, k, v, mesh: Mesh, *, causal: bool, segment_ids):
    """flash_attention per device: batch and heads split as the activation rules say.

    Sequence and head-dim splits are not taken into the shard_map (GSPMD gathers them first):
    each device needs whole rows of keys, and the kernel whole head vectors.
    """
    q_spec = active_spec(("batch", None, "heads", None), q.shape)
    kv_spec = active_spec(("batch", None, "kv_heads", None), k.shape)
    head_axes, kv_head_axes = _axes(q_spec[2]), _axes(kv_spec[2])
    if kv_head_axes not in ((), head_axes):
        raise ConfigError(f"pallas attention needs kv heads split like query heads or not at "
                          f"all; the sharding rules split heads over {head_axes} and kv heads "
                          f"over {kv_head_axes}; set model.attention_impl=xla, or choose "
                          "mesh.tensor dividing model.num_kv_heads.")
    heads, kv_heads = q.shape[2], k.shape[2]
    local_heads = heads // math.prod(mesh.shape[a] for a in head_axes)
    group = heads // kv_heads  # query heads per kv head

    def local(q, k, v, segment_ids):
        if head_axes and not kv_head_axes:
            # Whole kv heads on every device: keep those this device's query heads
            # first .. first + local_heads - 1 read (query head h reads kv head h // group).
            first = lax.axis_index(head_axes) * local_heads
            if group % local_heads == 0:  # all of them read one kv head
                k, v = (lax.dynamic_slice_in_dim(x, first // group, 1, axis=2) for x in (k, v))
            else:  # local heads straddle groups unevenly: one kv head per query head
                index = (first + jnp.arange(local_heads)) // group
                k, v = (jnp.take(x, index, axis=2) for x in (k, v))
        return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids)

    # Inside another shard_map (the pipeline's over `stage`) the context mesh has that axis
    # manual already: map over the rest of it, so the kernel sits in a fully manual region.
    # check_vma=False because pallas_call's output types carry no varying-axes annotation;
    # shard_map then transposes the replicated kv heads' cotangents with a psum over tensor.
    context = jax.sharding.get_abstract_mesh()
    outer = set(context.manual_axes) if not context.empty else set()
    seg_spec = None if segment_ids is None else PartitionSpec(q_spec[0])
    mapped = jax.shard_map(local, mesh=context if not context.empty else mesh,
                           in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                           axis_names=set(mesh.axis_names) - outer, check_vma=False)
    return mapped(q, k, v, segment_ids)
