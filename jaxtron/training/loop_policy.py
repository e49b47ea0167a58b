"""When the train loop logs, evaluates, saves and stops: one policy, testable without a model.

Every decision the loop makes about a finished step is made here, from the step number, the
run's cadences and whether a stop was requested:

  * evaluate every `train.eval_every` steps (0: only at the end) and at the last step;
  * log every `train.log_every` steps, at the last step, at every evaluation (so each held-out
    loss has its row) and at a stop;
  * save every `checkpoint.every` steps (0: none in between), at the last step and at a stop;
    with `checkpoint.every: auto` the save `MEASURE_AT` steps after the start is timed
    (`measure`), and the interval is decided from it (`save_took`, `checkpoint/cadence.py`);
  * stop at the last step or when a stop was requested (a preemption signal agreed by every
    process).

The loop (`training/loop.py`) only carries out these actions, in the order evaluate, log, save:
a checkpoint is never written past a step whose metrics have not been checked.
"""

from __future__ import annotations

import dataclasses

from jaxtron.checkpoint.cadence import AutoCadence
from jaxtron.config.schema import Config


@dataclasses.dataclass(frozen=True)
class Actions:
    evaluate: bool
    log: bool
    save: bool
    stop: bool
    measure: bool = False  # time this save: `checkpoint.every: auto` decides from it


class LoopPolicy:
    def __init__(self, steps: int, log_every: int, eval_every: int, checkpoint_every: int,
                 cadence: AutoCadence | None = None):
        self.steps, self.log_every, self.eval_every = steps, log_every, eval_every
        self.checkpoint_every, self.cadence = checkpoint_every, cadence

    @classmethod
    def from_config(cls, config: Config, start: int = 0) -> "LoopPolicy":
        """The policy of a run that starts (or resumes) after step `start`."""
        t, every = config.train, config.checkpoint.every
        cadence = AutoCadence(start, config.checkpoint.mtbf_hours) if every == "auto" else None
        return cls(t.steps, t.log_every, t.eval_every, every if isinstance(every, int) else 0,
                   cadence)

    def after(self, step: int, stop_requested: bool = False) -> Actions:
        """What to do once `step` (1-based) has run."""
        last = step >= self.steps
        evaluate = last or bool(self.eval_every and step % self.eval_every == 0)
        stop = last or stop_requested
        log = stop or evaluate or step % self.log_every == 0
        measure = False
        if self.cadence is not None:
            self.cadence.step_ended(step)
            measure = self.cadence.measure_now(step)
        save = stop or measure or bool(self.checkpoint_every
                                       and step % self.checkpoint_every == 0)
        return Actions(evaluate=evaluate, log=log, save=save, stop=stop, measure=measure)

    def save_took(self, step: int, seconds: float) -> str:
        """After the measuring save: the interval from now on, and the line saying why."""
        note = self.cadence.decide(step, seconds)
        self.checkpoint_every = self.cadence.interval
        return note
