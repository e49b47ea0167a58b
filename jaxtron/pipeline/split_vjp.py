"""A function's backward pass split in two: B, the input gradient, and W, the weight gradients.

Zero-bubble schedules run B when the previous stage waits for it and W later. A weight
gradient is a local product at each place a parameter is used (a matmul's dW = x^T dy, a norm
scale's sum of dy * x_hat): it needs that place's input activation and the gradient arriving at
its output, never the chain of layers behind it. So the split is made on the linearized
function. `jax.linearize` gives the tangent map T(dparams, dx); partial evaluation with dparams
known and dx unknown splits it into P, the parameter-only terms (each place's local product
with dparams), and R, the rest, which takes P's outputs as inputs u. Then

    B: transpose R at the output cotangent -> (dx, u's cotangents): the backward chain without a
       single weight-gradient product;
    W: transpose P at u's cotangents -> dparams: each place's local product, from the stored
       activations it reads and u's cotangents, nothing recomputed.

The stash handed from B to W is exactly those: the activations P reads and u's cotangents.
Places inside a scan over layers are found inside its body (scan's partial evaluation), so a
stacked layer's dW is per-layer too. Inside `jax.checkpoint` (`model.remat`), whose rule keeps
everything for its recomputation, nothing is split: B then computes those weight gradients
itself and hands them to W unchanged; the numbers are the same either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import partial_eval as pe


class SplitVJP:
    """`input_grad` is B, `weight_grad` W. W runs the products found while tracing B, so a B
    of the same function must have been traced first (in any trace: the stash carries every
    array they read)."""

    def __init__(self):
        self._weight = None  # (jaxpr of W's products, which params it uses, their tree, avals)

    def input_grad(self, fn, params, x, cotangent, tangent_fn=None):
        """-> (dx, stash) of `fn(params, x) -> (outputs, aux)` at the outputs' `cotangent`: the
        input gradient, and the arrays `weight_grad` needs. `tangent_fn(dparams, dx)`, fn's
        tangent map from stored residuals (`stored_vjp.py`), replaces linearizing fn again."""
        if tangent_fn is None:
            _, tangent_fn, _ = jax.linearize(fn, params, x, has_aux=True)
        p_flat, p_tree = jax.tree.flatten(params)
        x_flat, x_tree = jax.tree.flatten(x)

        def tangent(*flat):
            dp = jax.tree.unflatten(p_tree, flat[:len(p_flat)])
            dx = jax.tree.unflatten(x_tree, flat[len(p_flat):])
            return jax.tree.leaves(tangent_fn(dp, dx))

        closed = jax.make_jaxpr(tangent)(*p_flat, *x_flat)
        primal = list(closed.consts)  # the forward's residuals the tangent map reads
        np_, nx, nc = len(p_flat), len(x_flat), len(primal)
        known, unknown, _, res_avals = pe.partial_eval_jaxpr_nounits(
            core.ClosedJaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), ()),
            [False] * (nc + np_) + [True] * nx, instantiate=True)
        # known: (primal, dparams) -> residuals; which of them are linear in dparams (the u's)
        _, _, depends, _ = pe.partial_eval_jaxpr_nounits(
            known, [False] * nc + [True] * np_, instantiate=False)
        known_inputs = list(known.consts) + primal
        known_jaxpr = pe.convert_constvars_jaxpr(known.jaxpr)
        nk = len(known_inputs)
        fixed = [not d for d in depends]
        fixed_jaxpr, fixed_used = pe.dce_jaxpr(known_jaxpr, fixed)
        fixed_values = iter(core.eval_jaxpr(
            fixed_jaxpr, (), *[v for v, used in zip(known_inputs, fixed_used[:nk]) if used],
            *[jnp.zeros_like(a) for a, used in zip(p_flat, fixed_used[nk:]) if used]))
        residuals = [None if d else next(fixed_values) for d in depends]
        linear = [i for i, d in enumerate(depends) if d]

        def rest(u, dx):
            values = list(residuals)
            for i, value in zip(linear, u):
                values[i] = value
            return core.eval_jaxpr(unknown.jaxpr, unknown.consts, *values, *dx)

        zeros = lambda avals: [jnp.zeros(a.shape, a.dtype) for a in avals]  # noqa: E731
        u_cot, dx_cot = jax.linear_transpose(rest, zeros(res_avals[i] for i in linear),
                                             zeros(jax.typeof(a) for a in x_flat))(
            jax.tree.leaves(cotangent))
        weight_jaxpr, weight_used = pe.dce_jaxpr(known_jaxpr, depends)
        self._weight = (weight_jaxpr, weight_used[nk:], p_tree,
                        [jax.typeof(a) for a in p_flat])
        stash = [v for v, used in zip(known_inputs, weight_used[:nk]) if used] + list(u_cot)
        return jax.tree.unflatten(x_tree, dx_cot), stash

    def weight_grad(self, stash):
        """dparams from B's stash: each parameter's local products, summed."""
        weight_jaxpr, params_used, p_tree, p_avals = self._weight
        n_inputs = len(weight_jaxpr.invars) - sum(params_used)
        inputs, u_cot = stash[:n_inputs], stash[n_inputs:]

        def products(dp_used):
            return core.eval_jaxpr(weight_jaxpr, (), *inputs, *dp_used)

        used_avals = [a for a, used in zip(p_avals, params_used) if used]
        (dp_used,) = jax.linear_transpose(
            products, [jnp.zeros(a.shape, a.dtype) for a in used_avals])(list(u_cot))
        dp_used = iter(dp_used)
        flat = [next(dp_used) if used else jnp.zeros(a.shape, a.dtype)
                for a, used in zip(p_avals, params_used)]
        return jax.tree.unflatten(p_tree, flat)
