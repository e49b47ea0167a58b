"""How long a tick table takes where the ranks really run side by side, in forward units.

A table's bubble counts idle cells as if every job took one tick. They do not: a backward is
about two forwards of work (the input gradient and the weight gradients), three when it runs
the stage again from its input (`pipeline.recompute: true`), and a split schedule's B and W
are about one each (B two with recomputation). The engine ends every tick with an exchange
with rank d - 1 and rank d + 1 (two ring permutes), so a rank starts tick t + 1 only when it
and both neighbours have finished tick t. A tick in which one rank runs a backward and its
neighbour a forward costs the neighbour the difference: 1F1B's steady state mixes the two on
every tick, GPipe's never does.

`step_units` walks the table with those job lengths and that rule; `weighted_idle` is the share
of a rank's time spent waiting. On simulated CPU devices the ranks share the cores and a
waiting rank's time goes to the others, so measured step times there show total work, not
this; `python -m jaxtron.bench --compare-schedules` prints both.
"""

from __future__ import annotations

import numpy as np

from jaxtron.pipeline.ticks import BACKWARD, FORWARD, IDLE, INPUT_GRAD, WEIGHT_GRAD, Table


def job_units(recompute: bool) -> dict[int, float]:
    """Work of each job kind for one whole stage, in forwards: matmul FLOPs, the backward's
    two products per weight use (dx = dy W^T, dW = x^T dy), plus the forward run again."""
    again = 1.0 if recompute else 0.0
    return {IDLE: 0.0, FORWARD: 1.0, BACKWARD: 2.0 + again, INPUT_GRAD: 1.0 + again,
            WEIGHT_GRAD: 1.0}


def _cell_units(table: Table, recompute: bool) -> np.ndarray:
    units = job_units(recompute)
    per_kind = np.vectorize(units.__getitem__, otypes=[float])(table.kind)
    return per_kind / table.virtual  # a chunk is 1/v of the stage


def step_units(table: Table, recompute: bool = True) -> float:
    """Length of the step: each tick starts when this rank and both ring neighbours have
    finished the previous one."""
    cells = _cell_units(table, recompute)
    p = table.stages
    finish = np.zeros(p)
    for row in cells:
        ready = np.maximum(finish, np.maximum(np.roll(finish, 1), np.roll(finish, -1)))
        finish = ready + row
    return float(finish.max())


def work_units(table: Table, recompute: bool = True) -> float:
    """One rank's work in the step (every rank does the same)."""
    return float(_cell_units(table, recompute).sum(axis=0).max())


def weighted_idle(table: Table, recompute: bool = True) -> float:
    """The share of the step a rank waits, with jobs at their real lengths."""
    return 1.0 - work_units(table, recompute) / step_units(table, recompute)
