"""The pure training step: `train_step(state, batch) -> (state, metrics)`.

The step has no flags. How gradients are computed is a function passed in, built by composing
`plain_grads` (one pass over the batch), `accumulated_grads` (sum over microbatches with
`lax.scan`; the optimizer still takes one step per global batch, and the loss is the same mean)
and `sharding.data_parallel.reduce_once` (one data-parallel reduction per step; ZeRO-2's
reduce-scatter). Delayed fp8 scaling's amax histories ride along as parameters whose gradients
are the step's observed amaxes: those are combined by max and written into the histories
after the update (`kernels/fp8.py`).

A batch is a dict of [B, ...] arrays (`jaxtron.data.batch`): `tokens` (inputs and shifted
targets), and for packed rows `positions` / `segment_ids`, and `loss_mask` where only some
targets count. The mask becomes `loss_weights` once per step, over the whole global batch
(`counted_tokens_mean`): scaled so that the plain mean over all tokens is the mean over the
counted ones. Every microbatch and data-parallel rank then averages equal-sized shards as
before, and the step's loss is the global mean over counted tokens however unevenly the mask
falls across microbatches (Megatron divides by the global number of loss tokens the same way).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxtron.kernels import fp8
from jaxtron.models.moe import update_router_bias
from jaxtron.models.token_positions import TokenPositions
from jaxtron.sharding.zigzag import in_zigzag_order


# (params, batch) -> ((objective, metrics), grads); metrics["loss"] is the language-model loss,
# the objective adds any auxiliary terms (mixture-of-experts balancing).
GradFn = Callable[[Any, jax.Array], tuple[tuple[jax.Array, dict], Any]]


@struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def counted_tokens_mean(batch: dict) -> dict:
    """`loss_mask` -> `loss_weights` = mask x (B x L) / (counted tokens in the batch): the mean
    of nll x weights over all B x L targets is then the mean over the counted ones."""
    if "loss_mask" not in batch:
        return batch
    batch = dict(batch)
    mask = batch.pop("loss_mask").astype(jnp.float32)
    batch["loss_weights"] = mask * (mask.size / jnp.maximum(jnp.sum(mask), 1.0))
    return batch


def model_inputs(batch: dict):
    """A batch -> (inputs_BxL, targets_BxL, TokenPositions, weights_BxL or None)."""
    if "loss_mask" in batch:  # a mask read as weights would average over a microbatch only
        raise ValueError("the batch holds a raw loss_mask: pass it through "
                         "counted_tokens_mean(batch) over the whole global batch first.")
    tokens = batch["tokens"]
    token_pos = TokenPositions(positions=batch.get("positions"), segment_ids=batch.get("segment_ids"))
    return tokens[:, :-1], tokens[:, 1:], token_pos, batch.get("loss_weights")


def make_loss_fn(graphdef: nnx.GraphDef, sequence_ring: int = 1):
    """loss(params, batch) -> (objective, metrics) for the model `graphdef`: next-token
    cross-entropy plus the model's weighted auxiliary losses. With `sequence_ring` > 1 (ring
    attention over that many devices) the model sees each sequence in the ring's zig-zag order,
    set here once instead of in every layer (`jaxtron.sharding.zigzag`): the same mean loss."""

    def loss_fn(params, batch):
        model_loss = nnx.merge(graphdef, params).loss
        if sequence_ring > 1:
            model_loss = in_zigzag_order(model_loss, sequence_ring)
        loss, aux = model_loss(*model_inputs(batch))
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
    def accumulate(params, batch):
        batch_AxMx = jax.tree.map(lambda a: a.reshape(a.shape[0] // microbatches, microbatches,
                                                      *a.shape[1:]).swapaxes(0, 1), batch)

        def body(grad_sum, micro_batch):
            out, grads = grad_fn(params, micro_batch)
            return jax.tree_util.tree_map_with_path(fp8.combine, grad_sum, grads), out

        zeros = jax.tree.map(jnp.zeros_like, params)
        grad_sum, outs = jax.lax.scan(body, zeros, batch_AxMx)
        mean = jax.tree.map(lambda x: jnp.mean(x, axis=0), outs)
        return mean, jax.tree_util.tree_map_with_path(
            lambda path, g: g if fp8.is_history(path) else g / microbatches, grad_sum)

    return accumulate


def make_train_step(tx: optax.GradientTransformation, schedule: optax.Schedule,
                    grad_fn: GradFn, router_bias_rate: float = 0.0):
    """`router_bias_rate` > 0: the MoE layers' routing biases move by the step's expert loads
    (`models.moe.update_router_bias`, auxiliary-loss-free balancing) after the update."""
    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        (_, metrics), grads = grad_fn(state.params, batch)
        grads, observed_amaxes = fp8.split_observed_amaxes(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        params = fp8.record_amaxes(params, observed_amaxes)
        metrics = dict(metrics)
        load = metrics.pop("moe_load", None)
        if router_bias_rate > 0:
            params = update_router_bias(params, load, router_bias_rate)
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
        return loss_fn(to_model_params(params), counted_tokens_mean(batch))[1]["loss"]

    return eval_step
