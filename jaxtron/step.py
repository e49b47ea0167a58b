"""The pure training step: `train_step(state, batch) -> (state, metrics)`.

The step has no flags. How gradients are computed is a function passed in, built by composing
`plain_grads` (one pass over the batch), `sharded_grads` (ZeRO-2 placement) and
`accumulated_grads` (sum over microbatches with `lax.scan`; the optimizer still takes one step
per global batch, and the loss is the same mean).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxtron.models import cross_entropy_loss

GradFn = Callable[[Any, jax.Array], tuple[jax.Array, Any]]


@struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def make_loss_fn(graphdef: nnx.GraphDef) -> Callable[[nnx.State, jax.Array], jax.Array]:
    """loss(params, tokens_Bx(L+1)): next-token cross-entropy of the model `graphdef`."""

    def loss_fn(params, tokens):
        logits_BxLxV = nnx.merge(graphdef, params)(tokens[:, :-1])
        return cross_entropy_loss(logits_BxLxV, tokens[:, 1:])

    return loss_fn


def plain_grads(loss_fn) -> GradFn:
    return jax.value_and_grad(loss_fn)


def sharded_grads(grad_fn: GradFn, shardings) -> GradFn:
    """ZeRO-2: constrain gradients to the optimizer-state sharding as soon as they exist, so the
    data-parallel all-reduce becomes a reduce-scatter and no device holds all gradients."""

    def fn(params, tokens):
        loss, grads = grad_fn(params, tokens)
        return loss, jax.lax.with_sharding_constraint(grads, shardings)

    return fn


def accumulated_grads(grad_fn: GradFn, microbatches: int) -> GradFn:
    """Mean loss and gradients over `microbatches` equal slices of the batch, one at a time.

    Microbatch a takes rows a, a + A, a + 2A, ...: reshaping [B] to [B/A, A] keeps each device's
    contiguous rows of a data-sharded batch on that device, so slicing moves no data.
    """
    def accumulate(params, tokens):
        batch, width = tokens.shape
        tokens_AxMxT = tokens.reshape(batch // microbatches, microbatches, width).swapaxes(0, 1)

        def body(carry, micro_tokens):
            loss_sum, grad_sum = carry
            loss, grads = grad_fn(params, micro_tokens)
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (loss_sum, grad_sum), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros),
                                               tokens_AxMxT)
        return loss_sum / microbatches, jax.tree.map(lambda g: g / microbatches, grad_sum)

    return accumulate


def make_train_step(tx: optax.GradientTransformation, schedule: optax.Schedule,
                    grad_fn: GradFn):
    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        loss, grads = grad_fn(state.params, batch["tokens"])
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": schedule(state.step)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(loss_fn, to_model_params=lambda params: params):
    def eval_step(params, batch: dict) -> jax.Array:
        return loss_fn(to_model_params(params), batch["tokens"])

    return eval_step
