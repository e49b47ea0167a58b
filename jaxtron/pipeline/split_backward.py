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
`schedule.build_table("zb-h1", p, m)` builds the table in these units; `jaxtron.pipeline.validate` checks it like every
other table.

The engine runs these tables with the backward split by `split_vjp.SplitVJP`: B recomputes
the stage from its stored input, as 1F1B's backward does, and computes the input gradient
without any weight-gradient product; it leaves each weight's inputs and output gradients in a
stash slot, from which W forms the weight gradients.
"""

from __future__ import annotations

from jaxtron.pipeline.schedule import FORWARD, INPUT_GRAD, SPLIT_SCHEDULES, WEIGHT_GRAD, Action


def split_orders(schedule: str, stages: int, microbatches: int) -> list[list[Action]]:
    """Each rank's actions in order: 1F1B's warm-up forwards (p - d - 1), then one forward
    and one B per step, rank d's W's each d microbatches after their B, the rest of the W's
    at the end (ZB-H1)."""
    p, m = stages, microbatches
    if schedule not in SPLIT_SCHEDULES:
        raise ValueError(f"unknown split-backward schedule {schedule!r}; "
                         f"choose from {SPLIT_SCHEDULES}")
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
