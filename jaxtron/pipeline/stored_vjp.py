"""A backward from the residuals its forward stored, for pipelines that do not recompute.

A pipeline forward that keeps only its stage input must run the stage again in the backward:
one more forward per microbatch (a third more compute). Keeping the residuals instead (what
the backward reads: each layer's activations, attention statistics, masks) spends memory on
the microbatches in flight and saves that forward, Megatron-LM's default.

The residuals are those of the stage's tangent map (`jax.linearize`). Many depend on the
weights alone (a weight itself, read by dx = dy W^T; its cast to the compute dtype): storing
those per microbatch would keep a copy of the stage's weights in every slot. So the forward,
traced as a function of (params, x), is partially evaluated with params known: the residuals
that depend on x are stored, the others are recomputed from the weights in the backward
(casts and reshapes, no layer work). The backward is the transpose of the tangent map at the
output cotangent, with the same jaxpr the forward traced. The jaxprs are traced once per rank
and evaluated in each job's own branch of the loop on that branch's values, so no value
crosses from one branch to another.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import partial_eval as pe


@dataclasses.dataclass(frozen=True)
class _Traced:
    forward: core.ClosedJaxpr  # (params, x, where) -> (outputs, aux, residuals)
    tangent: core.Jaxpr        # (residuals, dparams, dx) -> doutputs
    n_out: int                 # leaves of outputs
    out_tree: object
    aux_tree: object
    n_aux: int
    stored: list               # per residual: True where it depends on x (stored)


def _trace(fn, params, x, where) -> _Traced:
    p_flat, p_tree = jax.tree.flatten(params)
    x_flat, x_tree = jax.tree.flatten(x)
    w_flat, w_tree = jax.tree.flatten(where)
    n_p, n_x = len(p_flat), len(x_flat)
    box = {}

    def forward(*flat):
        p = jax.tree.unflatten(p_tree, flat[:n_p])
        xs = jax.tree.unflatten(x_tree, flat[n_p:n_p + n_x])
        w = jax.tree.unflatten(w_tree, flat[n_p + n_x:])
        out, tangent_fn, aux = jax.linearize(lambda p, xs: fn(p, xs, w), p, xs, has_aux=True)

        def tangent(*dflat):
            dp = jax.tree.unflatten(p_tree, dflat[:n_p])
            dx = jax.tree.unflatten(x_tree, dflat[n_p:])
            return jax.tree.leaves(tangent_fn(dp, dx))

        closed = jax.make_jaxpr(tangent)(*flat[:n_p + n_x])
        out_flat, out_tree = jax.tree.flatten(out)
        aux_flat, aux_tree = jax.tree.flatten(aux)
        box.update(tangent=pe.convert_constvars_jaxpr(closed.jaxpr), out_tree=out_tree,
                   aux_tree=aux_tree, n_out=len(out_flat), n_aux=len(aux_flat))
        return [*out_flat, *aux_flat, *closed.consts]

    closed = jax.make_jaxpr(forward)(*p_flat, *x_flat, *w_flat)
    n_lead = box["n_out"] + box["n_aux"]
    _, _, unknown, _ = pe.partial_eval_jaxpr_nounits(
        closed, [False] * n_p + [True] * n_x + [False] * len(w_flat), instantiate=False)
    return _Traced(closed, box["tangent"], box["n_out"], box["out_tree"], box["aux_tree"],
                   box["n_aux"], list(unknown[n_lead:]))


class StoredVJP:
    """For one function fn(params, x, where) -> (outputs, aux), `where` what it reads besides
    its parameters and input (which microbatch and chunk) and is not differentiated: `forward`
    runs fn and returns the residuals to store; `backward` turns them, the weights and an
    output cotangent into (dparams, dx).

    fn is traced once per argument types and that trace serves every later call: a rank's
    forward, R, B and the loop carry's shapes all run the same stage. Its constants are what
    fn closes over, so fn may close only over values that outlive every call (a rank's, not a
    tick's); a tick's values come in through `where`."""

    def __init__(self, fn):
        self.fn = fn
        self._traces: dict[tuple, _Traced] = {}

    def _traced(self, params, x, where) -> _Traced:
        leaves, tree = jax.tree.flatten((params, x, where))
        key = (tree, tuple(jax.typeof(a) for a in leaves))
        if key not in self._traces:
            self._traces[key] = _trace(self.fn, params, x, where)
        return self._traces[key]

    def residual_shapes(self, params, x, where) -> list[jax.ShapeDtypeStruct]:
        """The shapes of the residuals `forward` stores."""
        traced = self._traced(params, x, where)
        n_lead = traced.n_out + traced.n_aux
        return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                for v, keep in zip(traced.forward.jaxpr.outvars[n_lead:], traced.stored) if keep]

    def forward(self, params, x, where):
        """-> (outputs, aux, stored): `stored` the residuals that depend on x."""
        traced = self._traced(params, x, where)
        values = core.eval_jaxpr(traced.forward.jaxpr, traced.forward.consts,
                                 *jax.tree.leaves(params), *jax.tree.leaves(x),
                                 *jax.tree.leaves(where))
        n_lead = traced.n_out + traced.n_aux
        outputs = jax.tree.unflatten(traced.out_tree, values[:traced.n_out])
        aux = jax.tree.unflatten(traced.aux_tree, values[traced.n_out:n_lead])
        stored = [v for v, keep in zip(values[n_lead:], traced.stored) if keep]
        return outputs, aux, stored

    def tangent_map(self, params, x, where, stored):
        """fn's tangent map at the stored point, (dparams, dx) -> the outputs' tangent leaves:
        what `backward` transposes, or a split backward (`split_vjp.py`) partially
        evaluates. `x` gives only shapes: nothing of the forward is recomputed."""
        traced = self._traced(params, x, where)
        p_flat = jax.tree.leaves(params)
        x_flat = jax.tree.leaves(x)
        n_lead = traced.n_out + traced.n_aux
        from_weights = [n_lead + i for i, keep in enumerate(traced.stored) if not keep]
        weights_jaxpr, used = pe.dce_jaxpr(
            pe.convert_constvars_jaxpr(traced.forward.jaxpr),
            [i in from_weights for i in range(len(traced.forward.jaxpr.outvars))])
        inputs = [*traced.forward.consts, *p_flat, *(jnp.zeros_like(v) for v in x_flat),
                  *jax.tree.leaves(where)]
        recomputed = iter(core.eval_jaxpr(weights_jaxpr, (),
                                          *[v for v, u in zip(inputs, used) if u]))
        stored = iter(stored)
        residuals = [next(stored) if keep else next(recomputed) for keep in traced.stored]

        def tangent(dparams, dx):
            return core.eval_jaxpr(traced.tangent, (), *residuals, *jax.tree.leaves(dparams),
                                   *jax.tree.leaves(dx))

        return tangent

    def backward(self, params, x, where, stored, cotangent):
        """-> (dparams, dx) at `cotangent` (a tree like fn's outputs), from the stored
        residuals."""
        tangent = self.tangent_map(params, x, where, stored)
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
        return jax.linear_transpose(tangent, zeros(params), zeros(x))(jax.tree.leaves(cotangent))
