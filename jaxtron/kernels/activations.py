"""Feed-forward activations whose backward keeps only their inputs.

Differentiated by JAX, `silu(gate) * up` keeps six [tokens, F] arrays for the backward (gate,
up, three values inside silu's derivative, the product) and tanh-GELU as many: the largest
activations of a block. These derivatives are written by hand from the inputs alone, so a block
keeps gate and up (GELU: its input) plus the product the down projection needs, and the scan
over layers writes half as much. Values and gradients equal JAX's (`tests/test_model.py`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


@jax.custom_vjp
def swiglu(gate, up):
    """silu(gate) * up (Shazeer 2020)."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, d_out):
    gate, up = residuals
    g = gate.astype(jnp.float32)
    sig = jax.nn.sigmoid(g)
    d_silu = sig * (1 + g * (1 - sig))  # d/dx x sigmoid(x)
    dy = d_out.astype(jnp.float32)
    return ((dy * up.astype(jnp.float32) * d_silu).astype(gate.dtype),
            (dy * g * sig).astype(up.dtype))


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)

_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


@jax.custom_vjp
def gelu_tanh(x):
    """GELU's tanh approximation (Hendrycks & Gimpel 2016), as GPT-2 uses it."""
    return jax.nn.gelu(x, approximate=True)


def _gelu_fwd(x):
    return gelu_tanh(x), x


def _gelu_bwd(x, d_out):
    z = x.astype(jnp.float32)
    t = jnp.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z ** 3))
    d_gelu = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * z * z)
    return ((d_out.astype(jnp.float32) * d_gelu).astype(x.dtype),)


gelu_tanh.defvjp(_gelu_fwd, _gelu_bwd)
