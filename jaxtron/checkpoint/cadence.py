"""`checkpoint.every: auto`: the checkpoint interval that loses the least expected time.

Checkpointing every T seconds costs C / T of the run (C: the time a save holds the training
loop) and a failure loses T / 2 of work on average; with failures every M seconds
(`checkpoint.mtbf_hours`) the sum C / T + T / (2M) is smallest at T = sqrt(2 C M) (Young,
"A first order approximation to the optimum checkpoint interval", CACM 1974; Daly 2006 refines
it for C comparable to M, which does not happen here).

The run measures both C and its step time after it starts: the first steps after the compile
are timed, the run saves once at `MEASURE_AT` steps past its start and times that save, and the
interval in steps is T / step time, at least 1. Every process must save at the same steps (a
save is collective), so process 0's measurement decides and is sent to the others.
"""

from __future__ import annotations

import math
import time

import numpy as np
from jax.experimental import multihost_utils

MEASURE_AT = 3  # steps after the start (or resume): the first is the compile, two are timed


def young_interval_steps(save_s: float, step_s: float, mtbf_hours: float) -> int:
    """Steps between checkpoints minimising expected lost time: sqrt(2 C M) / step time."""
    seconds = math.sqrt(2 * save_s * mtbf_hours * 3600)
    return max(1, round(seconds / max(step_s, 1e-9)))


class AutoCadence:
    """Times the steps after `start`, then the save at `start + MEASURE_AT`, and decides the
    interval once; `interval` is None until then."""

    def __init__(self, start: int, mtbf_hours: float):
        self.start, self.mtbf_hours = start, mtbf_hours
        self.ended: dict[int, float] = {}
        self.interval: int | None = None

    def step_ended(self, step: int) -> None:
        self.ended[step] = time.perf_counter()

    def measure_now(self, step: int) -> bool:
        return self.interval is None and step == self.start + MEASURE_AT

    def decide(self, step: int, save_s: float) -> str:
        """After the measuring save (which took `save_s`): the interval, agreed by every
        process; -> the line to print."""
        first = self.start + 1
        step_s = (self.ended[step] - self.ended[first]) / (step - first)
        interval = young_interval_steps(save_s, step_s, self.mtbf_hours)
        self.interval = int(multihost_utils.broadcast_one_to_all(np.int32(interval)))
        return (f"checkpoint.every=auto: a save held the loop {save_s:.2f} s, a step takes "
                f"{step_s:.3f} s, failures every {self.mtbf_hours:g} h -> a checkpoint every "
                f"{self.interval} steps (Young: sqrt(2 x save x MTBF))")
