"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) as
tick tables with the backward split in two.

A stage's backward is two jobs: B, the gradient with respect to the stage's input, which the
previous stage waits for, and W, the gradient with respect to the stage's weights, which nothing
waits for. 1F1B runs them back to back; ZB-H1 runs 1F1B's forwards and B's in 1F1B's order
and lets rank d run each W d microbatches late, so the W's fill the ticks where 1F1B waits for
gradients from downstream. Counted in units where F, B and W take one tick each (the paper's
T_F = T_B = T_W):

    1F1B  : bubble (p-1) * 3 / (3m + 3(p-1)) = (p-1) / (m+p-1)
    ZB-H1 : bubble (p-1) / (3m + p-1)            (the paper's (p-1)(T_F + T_B - T_W))

for m >= p: about a third of 1F1B's for large m, and every rank holds at most p microbatches
whose W has not run, 1F1B's peak on rank 0 (a microbatch's activations are needed until its W).
`split_table` builds the table in these units; `jaxtron.pipeline.validate` checks it like every
other table.

These tables are the schedules' specification: the training engine (`engine.py`) still runs
the backward as one job, so `pipeline.schedule` does not offer them yet.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxtron.pipeline.schedule import TickTable

IDLE, FORWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 3, 4
SPLIT_SCHEDULES = ("zb-h1",)
LETTERS = {FORWARD: "F", INPUT_GRAD: "B", WEIGHT_GRAD: "W"}


@dataclasses.dataclass(frozen=True)
class SplitTable(TickTable):
    """Per tick and rank: action kind (IDLE, FORWARD, INPUT_GRAD, WEIGHT_GRAD) and microbatch."""
    kind: np.ndarray
    microbatch: np.ndarray
    stages: int
    microbatches: int


def device_orders(schedule: str, stages: int, microbatches: int) -> list[list[tuple[int, int]]]:
    """Each rank's (kind, microbatch) actions in order: 1F1B's warm-up forwards (p - d - 1),
    then one forward and one B per step, rank d's W's each d microbatches after their B, the
    rest of the W's at the end (ZB-H1)."""
    p, m = stages, microbatches
    if schedule not in SPLIT_SCHEDULES:
        raise ValueError(f"unknown split-backward schedule {schedule!r}; "
                         f"choose from {SPLIT_SCHEDULES}")
    orders = []
    for d in range(p):
        delay = d
        warmup = min(p - d - 1, m)
        order = [(FORWARD, mb) for mb in range(warmup)]
        forwards, weights = warmup, 0
        for mb in range(m):
            if forwards < m:
                order.append((FORWARD, forwards))
                forwards += 1
            order.append((INPUT_GRAD, mb))
            if mb >= delay:
                order.append((WEIGHT_GRAD, mb - delay))
                weights += 1
        orders.append(order + [(WEIGHT_GRAD, mb) for mb in range(weights, m)])
    return orders


def split_table(schedule: str, stages: int, microbatches: int) -> SplitTable:
    """Each rank's next action at the earliest tick its inputs exist (a value sent at tick t
    is usable at tick t + 1): F after the previous stage's F, B after this stage's F and the
    next stage's B, W after this stage's B."""
    p, m = stages, microbatches
    orders = device_orders(schedule, p, m)
    done: dict[tuple[int, int, int], int] = {}
    rows: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    cursor = [0] * p
    tick = 0
    while any(cursor[d] < len(orders[d]) for d in range(p)):
        if tick > 10 * (3 * m + p):
            raise RuntimeError(f"schedule {schedule} deadlocked at tick {tick}")
        placed = {}
        for d in range(p):
            if cursor[d] == len(orders[d]):
                rows[d].append((IDLE, 0))
                continue
            kind, mb = orders[d][cursor[d]]
            if all(done.get(dep, tick) < tick for dep in _dependencies(kind, mb, d, p)):
                placed[(kind, mb, d)] = tick
                cursor[d] += 1
                rows[d].append((kind, mb))
            else:
                rows[d].append((IDLE, 0))
        done.update(placed)
        tick += 1
    kind = np.array([[rows[d][t][0] for d in range(p)] for t in range(tick)], np.int32)
    micro = np.array([[rows[d][t][1] for d in range(p)] for t in range(tick)], np.int32)
    return SplitTable(kind, micro, p, m)


def _dependencies(kind: int, mb: int, stage: int, p: int) -> list[tuple[int, int, int]]:
    if kind == FORWARD:
        return [] if stage == 0 else [(FORWARD, mb, stage - 1)]
    if kind == INPUT_GRAD:
        return [(FORWARD, mb, stage)] + ([] if stage == p - 1 else [(INPUT_GRAD, mb, stage + 1)])
    return [(INPUT_GRAD, mb, stage)]


def bubble_formula(stages: int, microbatches: int) -> float:
    """ZB-H1's idle fraction in units of F = B = W = one tick, for microbatches >= stages."""
    p, m = stages, microbatches
    return (p - 1) / (3 * m + p - 1)


def render(table: SplitTable) -> str:
    """One row per rank: `F3`, `B3`, `W3` (microbatch 3) or `.`."""
    cells = [["." if table.kind[t, d] == IDLE else
              f"{LETTERS[int(table.kind[t, d])]}{table.microbatch[t, d]}"
              for t in range(table.ticks)] for d in range(table.stages)]
    width = max(len(c) for row in cells for c in row)
    return "\n".join(f"stage {d}: " + " ".join(c.rjust(width) for c in row)
                     for d, row in enumerate(cells))
