"""The backward split into B (input gradient) and W (weight gradients) for zero-bubble
pipelines: together they equal `jax.vjp`, B forms no weight-gradient product, and W runs in
another compiled program from B's stash alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.pipeline.split_vjp import SplitVJP

LAYERS, WIDTH, ROWS, OUT = 3, 8, 4, 5


def stage(params, x, remat=False):
    """A scan over layers (a residual MLP with a norm-like scale), a head behind a cond, and
    an auxiliary term: the shapes of a pipeline stage."""
    def layer(h, w):
        return h + jnp.tanh(h @ w["up"]) @ w["down"] * w["scale"], None

    h, _ = jax.lax.scan(jax.checkpoint(layer) if remat else layer, x, params["layers"])
    y = jax.lax.cond(params["head"][0, 0] > -1e9, lambda: h @ params["head"],
                     lambda: jnp.zeros((ROWS, OUT)))
    return (y, 0.1 * jnp.sum(h ** 2)), {"mean": jnp.mean(h)}


def problem():
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    params = {"layers": {"up": 0.3 * jax.random.normal(k[0], (LAYERS, WIDTH, WIDTH)),
                         "down": 0.3 * jax.random.normal(k[1], (LAYERS, WIDTH, WIDTH)),
                         "scale": jax.random.normal(k[2], (LAYERS, WIDTH))},
              "head": jax.random.normal(k[3], (WIDTH, OUT))}
    x = jax.random.normal(k[4], (ROWS, WIDTH))
    cotangent = (jax.random.normal(k[5], (ROWS, OUT)), jnp.float32(0.7))
    return params, x, cotangent


def dot_shapes(jaxpr) -> list[tuple[int, ...]]:
    """Output shapes of every dot_general in a jaxpr and the jaxprs inside it."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shapes.append(tuple(eqn.outvars[0].aval.shape))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns"):
                    shapes += dot_shapes(inner)
    return shapes


@pytest.mark.parametrize("remat", [False, True])
def test_b_then_w_in_separate_programs_equal_the_vjp(remat):
    params, x, cotangent = problem()
    fn = lambda p, x: stage(p, x, remat)  # noqa: E731
    split = SplitVJP()
    dx, stash = jax.jit(lambda p, x, c: split.input_grad(fn, p, x, c))(params, x, cotangent)
    dparams = jax.jit(split.weight_grad)(stash)  # another compiled program: the stash is all
    _, vjp, _ = jax.vjp(fn, params, x, has_aux=True)
    want_params, want_dx = vjp(cotangent)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(dparams), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_b_forms_no_weight_gradient_and_w_no_input_gradient():
    params, x, cotangent = problem()
    split = SplitVJP()
    b = jax.make_jaxpr(lambda p, x, c: split.input_grad(stage, p, x, c))(params, x, cotangent)
    _, stash = split.input_grad(stage, params, x, cotangent)
    w = jax.make_jaxpr(split.weight_grad)(stash)
    weight_shapes = {(WIDTH, WIDTH), (WIDTH, OUT), (OUT, WIDTH)}  # dW, or its transpose
    b_dots, w_dots = dot_shapes(b.jaxpr), dot_shapes(w.jaxpr)
    # B: the forward's 2 per layer + the head, the backward's 2 per layer + the head's dx
    assert not weight_shapes & set(b_dots), b_dots
    assert len(b_dots) == 2 * (2 * 1 + 1), b_dots  # scan bodies count once
    # W: one product per matrix (per layer inside its scan), none towards the input
    assert set(w_dots) <= weight_shapes, w_dots
    assert len(w_dots) == 3, w_dots


def test_b_and_w_together_cost_one_backward():
    """From the compiled programs: B's and W's FLOPs add up to the whole backward's (forward
    recomputed once, in B), and W carries a real share of them."""
    params, x, cotangent = problem()

    def flops(fn, *args):
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    def whole(p, x, c):
        _, vjp, _ = jax.vjp(stage, p, x, has_aux=True)
        return vjp(c)

    split = SplitVJP()
    b = flops(lambda p, x, c: split.input_grad(stage, p, x, c), params, x, cotangent)
    _, stash = split.input_grad(stage, params, x, cotangent)
    w = flops(split.weight_grad, stash)
    backward = flops(whole, params, x, cotangent)
    assert abs(b + w - backward) < 0.05 * backward, (b, w, backward)
    assert w > 0.2 * backward, (b, w, backward)
