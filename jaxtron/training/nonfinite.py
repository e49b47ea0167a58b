"""`train.on_nan: stop`: end the run at the first non-finite loss, gradient or skipped update."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from jaxtron.config.schema import Config
from jaxtron.errors import JaxtronError


class NonFiniteError(JaxtronError):
    """Training produced a NaN or Inf under train.on_nan=stop."""


@jax.jit
def _all_finite(params) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))


class NonFiniteWatch:
    """Ends the run at a non-finite loss or gradient, or at an update the optimizer skipped
    since the previous check. The optimizer's skip count is cumulative and lives in the
    checkpoint, so it is compared with the last value seen, not with zero: a run resumed from a
    checkpoint with earlier skips (under on_nan=skip) is not stopped for them."""

    def __init__(self, config: Config, checkpoints, state):
        self.config, self.checkpoints = config, checkpoints
        self.skipped = int(jax.device_get(optax.tree_utils.tree_get(state.opt_state,
                                                                    "total_notfinite")))
        self.skipped_at_start = self.skipped

    def check(self, record: dict | None) -> None:
        if record is None:
            return
        skipped, self.skipped = record.get("skipped_updates", 0) > self.skipped, max(
            self.skipped, record.get("skipped_updates", 0))
        bad = not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]))
        if self.config.train.on_nan != "stop" or not (bad or skipped):
            return
        raise NonFiniteError(
            f"a non-finite loss or gradient appeared at or before step {record['step']} "
            f"(loss {record['loss']}, grad_norm {record['grad_norm']}); the update was not "
            f"applied and {self._intact()}. Lower optim.lr, raise optim.warmup_steps, or set "
            "train.on_nan=skip to skip such updates.")

    def check_params(self, step: int, params) -> None:
        """Before a save: a checkpoint is vouched for only if its parameters are finite (an
        update can overflow them while its step's loss and gradients were finite)."""
        if bool(_all_finite(params)):
            return
        raise NonFiniteError(
            f"the update of step {step} made parameters non-finite, so it was not saved; "
            f"{self._intact()}. Lower optim.lr or raise optim.warmup_steps.")

    def check_skips(self, updates: int) -> None:
        """At the end: a run that skipped most of its updates (train.on_nan=skip) did not
        train, and says so instead of ending as done."""
        if updates and self.skipped - self.skipped_at_start > updates / 2:
            raise NonFiniteError(
                f"{self.skipped - self.skipped_at_start} of this run's {updates} updates were "
                "skipped for non-finite gradients (train.on_nan=skip): it did not train. "
                "Lower optim.lr or raise optim.warmup_steps.")

    def _intact(self) -> str:
        latest = self.checkpoints.latest_step()
        return (f"the last checkpoint, step {latest} in {self.checkpoints.directory}, is intact"
                if latest is not None else "no checkpoint had been written")
