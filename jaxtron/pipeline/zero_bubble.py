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
`schedules.build_table("zb-h1", p, m)` builds the table in these units; `jaxtron.pipeline.table_check` checks it like every
other table.

The engine runs these tables with the backward split by `split_vjp.SplitVJP`: B computes the
input gradient without any weight-gradient product, recomputing the stage from its stored
input as 1F1B's backward does (zb-h1), or from the residuals an R job left (zbv, recomputing)
or its forward kept (`pipeline.recompute: false`); it leaves each weight's inputs and output
gradients in a stash slot, from which W forms the weight gradients.
"""

from __future__ import annotations

import bisect

import numpy as np

from jaxtron.pipeline.ticks import (
    FORWARD,
    INPUT_GRAD,
    RECOMPUTE,
    WEIGHT_GRAD,
    Action,
    Table,
    assign_slots,
    owner,
    virtual_stage,
)


def split_orders(stages: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1: each rank's actions in order: 1F1B's warm-up forwards (p - d - 1), then one
    forward and one B per step, rank d's W's each d microbatches after their B, the rest of the
    W's at the end. (zbv is placed by `zbv_table`, not from fixed orders.)"""
    p, m = stages, microbatches
    orders = []
    for d in range(p):
        warmup = min(p - d - 1, m)
        order = [Action(FORWARD, mb, 0) for mb in range(warmup)]
        forwards, weights = warmup, 0
        for mb in range(m):
            if forwards < m:
                order.append(Action(FORWARD, forwards, 0))
                forwards += 1
            order.append(Action(INPUT_GRAD, mb, 0))
            if mb >= d:
                order.append(Action(WEIGHT_GRAD, mb - d, 0))
                weights += 1
        orders.append(order + [Action(WEIGHT_GRAD, mb, 0) for mb in range(weights, m)])
    return orders


def bubble_formula(stages: int, microbatches: int) -> float:
    """ZB-H1's idle fraction in units of F = B = W = one tick, for microbatches >= stages."""
    p, m = stages, microbatches
    return (p - 1) / (3 * m + p - 1)


# R's run ahead of their gradients: 2 keeps zbv's idle at or below its stored table's (p = 4
# and 8, m = 8 to 32) for three chunks' residuals; 1 idles more at p = 8, 4 more at p = 4.
RECOMPUTED_AHEAD = 2


def zbv_table(stages: int, microbatches: int, recompute: bool = False) -> Table:
    """ZB-V (the paper's V-shape): two chunks per rank, virtual stage d down the ranks and
    2p-1-d back up (`ticks.virtual_stage`), so rank 0 embeds and computes the loss, and the
    turn at rank p-1 needs no send. Placed tick by tick (`_VPlacement`): each rank runs a ready
    B if it has one (the critical path), else a ready forward while it holds fewer than 2p
    chunk activations (1F1B's memory: p microbatches of a whole stage, a chunk being half of
    one), else its oldest pending W, else it idles. With `recompute` each B waits for its R
    (the stage run again, `schedules.py`): an R whose gradient has arrived comes before a
    forward, and up to `RECOMPUTED_AHEAD` more run in place of a W, ahead of their gradients
    (each holds a chunk's residuals until its B). `python -m jaxtron.pipeline.show --schedule
    zbv` draws and checks it."""
    p, m = stages, microbatches
    placement, tick = _VPlacement(p, m, recompute), 0
    while len(placement.done) < (4 if recompute else 3) * m * 2 * p:
        if tick > 20 * (6 * m + p):
            raise RuntimeError(f"zbv deadlocked at tick {tick}")
        # every rank picks from what earlier ticks did, then the tick's jobs are recorded
        for d, job in [(d, placement.pick(d)) for d in range(p)]:
            if job is not None:
                placement.record(d, job, tick)
        tick += 1
    return assign_slots(np.array(placement.placed, np.int64), tick, p, 2, m, v_shape=True)


class _VPlacement:
    """What `zbv_table` has placed so far, per rank. Forwards on a virtual stage run in
    microbatch order, so each stage's next is known. Per rank: the chunk activations held
    (at most 2p, from F to W), and, in microbatch order, the later stage first, as
    (mb, earlier?, vs), the chunks whose gradient has arrived and those not recomputed yet."""

    def __init__(self, p: int, m: int, recompute: bool):
        self.p, self.m, self.recompute = p, m, recompute
        self.done: dict[tuple[int, int, int], int] = {}  # job -> its tick
        self.placed: list[tuple[int, int, int, int, int, int]] = []  # `assign_slots`' rows
        self.held, self.recomputed = [0] * p, [0] * p
        self.waiting_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.next_forward = [0] * (2 * p)
        self.arrived: list[list[tuple[int, bool, int]]] = [[] for _ in range(p)]
        self.unrecomputed: list[list[tuple[int, bool, int]]] = [[] for _ in range(p)]

    def pick(self, d: int) -> tuple[int, int, int] | None:
        """Rank d's job at the next tick, (kind, microbatch, virtual stage), or None: idle."""
        awaited = None
        for key in self.arrived[d]:
            if not self.recompute or key not in self.unrecomputed[d]:
                return INPUT_GRAD, key[0], key[2]
            awaited = awaited or key
        if awaited:  # a gradient waits for its R
            return RECOMPUTE, awaited[0], awaited[2]
        if self.held[d] < 2 * self.p:
            for vs in (virtual_stage(d, c, self.p, True) for c in (1, 0)):  # later stage first
                mb = self.next_forward[vs]
                if mb < self.m and (not vs or (FORWARD, mb, vs - 1) in self.done):
                    return FORWARD, mb, vs
        if self.unrecomputed[d] and self.recomputed[d] < RECOMPUTED_AHEAD:
            mb, _, vs = self.unrecomputed[d][0]
            return RECOMPUTE, mb, vs
        if self.waiting_w[d]:
            mb, vs = self.waiting_w[d][0]
            return WEIGHT_GRAD, mb, vs
        return None

    def record(self, d: int, job: tuple[int, int, int], tick: int) -> None:
        """Rank d runs `job` at `tick`: what it holds and what it has left to do change."""
        kind, mb, vs = job
        p = self.p
        self.done[job] = tick
        self.placed.append((tick, d, kind, mb, owner(vs, p, True)[1], vs))
        key = (mb, vs < p, vs)
        if kind == FORWARD:
            self.held[d] += 1
            self.next_forward[vs] += 1
            if self.recompute:
                bisect.insort(self.unrecomputed[d], key)
            if vs == 2 * p - 1:  # the loss: its gradient starts here
                bisect.insort(self.arrived[d], key)
        elif kind == RECOMPUTE:
            self.recomputed[d] += 1
            self.unrecomputed[d].remove(key)
        elif kind == INPUT_GRAD:
            self.recomputed[d] -= self.recompute
            self.waiting_w[d].append((mb, vs))
            self.arrived[d].remove(key)
            if vs > 0:  # the previous virtual stage's gradient, usable from next tick
                before = vs - 1
                bisect.insort(self.arrived[owner(before, p, True)[0]], (mb, before < p, before))
        else:
            self.waiting_w[d].pop(0)
            self.held[d] -= 1

