"""Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training") for the hidden
matrices, AdamW's moments for the rest, one learning-rate schedule and decoupled weight decay.

A hidden matrix is a parameter with at least two axes besides the stacking ones (`layers`,
`stage`, `expert`: each layer's and each expert's matrix is orthogonalised on its own) that
reads from or writes to the residual stream or a latent (`embed`, `latent`), and is neither the
embedding nor the head (`vocab`) nor the router (an unnamed expert axis). Its input side is the
reduction axis, e.g. wq [D | H, K], wo [H, K | D], w_down [F | D]. Norm scales, biases, the
embedding, the head and the router keep Adam's update.

The matrix update is optax's `scale_by_muon` (Nesterov momentum with bias correction, five
quintic Newton-Schulz steps on the Frobenius-normalised momentum), times
0.2 sqrt(max(fan_in, fan_out)) so that its RMS matches AdamW's and the same `optim.lr` and
`weight_decay` apply (Moonlight's consistent-RMS rule).

Sharding: the orthogonalisation runs on each matrix whole in the math, on the matrix as the
mesh shards it in the program: its matmuls (X Xᵀ) are partitioned by GSPMD, which inserts the
collectives; the numbers equal one device's (`tests/test_muon.py`), and the collective bytes
the extra work costs are measured there under fsdp.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from jaxtron.sharding.rules import logical_names

STACKING = ("layers", "stage", "expert")
CONSISTENT_RMS = 0.2


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def matrix_dimensions(variable: nnx.Variable) -> MuonDimensionNumbers | None:
    """(reduction, output) axes of a hidden matrix; None for a parameter Adam updates."""
    names = logical_names(variable)
    core = [i for i, name in enumerate(names) if name not in STACKING]
    core_names = [names[i] for i in core]
    if (len(core) < 2 or None in core_names or "vocab" in core_names
            or not {"embed", "latent"} & set(core_names)):
        return None
    if core_names[-1] == "embed":  # writes to the residual stream
        return MuonDimensionNumbers(tuple(core[:-1]), (core[-1],))
    return MuonDimensionNumbers((core[0],), tuple(core[1:]))


def labels(params):
    return jax.tree.map(lambda v: v.replace("adam" if matrix_dimensions(v) is None else "muon"),
                        params, is_leaf=_is_variable)


def _dimensions(updates):
    """The dimension numbers of the muon partition's leaves (others stay masked)."""
    def one(variable):
        if isinstance(variable.get_value(), optax.MaskedNode):
            return variable
        return variable.replace(matrix_dimensions(variable))
    return jax.tree.map(one, updates, is_leaf=_is_variable)


def _consistent_rms() -> optax.GradientTransformation:
    def update(updates, state, params=None):
        def scale(variable):
            value = variable.get_value()
            if isinstance(value, optax.MaskedNode):
                return variable
            dims = matrix_dimensions(variable)
            fan_in = math.prod(value.shape[a] for a in dims.reduction_axis)
            fan_out = math.prod(value.shape[a] for a in dims.output_axis)
            factor = CONSISTENT_RMS * math.sqrt(max(fan_in, fan_out))
            return variable.replace(value * jnp.asarray(factor, value.dtype))
        return jax.tree.map(scale, updates, is_leaf=_is_variable), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def muon_directions(*, momentum: float, ns_steps: int, b1: float, b2: float,
                    eps: float) -> optax.GradientTransformation:
    """Update directions before weight decay and the learning rate: Muon's for the hidden
    matrices, Adam's for the rest."""
    return optax.partition(
        {"muon": optax.chain(scale_by_muon(beta=momentum, ns_steps=ns_steps,
                                           weight_dimension_numbers=_dimensions),
                             _consistent_rms()),
         "adam": optax.scale_by_adam(b1=b1, b2=b2, eps=eps)},
        labels)
