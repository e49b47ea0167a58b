"""The one attention entry point the model calls, dispatching on an enum.

`xla` is the plain-jnp reference; `cudnn` is JAX's fused cuDNN path (NVIDIA GPUs only); `pallas`
is our flash attention (`flash.py`: Triton on a GPU, slow interpret mode elsewhere, for tests);
`auto` takes cuDNN on a GPU and the reference elsewhere. When the step is traced on a mesh with a
`sequence` axis (context parallelism), every implementation runs as ring attention.
"""

from __future__ import annotations

import enum

import jax

from jaxtron.errors import ConfigError
from jaxtron.kernels.flash import flash_attention
from jaxtron.kernels.reference import reference_attention
from jaxtron.kernels.ring import ring_attention
from jaxtron.sharding.rules import active_mesh


class AttentionImpl(str, enum.Enum):
    AUTO = "auto"
    XLA = "xla"
    CUDNN = "cudnn"
    PALLAS = "pallas"


def resolve_impl(impl: str | AttentionImpl) -> AttentionImpl:
    impl = AttentionImpl(impl)
    if impl is AttentionImpl.AUTO:
        return AttentionImpl.CUDNN if jax.default_backend() == "gpu" else AttentionImpl.XLA
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
        return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids)
    if impl is AttentionImpl.CUDNN and segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    # Packed segments are not expressible through jax.nn's cuDNN arguments: use the reference.
    return reference_attention(q, k, v, causal=causal, segment_ids=segment_ids)
