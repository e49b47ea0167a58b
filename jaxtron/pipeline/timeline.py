"""How long a tick table takes where the ranks really run side by side, in forward units.

A table's bubble counts idle cells as if every job took one tick. They do not: a backward is
about two forwards of work (the input gradient and the weight gradients), three when it runs
the stage again from its input (`pipeline.recompute: true`), and a split schedule's B and W
are about one each, like the R that recomputes the stage before a B. The engine ends every
tick with an exchange in which only the ranks whose job's output goes to a neighbour take
part (`ticks.exchange_patterns`: one collective permute per direction, over just those pairs),
so a rank waits at the end of a tick only for the ranks it sends to or receives from then; a
rank that trades with no one goes straight on. Asynchronous 1F1B's dependencies are exactly
these pairs, so its idle share is its formula's (p-1)/(m+p-1); a table whose jobs differ in
length across a pair that trades stalls, which is why interleaved and zbv run only jobs of
one forward each (`schedules.py`; zb-h1's recomputing B, two forwards, sits where its table
leaves room).

`step_units` walks the table with those job lengths and that rule; `weighted_idle` is the share
of a rank's time spent waiting. On simulated CPU devices the ranks share the cores and a
waiting rank's time goes to the others, so measured step times there show total work, not
this; `python -m jaxtron.bench --compare-schedules` prints both.
"""

from __future__ import annotations

import numpy as np

from jaxtron.pipeline.ticks import (
    BACKWARD,
    FORWARD,
    IDLE,
    INPUT_GRAD,
    RECOMPUTE,
    WEIGHT_GRAD,
    Table,
    receivers,
)


def job_units(recompute: bool) -> dict[int, float]:
    """Work of each job kind for one whole stage, in forwards: matmul FLOPs, the backward's
    two products per weight use (dx = dy W^T, dW = x^T dy), plus the forward run again where
    the backward recomputes it (not where an R job did)."""
    again = 1.0 if recompute else 0.0
    return {IDLE: 0.0, FORWARD: 1.0, BACKWARD: 2.0 + again, INPUT_GRAD: 1.0 + again,
            WEIGHT_GRAD: 1.0, RECOMPUTE: 1.0}


def _cell_units(table: Table, recompute: bool) -> np.ndarray:
    units = job_units(recompute and not table.recomputes)
    per_kind = np.vectorize(units.__getitem__, otypes=[float])(table.kind)
    return per_kind / table.virtual  # a chunk is 1/v of the stage


def step_units(table: Table, recompute: bool = True) -> float:
    """Length of the step: after each tick, the two ranks of every send the table makes
    there wait for each other; the others go on."""
    cells = _cell_units(table, recompute)
    finish = np.zeros(table.stages)
    for row, to in zip(cells, receivers(table)):
        finish = finish + row
        senders = np.nonzero(to >= 0)[0]
        if senders.size:
            both = np.maximum(finish[senders], finish[to[senders]])
            np.maximum.at(finish, senders, both)
            np.maximum.at(finish, to[senders], both)
    return float(finish.max())


def work_units(table: Table, recompute: bool = True) -> float:
    """One rank's work in the step (every rank does the same)."""
    return float(_cell_units(table, recompute).sum(axis=0).max())


def weighted_idle(table: Table, recompute: bool = True) -> float:
    """The share of the step a rank waits, with jobs at their real lengths."""
    return 1.0 - work_units(table, recompute) / step_units(table, recompute)
