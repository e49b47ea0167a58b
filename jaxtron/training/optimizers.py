"""AdamW (or Muon) with the learning-rate schedule of `lr_schedule.py` and global-norm clipping
(optax).

Weight decay applies to weight matrices only (Megatron's default): parameters that map to or
from the residual stream, i.e. whose logical axes, less those that stack layers (`layers`, and
`stage` in the pipeline layout), include `embed` and at least one other axis. Embeddings, q/k/v
and output projections, MLP and expert weights and the router qualify; norm scales and biases do
not, whatever their shape (GPT-2's q/k/v biases are [heads, head_dim], two axes but no `embed`).

`optim.moment_dtype: bfloat16` stores both moments in bf16 between steps (DeepSeek-V3;
Megatron's `--exp-avg-dtype` / `--exp-avg-sq-dtype bf16`): each update reads them as fp32,
computes in fp32 and rounds the new moments once, so the optimizer state costs 4 bytes per
parameter instead of 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtron.config.schema import Config
from jaxtron.sharding.rules import logical_names
from jaxtron.training.lr_schedule import learning_rate
from jaxtron.training.muon import muon_directions


def decay_mask(params):
    def is_matrix(variable: nnx.Variable):
        names = [n for n in logical_names(variable) if n not in ("layers", "stage")]
        return variable.replace(len(names) >= 2 and "embed" in names)

    return jax.tree.map(is_matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _cast_floats(tree, dtype):
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def moments_stored_as(inner: optax.GradientTransformation,
                      dtype) -> optax.GradientTransformation:
    """`inner` with its floating-point state (Adam's moments) kept in `dtype` between updates
    and widened to fp32 for each update."""
    if jnp.dtype(dtype) == jnp.float32:
        return inner

    def init(params):
        return _cast_floats(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, _cast_floats(state, jnp.float32), params)
        return updates, _cast_floats(state, dtype)

    return optax.GradientTransformation(init, update)


def build_optimizer(config: Config) -> optax.GradientTransformation:
    o = config.optim
    if o.name == "muon":  # Muon for hidden matrices, Adam for the rest (jaxtron/training/muon.py)
        directions = muon_directions(momentum=o.muon_momentum, ns_steps=o.muon_ns_steps,
                                     b1=o.b1, b2=o.b2, eps=o.eps)
        inner = optax.chain(directions,
                            optax.add_decayed_weights(o.weight_decay, mask=decay_mask),
                            optax.scale_by_learning_rate(learning_rate(config)))
    else:
        inner = optax.adamw(learning_rate(config), b1=o.b1, b2=o.b2, eps=o.eps,
                            weight_decay=o.weight_decay, mask=decay_mask)
    adamw = moments_stored_as(inner, o.moment_dtype)
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw) if o.grad_clip > 0 else adamw
    # A non-finite gradient never reaches the parameters: the update is skipped and counted
    # (train.on_nan=stop then ends the run; skip carries on).
    return optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)
