"""The pure training step: `train_step(state, batch) -> (state, metrics)`.

The step has no flags. How gradients are computed is a function passed in, built by composing
`plain_grads` (one pass over the batch), `accumulated_grads` (sum over microbatches with
`lax.scan`; the optimizer still takes one step per global batch, and the loss is the same mean)
and `sharding.data_parallel.reduce_once` (one data-parallel reduction per step; ZeRO-2's
reduce-scatter).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxtron.sharding.zigzag import in_zigzag_order


# (params, tokens) -> ((objective, metrics), grads); metrics["loss"] is the language-model loss,
# the objective adds any auxiliary terms (mixture-of-experts balancing).
GradFn = Callable[[Any, jax.Array], tuple[tuple[jax.Array, dict], Any]]


@struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def make_loss_fn(graphdef: nnx.GraphDef, sequence_ring: int = 1):
    """loss(params, tokens_Bx(L+1)) -> (objective, metrics) for the model `graphdef`: next-token
    cross-entropy plus the model's weighted auxiliary losses. With `sequence_ring` > 1 (ring
    attention over that many devices) the model sees each sequence in the ring's zig-zag order,
    set here once instead of in every layer (`jaxtron.sharding.zigzag`): the same mean loss."""

    def loss_fn(params, tokens):
        model_loss = nnx.merge(graphdef, params).loss
        if sequence_ring > 1:
            model_loss = in_zigzag_order(model_loss, sequence_ring)
        loss, aux = model_loss(tokens[:, :-1], tokens[:, 1:])
        objective = loss + sum(aux.pop("weighted_terms", []), jnp.zeros((), jnp.float32))
        return objective, {"loss": loss, **aux}

    return loss_fn


def plain_grads(loss_fn) -> GradFn:
    return jax.value_and_grad(loss_fn, has_aux=True)


def accumulated_grads(grad_fn: GradFn, microbatches: int) -> GradFn:
    """Mean loss and gradients over `microbatches` equal slices of the batch, one at a time.

    Microbatch a takes rows a, a + A, a + 2A, ...: reshaping [B] to [B/A, A] keeps each device's
    contiguous rows of a data-sharded batch on that device, so slicing moves no data.
    """
    def accumulate(params, tokens):
        batch, width = tokens.shape
        tokens_AxMxT = tokens.reshape(batch // microbatches, microbatches, width).swapaxes(0, 1)

        def body(grad_sum, micro_tokens):
            out, grads = grad_fn(params, micro_tokens)
            return jax.tree.map(jnp.add, grad_sum, grads), out

        zeros = jax.tree.map(jnp.zeros_like, params)
        grad_sum, outs = jax.lax.scan(body, zeros, tokens_AxMxT)
        mean = jax.tree.map(lambda x: jnp.mean(x, axis=0), outs)
        return mean, jax.tree.map(lambda g: g / microbatches, grad_sum)

    return accumulate


def make_train_step(tx: optax.GradientTransformation, schedule: optax.Schedule,
                    grad_fn: GradFn):
    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        (_, metrics), grads = grad_fn(state.params, batch["tokens"])
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        skipped_before = optax.tree_utils.tree_get(state.opt_state, "total_notfinite")
        skipped = optax.tree_utils.tree_get(opt_state, "total_notfinite")
        # The rate this update applied: the schedule advances only with applied updates
        # (optax.apply_if_finite leaves the inner state alone), and a skipped one applied none.
        lr = jnp.where(skipped > skipped_before, 0.0, schedule(state.step - skipped_before))
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "lr": lr,
                   "skipped_updates": skipped}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(loss_fn, to_model_params=lambda params: params):
    def eval_step(params, batch: dict) -> jax.Array:
        return loss_fn(to_model_params(params), batch["tokens"])[1]["loss"]

    return eval_step
