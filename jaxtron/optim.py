"""AdamW with linear warmup, cosine decay and global-norm clipping (optax).

Weight decay applies to matrices only: a parameter whose logical axes, less the axes that stack
layers (`layers`, and `stage` in the pipeline layout), span two or more dimensions. Norm scales and biases are not decayed (Megatron's default).
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

from jaxtron.config import Config
from jaxtron.sharding.rules import logical_names


def learning_rate(config: Config) -> optax.Schedule:
    o = config.optim
    warmup = min(o.warmup_steps, config.train.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=warmup,
        decay_steps=max(config.train.steps, warmup + 1), end_value=o.lr * o.min_lr_ratio)


def decay_mask(params):
    def is_matrix(variable: nnx.Variable):
        names = [n for n in logical_names(variable) if n not in ("layers", "stage")]
        return variable.replace(len(names) >= 2)

    return jax.tree.map(is_matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def build_optimizer(config: Config) -> optax.GradientTransformation:
    o = config.optim
    adamw = optax.adamw(learning_rate(config), b1=o.b1, b2=o.b2, eps=o.eps,
                        weight_decay=o.weight_decay, mask=decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw) if o.grad_clip > 0 else adamw
    # A non-finite gradient never reaches the parameters: the update is skipped and counted
    # (train.on_nan=stop then ends the run; skip carries on).
    return optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)
