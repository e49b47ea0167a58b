"""AdamW with linear warmup, cosine decay and global-norm clipping (optax).

Weight decay applies to weight matrices only (Megatron's default): parameters that map to or
from the residual stream, i.e. whose logical axes, less those that stack layers (`layers`, and
`stage` in the pipeline layout), include `embed` and at least one other axis. Embeddings, q/k/v
and output projections, MLP and expert weights and the router qualify; norm scales and biases do
not, whatever their shape (GPT-2's q/k/v biases are [heads, head_dim], two axes but no `embed`).
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

from jaxtron.config import Config
from jaxtron.sharding.rules import logical_names


def learning_rate(config: Config) -> optax.Schedule:
    o = config.optim
    # Warmup as configured even when the run is shorter (config.warnings says so): extending
    # train.steps later must not change the steps already taken.
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
        decay_steps=max(config.train.steps, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio)


def decay_mask(params):
    def is_matrix(variable: nnx.Variable):
        names = [n for n in logical_names(variable) if n not in ("layers", "stage")]
        return variable.replace(len(names) >= 2 and "embed" in names)

    return jax.tree.map(is_matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def build_optimizer(config: Config) -> optax.GradientTransformation:
    o = config.optim
    adamw = optax.adamw(learning_rate(config), b1=o.b1, b2=o.b2, eps=o.eps,
                        weight_decay=o.weight_decay, mask=decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw) if o.grad_clip > 0 else adamw
    # A non-finite gradient never reaches the parameters: the update is skipped and counted
    # (train.on_nan=stop then ends the run; skip carries on).
    return optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)
