"""FP8 matmuls with per-tensor current scaling (`model.fp8: tensorwise`).

Forward: the input and the weight are each scaled by amax / 448 into e4m3 and multiplied as
fp8 (`dot_general` on float8_e4m3fn operands, fp32 accumulation), the product rescaled by both
scales. Backward: the output gradient is scaled into e5m2 (wider range, for gradients), and the
two gradient matmuls run on it and the stored e4m3 copies of the forward's operands (the
residuals are kept in fp8: a quarter of fp32's bytes). Master weights and everything outside
these matmuls keep their dtypes (Micikevicius et al. 2022, "FP8 Formats for Deep Learning";
Transformer Engine's and Megatron's `--fp8-recipe tensorwise`, with current scaling).

`model.fp8: delayed` (Transformer Engine's DelayedScaling, Megatron's `--fp8-recipe delayed`)
scales each operand by the largest amax of the last `model.fp8_amax_history` steps instead of
the current one, so no step waits for a max over its own tensor before quantising; values past
the stale range saturate at the format's largest value. Each fp8 matmul owns a [history, 3]
parameter, `fp8_amax_history` (columns: input, weight, output gradient; row 0 the newest). Its
"gradient" carries this step's three amaxes back out of the backward pass (the gradient's amax
only exists there), and the train step writes them into the history instead of letting the
optimizer see them (`split_observed_amaxes`, `record_amaxes`). Reductions of these observations
take the max, never the sum: over microbatches (`combine`) and over data-parallel ranks. An
empty history (the first step) scales by the current amax. Gradient amaxes are recorded for the
gradient of the whole step's loss: a microbatch of 1/parts of the batch differentiates its own
mean, `parts` times larger (`gradient_parts`, set by the Trainer), so its observation is divided
by `parts` and its scale multiplied by it; the history then means the same under any
accumulation or data-parallel layout, and a run resumed on another one scales as before.

On GPUs the lowered step carries the fp8 `dot_general`s themselves (cuBLASLt fp8 gemms on
Hopper and later); XLA:CPU computes them exactly in wider types, so CPU runs give fp8's numbers
at CPU speed.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _varying(x) -> tuple[str, ...]:
    """Manual mesh axes (inside a shard_map) over which x differs from device to device."""
    return tuple(sorted(jax.typeof(x).manual_axis_type.varying))


HISTORY = "fp8_amax_history"  # the parameter of delayed scaling; see the module docstring
_GRADIENT_PARTS = contextvars.ContextVar("jaxtron_fp8_gradient_parts", default=1)


@contextlib.contextmanager
def gradient_parts(parts: int):
    """While tracing a gradient whose loss is the mean over 1/`parts` of the step's batch
    (a microbatch of accumulation on one data-parallel rank): the loss gradients it sees are
    `parts` times those of the step's loss."""
    token = _GRADIENT_PARTS.set(parts)
    try:
        yield
    finally:
        _GRADIENT_PARTS.reset(token)


def amax_of(x):
    """max |x| over the whole tensor: inside a shard_map also over the axes x is split over,
    so every layout scales as one device does."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    if _varying(x):
        amax = jax.lax.pmax(amax, _varying(x))
    return jax.lax.stop_gradient(amax)


def to_fp8(x, amax, dtype):
    """(x / scale in `dtype`, scale), scale = amax / the format's largest value; values beyond
    amax (a delayed scale's stale range) saturate instead of overflowing to NaN."""
    largest = float(jnp.finfo(dtype).max)
    scale = jnp.where(amax > 0, amax / largest, 1.0)
    return jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(dtype), scale


def quantize(x, dtype):
    """Current scaling: x in `dtype` scaled by its own amax, and the scale."""
    return to_fp8(x, amax_of(x), dtype)


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


def _scaled_product(spec, x, w, amax_x, amax_w):
    """y = x w through e4m3 at the given amaxes; -> (y, the operands the gradients need)."""
    xq, sx = to_fp8(x, amax_x, E4M3)
    wq, sw = to_fp8(w, amax_w, E4M3)
    y = (_dot(spec, xq, wq) * (sx * sw)).astype(x.dtype)
    # Empty slices carry the operands' dtypes and manual-axis types (residuals are arrays).
    return y, (xq, sx, wq, sw, x.reshape(-1)[:0], w.reshape(-1)[:0])


def _scaled_gradients(spec, operands, g, amax_g):
    """(dx, dw) of `_scaled_product` for the output gradient g, through e5m2 at `amax_g`."""
    xq, sx, wq, sw, x_like, w_like = operands
    a, b, out = _specs(spec)
    gq, sg = to_fp8(g, amax_g, E5M2)
    dx = _dot(f"{out},{b}->{a}", gq, wq) * (sg * sw)
    dw = _dot(f"{a},{out}->{b}", xq, gq) * (sx * sg)
    # Inside a shard_map an operand shared by the devices of an axis (the experts' weights
    # over the batch axes) gets the sum of their contributions, as autodiff's transpose does.
    dx, dw = (_sum_to(d, like) for d, like in ((dx, x_like), (dw, w_like)))
    return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


def _forward(spec, x, w):
    return _scaled_product(spec, x, w, amax_of(x), amax_of(w))


def _backward(spec, operands, g):
    return _scaled_gradients(spec, operands, g, amax_of(g))


def _sum_to(gradient, like):
    extra = tuple(sorted(set(_varying(gradient)) - set(_varying(like))))
    return jax.lax.psum(gradient, extra) if extra else gradient


fp8_einsum.defvjp(_forward, _backward)


# Dropless experts' grouped matmul (models/moe.py): x[B, A, D] ragged along A per row b (group
# sizes [B, E]) times w[E, D, F]; and its two transposes, as JAX's own ragged_dot_general
# transpose rules write them: dx[B, A, D] = g[B, A, F] x w[E, D, F] grouped the same way, and
# dw[E, D, F] = x^T g contracted over (B, A) within each group.
GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([2], [1]), ([], [])), lhs_ragged_dimensions=[1],
    rhs_group_dimensions=[0])
