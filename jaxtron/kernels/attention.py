"""The one attention entry point the model calls; which kernel runs is `choice.py`'s decision.

Cuda, rocm, tpu or cpu: a Trainer traces its steps for one platform (`platforms.building_for`:
its mesh's devices, or the `--dry-run --target` being checked), and the kernel is chosen while
tracing. Traced anywhere else, `attention` stages every platform's kernel with
`jax.lax.platform_dependent` and lowering keeps only the branch of the platform it lowers for,
so one jitted function lowers to blockwise XLA for CPU, Triton for CUDA and ROCm and splash for
TPU, on whatever machine traces it. (Trainers avoid that form: under autodiff the branches'
residuals are joined, and XLA then keeps a q-sized stacked buffer per layer that only another
platform's kernel needed.) Triton is our flash attention (`flash.py`), splash is JAX's TPU
kernel (`splash.py`), xla is plain XLA (`blockwise.py` for causal self-attention, else
`reference.py`).

Values may be narrower or wider than queries and keys (multi-head latent attention: K = 192,
V = 128 in DeepSeek-V3). XLA (blockwise and reference) and ring attention take that as it is;
the Pallas kernels (Triton, interpret, splash) and cuDNN take one head dim, so `_run` pads the
narrower side with zeros to the wider one and slices the output back (zero value columns give
zero output columns; zero query/key columns leave the scores alone, q scaled so that the
softmax keeps 1/sqrt(K)). The padding costs the kernel (K - V) / K more value traffic.

Sliding-window attention (`window` w, `model.sliding_window`; causal only): query i sees the
w keys i - w < j <= i, itself included, as Mistral and Hugging Face's `sliding_window` do
(bottom-right aligned when L != S). Every kernel takes it: XLA (blockwise) and Triton skip the
key blocks below the band, splash takes it as a LocalMask, cuDNN as `local_window_size`
(w - 1, 0), ring attention masks on true positions and skips ring steps outside the band. A
window of at least the key length is full causal attention and runs as such.

When the step is traced on a mesh with a `sequence` axis (context parallelism), every
implementation runs as ring attention, told by `sharding.zigzag.zigzag_ring()` whether the
train step has put the sequence in its zig-zag order already; or, with
`mesh.context_parallel=all_to_all` (`sharding.context_parallel`), the chosen kernel runs on
whole sequences of a share of the heads between two all-to-alls (`all_to_all_context.py`). On
other meshes the Pallas kernels run per device (`per_device.py`); cuDNN and XLA are
partitioned by GSPMD.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxtron.config.platforms import PLATFORMS, target_platform
from jaxtron.errors import ConfigError
from jaxtron.kernels.all_to_all_context import all_to_all_attention
from jaxtron.kernels.blockwise import blockwise_causal_attention
from jaxtron.kernels.choice import AttentionImpl, Kernel, choose, cudnn_present
from jaxtron.kernels.context_gather import gathered_across_groups, gathered_context_attention
from jaxtron.kernels.flash import flash_attention
from jaxtron.kernels.per_device import per_device
from jaxtron.kernels.reference import check_window, reference_attention
from jaxtron.kernels.ring import Ring, ring_attention, ring_on_this_device
from jaxtron.sharding.context_parallel import (
    ALL_TO_ALL,
    HYBRID,
    context_parallel_mode,
    ring_size,
)
from jaxtron.sharding.rules import active_mesh, manual_axes
from jaxtron.sharding.zigzag import zigzag_ring


def attention(q, k, v, *, causal: bool = True, segment_ids=None, impl="auto",
              window: int | None = None):
    """q_BxLxHxK, k_BxSxGxK, v_BxSxGxK' -> out_BxLxHxK' (G divides H: grouped-query attention;
    K' = K except in multi-head latent attention). `window`: see the module doc."""
    impl = AttentionImpl(impl)
    if window is not None:
        check_window(window, causal)
        if window >= k.shape[1]:  # every key within reach: plain causal attention
            window = None
    mesh = active_mesh()
    ring = mesh.shape.get("sequence", 1) if mesh is not None else 1
    mode, group = context_parallel_mode()
    ordered_for = zigzag_ring()  # a train step's sequence already in zig-zag order, for a ring
    rings = ring_size(mode, ring, group)  # members of each ring; 1: natural order expected
    if ordered_for not in (None, rings) or (rings == 1 and ordered_for is not None):
        raise ValueError(f"the sequence is in zig-zag order for a ring of {ordered_for}, but "
                         f"the active mesh has sequence={ring} ({mode}): trace the step on its "
                         "own mesh.")
    if ring > 1 and mode == ALL_TO_ALL:
        attend = functools.partial(_on_one_device, causal=causal, impl=impl, window=window,
                                   mesh=None)
        return all_to_all_attention(attend, q, k, v, segment_ids, mesh=mesh)
    if ring > 1 and mode == HYBRID:
        in_stage = "stage" in manual_axes()  # no ring there: gather across groups instead

        def attend(q, k, v, segment_ids):
            if in_stage:
                return gathered_across_groups(q, k, v, segment_ids, rings=rings, stride=group,
                                              causal=causal, window=window)
            return ring_on_this_device(q, k, v, segment_ids, Ring(rings, stride=group), causal,
                                       window)

        return all_to_all_attention(attend, q, k, v, segment_ids, mesh=mesh, group=group)
    if ring > 1:
        # Inside a pipeline stage (`stage` manual) the ring's collective-permutes would
        # deadlock XLA:CPU's conditional ticks: gather k/v instead (context_gather.py).
        cp = gathered_context_attention if "stage" in manual_axes() else ring_attention
        return cp(q, k, v, mesh=mesh, causal=causal, zigzag=ordered_for == ring,
                  segment_ids=segment_ids, window=window)
    return _on_one_device(q, k, v, segment_ids, causal=causal, impl=impl, window=window,
                          mesh=mesh)


def _on_one_device(q, k, v, segment_ids, *, causal: bool, impl: AttentionImpl, window, mesh):
    """The platform's kernel for whole sequences: `mesh` None inside a region that is manual
    over every axis already (all-to-all context parallelism), else the active mesh."""
    # JAX's cuDNN mask is top-left aligned; with fewer queries than keys every other kernel
    # aligns bottom-right, so such calls do not go to cuDNN (as with packed segments).
    unaligned = causal and q.shape[1] != k.shape[1]
    kernel_on = functools.partial(choose, impl, dtype=q.dtype,
                                  head_dim=max(q.shape[-1], v.shape[-1]),
                                  segments=segment_ids is not None or unaligned)
    run = functools.partial(_run, causal=causal, mesh=mesh, window=window)
    platform = target_platform()
    if impl is AttentionImpl.CUDNN and platform is None:  # a call outside a Trainer
        if not cudnn_present():
            raise ConfigError("attention(impl='cudnn') needs an NVIDIA GPU with cuDNN, and "
                              "this machine has none; use impl='auto' or 'pallas'.")
        platform = "cuda"
    if platform is not None:
        return run(kernel_on(platform), q, k, v, segment_ids)
    kernels = {platform: kernel_on(platform) for platform in PLATFORMS}
    branches = {kernel: functools.partial(run, kernel)
                for kernel in set(kernels.values()) | {Kernel.XLA}}
    if len(set(kernels.values())) == 1:
        return branches[kernels["cpu"]](q, k, v, segment_ids)
    # One branch per kernel (platform_dependent joins platforms that share a branch); plain
    # XLA is the default for any platform not named.
    per_platform = {p: branches[kernel] for p, kernel in kernels.items() if kernel != Kernel.XLA}
    return lax.platform_dependent(q, k, v, segment_ids, default=branches[Kernel.XLA],
                                  **per_platform)


def _run(kernel: Kernel, q, k, v, segment_ids, *, causal: bool, mesh, window=None):
    if kernel is Kernel.XLA:
        if causal and q.shape[1] == k.shape[1]:
            return blockwise_causal_attention(q, k, v, segment_ids=segment_ids, window=window)
        return reference_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                                   window=window)
    if q.shape[-1] != v.shape[-1]:
        return _run_equal_dims(kernel, q, k, v, segment_ids, causal=causal, mesh=mesh,
                               window=window)
    if kernel is Kernel.CUDNN:  # cuDNN's window (pos - (left + 1), pos]: left = w - 1
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn",
            local_window_size=None if window is None else (window - 1, 0))
    if kernel is Kernel.SPLASH:
        # JAX's TPU kernels load Mosaic's TPU lowering, a tenth of a second of every process's
        # start: only a step that runs splash imports them.
        from jaxtron.kernels.splash import splash_attention
        pallas = splash_attention
    else:
        pallas = {Kernel.TRITON: functools.partial(flash_attention, interpret=False),
                  Kernel.INTERPRET: functools.partial(flash_attention, interpret=True)}[kernel]

    def local(q, k, v, segment_ids):
        return pallas(q, k, v, causal=causal, segment_ids=segment_ids, window=window)

    if mesh is not None and any(size > 1 for size in mesh.shape.values()):
        return per_device(local, q, k, v, segment_ids, mesh)
    return local(q, k, v, segment_ids)


def _run_equal_dims(kernel: Kernel, q, k, v, segment_ids, *, causal: bool, mesh, window):
    """A one-head-dim kernel on q/k of width K and v of width V != K (see the module doc)."""
    k_dim, v_dim = q.shape[-1], v.shape[-1]
    width = max(k_dim, v_dim)

    def pad(x):
        return jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])

    if k_dim < width:  # the kernel scales by 1/sqrt(width): undo it on q
        q = q * jnp.asarray((width / k_dim) ** 0.5, q.dtype)
    out = _run(kernel, pad(q), pad(k), pad(v), segment_ids, causal=causal, mesh=mesh,
               window=window)
    return out[..., :v_dim]
