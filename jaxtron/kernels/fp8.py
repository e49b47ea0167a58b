"""FP8 matmuls with per-tensor current scaling (`model.fp8: tensorwise`).

Forward: the input and the weight are each scaled by amax / 448 into e4m3 and multiplied as
fp8 (`dot_general` on float8_e4m3fn operands, fp32 accumulation), the product rescaled by both
scales. Backward: the output gradient is scaled into e5m2 (wider range, for gradients), and the
two gradient matmuls run on it and the stored e4m3 copies of the forward's operands (the
residuals are kept in fp8: a quarter of fp32's bytes). Master weights and everything outside
these matmuls keep their dtypes (Micikevicius et al. 2022, "FP8 Formats for Deep Learning";
Transformer Engine's and Megatron's `--fp8-recipe tensorwise`, with current scaling).

On GPUs the lowered step carries the fp8 `dot_general`s themselves (cuBLASLt fp8 gemms on
Hopper and later); XLA:CPU computes them exactly in wider types, so CPU runs give fp8's numbers
at CPU speed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _varying(x) -> tuple[str, ...]:
    """Manual mesh axes (inside a shard_map) over which x differs from device to device."""
    return tuple(sorted(jax.typeof(x).manual_axis_type.varying))


def quantize(x, dtype):
    """(x / scale in `dtype`, scale) with scale = amax(|x|) / the format's largest value. Inside
    a shard_map the amax is taken over the whole tensor (a max over the axes x is split over),
    so every layout scales as one device does."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    if _varying(x):
        amax = jax.lax.pmax(amax, _varying(x))
    amax = jax.lax.stop_gradient(amax)
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
    return (x.astype(jnp.float32) / scale).astype(dtype), scale


def _specs(spec: str) -> tuple[str, str, str]:
    inputs, out = spec.replace(" ", "").split("->")
    a, b = inputs.split(",")
    return a, b, out


def _dot(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(spec: str, x, w):
    """jnp.einsum(spec, x, w) through fp8, in x's dtype. Every index must appear in two of the
    three terms (true of every projection: batch, contracted and kept axes)."""
    return _forward(spec, x, w)[0]


def _forward(spec, x, w):
    xq, sx = quantize(x, E4M3)
    wq, sw = quantize(w, E4M3)
    y = (_dot(spec, xq, wq) * (sx * sw)).astype(x.dtype)
    # Empty slices carry the operands' dtypes and manual-axis types (residuals are arrays).
    return y, (xq, sx, wq, sw, x.reshape(-1)[:0], w.reshape(-1)[:0])


def _backward(spec, residuals, g):
    xq, sx, wq, sw, x_like, w_like = residuals
    a, b, out = _specs(spec)
    gq, sg = quantize(g, E5M2)
    dx = _dot(f"{out},{b}->{a}", gq, wq) * (sg * sw)
    dw = _dot(f"{a},{out}->{b}", xq, gq) * (sx * sg)
    # Inside a shard_map an operand shared by the devices of an axis (the experts' weights
    # over the batch axes) gets the sum of their contributions, as autodiff's transpose does.
    dx, dw = (_sum_to(d, like) for d, like in ((dx, x_like), (dw, w_like)))
    return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


def _sum_to(gradient, like):
    extra = tuple(sorted(set(_varying(gradient)) - set(_varying(like))))
    return jax.lax.psum(gradient, extra) if extra else gradient


fp8_einsum.defvjp(_forward, _backward)


def einsum(spec: str, x, w, fp8: str = "none"):
    """A projection's einsum: plain, or through fp8 (`model.fp8`)."""
    return jnp.einsum(spec, x, w) if fp8 == "none" else fp8_einsum(spec, x, w)
