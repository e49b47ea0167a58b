"""Learning-rate schedules (`optim.schedule`), built from optax's pieces.

Every schedule warms up linearly from 0 to `optim.lr` over `optim.warmup_steps`, then:

    cosine        lr_min + (lr - lr_min) (1 + cos(pi r)) / 2     r = (t - W) / (T - W)
    linear        lr_min + (lr - lr_min) (1 - r)
    constant      lr
    inverse_sqrt  max(lr_min, lr sqrt(max(W, 1) / t))
    wsd           lr until T - D, then down to lr_min over the last D = decay_fraction x T
                  steps (warmup-stable-decay; the decay `linear`, `cosine` or `minus_sqrt`,
                  1 - sqrt(s / D), by `optim.wsd_shape`)

with lr_min = `optim.min_lr_ratio` x lr, t the number of updates applied, W the warmup and
T = `optim.decay_steps` (default `train.steps`): after T every schedule but constant stays at
lr_min (inverse_sqrt too, as in Megatron). These are Megatron's `--lr-decay-style` formulas
(`--lr-decay-iters` is T, `--lr-wsd-decay-iters` D, `--lr-wsd-decay-style` the WSD shape).
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from jaxtron.config.schema import Config

SCHEDULES = ("cosine", "linear", "constant", "inverse_sqrt", "wsd")


def decay_end(config: Config) -> int:
    """T: the step at which the decay reaches its floor."""
    o = config.optim
    return o.decay_steps if o.decay_steps is not None else config.train.steps


def wsd_decay_steps(config: Config) -> int:
    """D: the length of WSD's final decay."""
    return max(1, round(config.optim.decay_fraction * decay_end(config)))


def _wsd_decay(peak: float, floor: float, steps: int, shape: str) -> optax.Schedule:
    if shape == "linear":
        return optax.linear_schedule(peak, floor, steps)
    if shape == "cosine":
        return optax.cosine_decay_schedule(peak, steps, alpha=floor / peak)

    def minus_sqrt(count):
        fraction = jnp.clip(count / steps, 0.0, 1.0)
        return floor + (peak - floor) * (1.0 - jnp.sqrt(fraction))

    return minus_sqrt


def learning_rate(config: Config) -> optax.Schedule:
    """The rate of update t (t = 0, 1, ...) for `optim.schedule`."""
    o = config.optim
    peak, floor, warmup = o.lr, o.lr * o.min_lr_ratio, o.warmup_steps
    # Warmup as configured even when the run is shorter (config.warnings says so): extending
    # train.steps later must not change the steps already taken.
    end = max(decay_end(config), warmup + 1)
    if o.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, end, floor)
    warm = optax.linear_schedule(0.0, peak, warmup)
    if o.schedule == "linear":
        after = optax.linear_schedule(peak, floor, end - warmup)
    elif o.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif o.schedule == "inverse_sqrt":
        def after(count):  # count counts from the end of warmup
            step = jnp.maximum(count + warmup, 1)
            value = jnp.maximum(floor, peak * jnp.sqrt(max(warmup, 1) / step))
            return jnp.where(count + warmup > end, floor, value)
    else:  # wsd
        decay = min(wsd_decay_steps(config), end - warmup)
        stable = optax.constant_schedule(peak)
        tail = _wsd_decay(peak, floor, decay, o.wsd_shape)
        after = optax.join_schedules([stable, tail], [end - warmup - decay])
    return optax.join_schedules([warm, after], [warmup])
