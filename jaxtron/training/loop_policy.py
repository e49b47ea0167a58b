"""When the train loop logs, evaluates, saves and stops: one policy, testable without a model.

Every decision the loop makes about a finished step is a pure function of the step number, the
run's cadences and whether a stop was requested:

  * evaluate every `train.eval_every` steps (0: only at the end) and at the last step;
  * log every `train.log_every` steps, at the last step, at every evaluation (so each held-out
    loss has its row) and at a stop;
  * save every `checkpoint.every` steps (0: none in between; `auto` starts as 0 and the loop
    replaces the policy once `checkpoint_cadence` has measured), at the last step and at a stop;
  * stop at the last step or when a stop was requested (a preemption signal agreed by every
    process).

The loop itself (`jaxtron.train.run`) only carries out these actions, in the order evaluate,
log, save: a checkpoint is never written past a step whose metrics have not been checked.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Actions:
    evaluate: bool
    log: bool
    save: bool
    stop: bool


@dataclasses.dataclass(frozen=True)
class LoopPolicy:
    steps: int
    log_every: int
    eval_every: int
    checkpoint_every: int

    @classmethod
    def from_config(cls, config) -> "LoopPolicy":
        t = config.train
        every = config.checkpoint.every
        return cls(t.steps, t.log_every, t.eval_every, every if isinstance(every, int) else 0)

    def after(self, step: int, stop_requested: bool = False) -> Actions:
        """What to do once `step` (1-based) has run."""
        last = step >= self.steps
        evaluate = last or bool(self.eval_every and step % self.eval_every == 0)
        stop = last or stop_requested
        log = stop or evaluate or step % self.log_every == 0
        save = stop or bool(self.checkpoint_every and step % self.checkpoint_every == 0)
        return Actions(evaluate=evaluate, log=log, save=save, stop=stop)