_GROUPED_DX = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([2], [2]), ([], [])), lhs_ragged_dimensions=[1],
    rhs_group_dimensions=[0])
_GROUPED_DW = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0, 1], [0, 1]), ([], [])), lhs_ragged_dimensions=[1],
    rhs_group_dimensions=[])


def _ragged(a, b, sizes, numbers):
    return jax.lax.ragged_dot_general(a, b, sizes, numbers,
                                      preferred_element_type=jnp.float32)


@jax.custom_vjp
def fp8_grouped_matmul(x_BxAxD, w_ExDxF, sizes_BxE):
    """The dropless experts' grouped matmul through fp8 with current per-tensor scales, as
    `fp8_einsum` (e4m3 operands, e5m2 output gradient)."""
    return _grouped_forward(x_BxAxD, w_ExDxF, sizes_BxE)[0]


def _grouped_forward(x, w, sizes):
    xq, sx = quantize(x, E4M3)
    wq, sw = quantize(w, E4M3)
    y = (_ragged(xq, wq, sizes, GROUPED) * (sx * sw)).astype(x.dtype)
    return y, (xq, sx, wq, sw, sizes, x.reshape(-1)[:0], w.reshape(-1)[:0])


def _grouped_backward(residuals, g):
    xq, sx, wq, sw, sizes, x_like, w_like = residuals
    gq, sg = quantize(g, E5M2)
    dx = _ragged(gq, wq, sizes, _GROUPED_DX) * (sg * sw)
    dw = _ragged(xq, gq, sizes, _GROUPED_DW) * (sx * sg)
    dx, dw = (_sum_to(d, like) for d, like in ((dx, x_like), (dw, w_like)))
    return dx.astype(x_like.dtype), dw.astype(w_like.dtype), None


fp8_grouped_matmul.defvjp(_grouped_forward, _grouped_backward)


def grouped_matmul(x_BxAxD, w_ExDxF, sizes_BxE, fp8: str = "none"):
    """y[b, a] = x[b, a] @ w[e] for the expert e whose group (in row b's order) holds a: plain,
    or through fp8 (`model.fp8`; experts scale by current amaxes in both fp8 modes)."""
    if fp8 == "none":
        return jax.lax.ragged_dot_general(x_BxAxD, w_ExDxF, sizes_BxE, GROUPED)
    return fp8_grouped_matmul(x_BxAxD, w_ExDxF, sizes_BxE)


def _delayed(history_col, current):
    """The amax a delayed scale uses: the history's largest, or the current one while the
    history is still empty."""
    past = jnp.max(history_col)
    return jnp.where(past > 0, past, current)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_delayed_einsum(spec: str, x, w, history_Hx3):
    """`fp8_einsum` with delayed scales from `history_Hx3`; the cotangent of the history is
    zero but for row 0, this step's amaxes (input, weight, output gradient)."""
    return _delayed_forward(spec, x, w, history_Hx3)[0]


def _delayed_forward(spec, x, w, history_Hx3):
    history_Hx3 = jax.lax.stop_gradient(history_Hx3)
    ax, aw = amax_of(x), amax_of(w)
    y, operands = _scaled_product(spec, x, w, _delayed(history_Hx3[:, 0], ax),
                                  _delayed(history_Hx3[:, 1], aw))
    return y, (operands, ax, aw, history_Hx3)


def _delayed_backward(spec, residuals, g):
    operands, ax, aw, history_Hx3 = residuals
    ag, parts = amax_of(g), _GRADIENT_PARTS.get()
    dx, dw = _scaled_gradients(spec, operands, g, _delayed(history_Hx3[:, 2] * parts, ag))
    observed = jnp.zeros_like(history_Hx3).at[0].set(
        jnp.stack([ax, aw, ag / parts]).astype(history_Hx3.dtype))
    return dx, dw, observed


fp8_delayed_einsum.defvjp(_delayed_forward, _delayed_backward)


def einsum(spec: str, x, w, fp8: str = "none", history_Hx3=None):
    """A projection's einsum: plain, or through fp8 (`model.fp8`); `delayed` needs this
    matmul's amax history."""
    if fp8 == "none":
        return jnp.einsum(spec, x, w)
    if fp8 == "delayed" and history_Hx3 is not None:
        return fp8_delayed_einsum(spec, x, w, history_Hx3)
    return fp8_einsum(spec, x, w)


def is_history(path) -> bool:
    return any(getattr(key, "key", None) == HISTORY for key in path)


def combine(path, total, observed):
    """Accumulating one microbatch's gradients: sums, but the max of observed amaxes."""
    return jnp.maximum(total, observed) if is_history(path) else total + observed


def split_observed_amaxes(grads):
    """(gradients with the histories' entries zeroed, so the optimizer and the gradient norm
    never see them; this step's observed amaxes, the same tree)."""
    clean = jax.tree_util.tree_map_with_path(
        lambda path, g: jnp.zeros_like(g) if is_history(path) else g, grads)
    return clean, grads


def record_amaxes(params, observed):
    """Every history shifted down one row, this step's amaxes in row 0 (a non-finite amax,
    an overflowed step, keeps the old history)."""
    def record(path, history, seen):
        if not is_history(path):
            return history
        newest = seen[..., 0:1, :]
        shifted = jnp.concatenate([newest, history[..., :-1, :]], axis=-2)
        return jnp.where(jnp.all(jnp.isfinite(newest)), shifted, history)

    return jax.tree_util.tree_map_with_path(record, params, observed)
