"""The pure training step: `train_step(state, batch) -> (state, metrics)`.

The step has no flags. How gradients are computed is a function passed in, built by composing
`plain_grads` (one pass over the batch), `accumulated_grads` (sum over microbatches with
`lax.scan`; the optimizer still takes one step per global batch, and the loss is the same mean),
the pipeline's `stages.StagedModel.value_and_grad`, and `data_parallel.reduce_once` (one
data-parallel reduction per step; ZeRO-2's reduce-scatter). Delayed fp8 scaling's amax
histories ride along as parameters whose gradients are the step's observed amaxes: those are
combined by max and written into the histories after the update (`kernels/fp8.py`). What a
batch holds and how its loss mask becomes weights: `batch.py`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxtron.kernels import fp8
from jaxtron.models.moe import update_router_bias
from jaxtron.sharding.zigzag import in_zigzag_order
from jaxtron.training.batch import counted_tokens_mean, model_inputs, split_microbatches

# (params, batch) -> ((objective, metrics), grads); metrics["loss"] is the language-model loss,
# the objective adds any auxiliary terms (mixture-of-experts balancing).
GradFn = Callable[[Any, jax.Array], tuple[tuple[jax.Array, dict], Any]]


@struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def make_loss_fn(graphdef: nnx.GraphDef, sequence_ring: int = 1):
    """loss(params, batch) -> (objective, metrics) for the model `graphdef`: next-token
    cross-entropy plus the model's weighted auxiliary losses. With `sequence_ring` > 1 (ring
    attention over that many devices) the model sees each sequence in the ring's zig-zag order,
    set here once instead of in every layer (`jaxtron.sharding.zigzag`): the same mean loss."""

    def loss_fn(params, batch):
        model_loss = nnx.merge(graphdef, params).loss
        if sequence_ring > 1:
            model_loss = in_zigzag_order(model_loss, sequence_ring)
        x = model_inputs(batch)
        loss, aux = model_loss(x.inputs_BxL, x.targets_BxL, x.token_pos, x.weights_BxL)
        objective = loss + sum(aux.pop("weighted_terms", []), jnp.zeros((), jnp.float32))
        return objective, {"loss": loss, **aux}

    return loss_fn


def plain_grads(loss_fn) -> GradFn:
    return jax.value_and_grad(loss_fn, has_aux=True)


def accumulated_grads(grad_fn: GradFn, microbatches: int) -> GradFn:
    """Mean loss and gradients over `microbatches` equal slices of the batch, one at a time
    (`batch.split_microbatches`)."""
    def accumulate(params, batch):
        batch_AxMx = split_microbatches(batch, microbatches)

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
                    grad_fn: GradFn, router_bias_rate: float = 0.0, host_moments: bool = False):
    """`router_bias_rate` > 0: the MoE layers' routing biases move by the step's expert loads
    (`models.moe.update_router_bias`, auxiliary-loss-free balancing) after the update.
    `host_moments`: the optimizer state lives in pinned host memory (`optim.host_moments`);
    it is brought to the device for the update and sent back."""
    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        (_, metrics), grads = grad_fn(state.params, batch)
        grads, observed_amaxes = fp8.split_observed_amaxes(grads)
        before = state.opt_state
        if host_moments:
            before = jax.device_put(before, jax.memory.Space.Device)
        updates, opt_state = tx.update(grads, before, state.params)
        params = optax.apply_updates(state.params, updates)
        params = fp8.record_amaxes(params, observed_amaxes)
        metrics = dict(metrics)
        load = metrics.pop("moe_load", None)
        if router_bias_rate > 0:
            params = update_router_bias(params, load, router_bias_rate)
        skipped_before = optax.tree_utils.tree_get(before, "total_notfinite")
        skipped = optax.tree_utils.tree_get(opt_state, "total_notfinite")
        # The rate this update applied: the schedule advances only with applied updates
        # (optax.apply_if_finite leaves the inner state alone), and a skipped one applied none.
        lr = jnp.where(skipped > skipped_before, 0.0, schedule(state.step - skipped_before))
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "lr": lr,
                   "skipped_updates": skipped}
        if host_moments:
            opt_state = jax.device_put(opt_state, jax.memory.Space.Host)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def returning_grads(make_step: Callable[[GradFn], Callable], grad_fn: GradFn):
    """`make_step(grad_fn)`'s step that also returns the objective and gradients it applied:
    (state, batch) -> (state, metrics, objective, grads). They are the step's own values, taken
    inside its trace, not a second gradient pass."""
    def step(state: TrainState, batch: dict):
        applied = []

        def recording(params, batch):
            applied.append(grad_fn(params, batch))
            return applied[-1]

        state, metrics = make_step(recording)(state, batch)
        (objective, _), grads = applied[0]
        return state, metrics, objective, grads

    return step


def make_eval_step(loss_fn, to_model_params=lambda params: params):
    def eval_step(params, batch: dict) -> jax.Array:
        return loss_fn(to_model_params(params), counted_tokens_mean(batch))[1]["loss"]

    return eval_step
