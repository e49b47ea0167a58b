"""Pipeline schedules: the order in which each rank runs its jobs, placed into a tick table.

GPipe runs every forward then every backward; 1F1B (Narayanan et al. 2021, PipeDream-Flush) runs
`p - d - 1` warm-up forwards on rank d, then alternates one forward and one backward;
interleaved 1F1B (Megatron-LM) gives each rank `v` model chunks, virtual stage `c * p + d`, and
walks microbatches in groups of p per chunk, with a warm-up fitted to this lockstep engine
(`interleaved_warmup`). Their bubbles in a table of unit ticks are
(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved. `zb-h1` splits each
backward into B (input gradient) and W (weight gradients) and runs the W's in 1F1B's bubbles;
`zbv` places two chunks per rank in a V (`zero_bubble.py`).

Interleaved runs its backwards split too, W right after its B. This engine ends a tick when a
rank and the ranks it trades with have finished, so a chunk's backward (two forwards of work)
beside a neighbour's forward would stall it; as B and W, every job is one forward of work, and
W, off the gradients' path, shortens the cool-down as well. When the stage is recomputed
(`pipeline.recompute: true`) interleaved and zbv run the recomputation as a job of its own, R,
before each B (which then reads R's residuals, as without recomputation): one forward of work
like the others, run before its gradient arrives (interleaved's as soon as the rank reaches it
in its order; zbv's greedy V runs up to two ahead, `zero_bubble.zbv_table`). ZB-H1's B
recomputes itself: its W's already fill the ticks a longer B leaves, so it keeps its formula's
idle and 1F1B's memory without R's residuals.

`forward_table` is evaluation's schedule: the same placement with forwards only, in the
interleaved order (microbatches in groups of p per chunk, which is plain microbatch order when
v = 1). An activation is held only until the next virtual stage's forward has read it, so a
forward-only pass needs about one slot and no backward buffers at all.
"""

from __future__ import annotations

import functools

import numpy as np

from jaxtron.pipeline.ticks import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    RECOMPUTE,
    WEIGHT_GRAD,
    Action,
    Table,
    place,
)
from jaxtron.pipeline.zero_bubble import bubble_formula, split_orders, zbv_table

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")


def device_orders(schedule: str, stages: int, microbatches: int, virtual: int = 1,
                  recompute: bool = False) -> list[list[Action]]:
    """The order in which each device runs its actions; interleaved's with an R before each B
    when `recompute`."""
    p, m, v = stages, microbatches, virtual
    if schedule == "zb-h1" and v == 1:
        return split_orders(p, m)  # its B recomputes: already at its formula, 1F1B's memory
    if schedule == "gpipe":
        return [[Action(FORWARD, mb, c) for c in range(v) for mb in range(m)] +
                [Action(BACKWARD, mb, c) for c in reversed(range(v)) for mb in range(m)]
                for _ in range(p)]
    if schedule == "1f1b" and v == 1:
        forwards = [Action(FORWARD, mb, 0) for mb in range(m)]
        backwards = [Action(BACKWARD, mb, 0) for mb in range(m)]
        return [_one_forward_one_backward(forwards, backwards, min(p - d - 1, m))
                for d in range(p)]
    if schedule == "interleaved":
        groups = range(0, m, p)
        forwards = [Action(FORWARD, mb, c) for g in groups for c in range(v)
                    for mb in range(g, min(g + p, m))]
        backwards = [Action(BACKWARD, mb, c) for g in groups for c in reversed(range(v))
                     for mb in range(g, min(g + p, m))]
        return [split_backward(_one_forward_one_backward(
                    forwards, backwards, min(interleaved_warmup(p, v, d), m * v)), recompute)
                for d in range(p)]
    raise ValueError(f"unknown schedule {schedule!r} with virtual={v}")


def split_backward(order: list[Action], recompute: bool) -> list[Action]:
    """`order` with each whole backward as B then W, and with `recompute` an R before each B."""
    kinds = ([RECOMPUTE] if recompute else []) + [INPUT_GRAD, WEIGHT_GRAD]
    out = []
    for a in order:
        out += ([Action(kind, a.microbatch, a.chunk) for kind in kinds] if a.kind == BACKWARD
                else [a])
    return out


def interleaved_warmup(p: int, v: int, rank: int) -> int:
    """Chunk forwards rank d runs before its first backward. Megatron's 2(p-d-1) + (v-1)p is
    right for ranks that run asynchronously; in lockstep, where a tick's senders and receivers
    meet at its end, (p-d-1) + (v-1)p + (p-2) idles no more at any p, m and v tried, and less
    where R's recompute ahead of their gradients (0.123 -> 0.099 of the step at p=8, m=16,
    v=2), with Megatron's activation slots (`tests/test_pipeline_timeline.py`)."""
    return (p - rank - 1) + (v - 1) * p + max(p - 2, 0)


def _one_forward_one_backward(forwards, backwards, warmup: int) -> list[Action]:
    order = list(forwards[:warmup])
    for i, forward in enumerate(forwards[warmup:]):
        order += [forward, backwards[i]]
    return order + list(backwards[len(forwards) - warmup:])


RECOMPUTE_JOBS = ("interleaved", "zbv")  # the schedules whose tables hold R's to recompute


def build_table(schedule: str, stages: int, microbatches: int, virtual: int = 1,
                recompute: bool = False) -> Table:
    """The training table: every forward and backward of `schedule`, for a stage run again in
    the backward (`recompute`) or not. Built once per shape (zbv's placement is a search, and
    the planner asks for thousands); read-only."""
    return _built(schedule, stages, microbatches, virtual,
                  recompute and schedule in RECOMPUTE_JOBS)


@functools.lru_cache(maxsize=1024)
def _built(schedule: str, stages: int, microbatches: int, virtual: int,
           recompute: bool) -> Table:
    if schedule == "zbv":  # placed greedily, two chunks per rank in a V
        table = zbv_table(stages, microbatches, recompute)
    else:
        table = place(schedule, device_orders(schedule, stages, microbatches, virtual,
                                              recompute), stages, microbatches, virtual)
    for value in vars(table).values():  # shared by every caller: nobody may write to it
        if isinstance(value, np.ndarray):
            value.setflags(write=False)
    return table


def formula_idle(schedule: str, stages: int, microbatches: int, virtual: int = 1,
                 recompute: bool = False) -> float:
    """The idle share each schedule's paper gives, ranks running asynchronously: (p-1)/(m+p-1)
    for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved, whatever a backward's length; ZB-H1's
    (p-1)(T_F + T_B - T_W) over m(T_F + T_B + T_W) plus that, with T_F = T_W = 1 and T_B one
    more when recomputing: (p-1)/(3m+p-1) stored, (p-1)/(2m+p-1) recomputing. ZB-V has no
    closed form here, so its greedy table's idle cells (F = B = W) stand for it."""
    p, m, v = stages, microbatches, virtual
    if p == 1:
        return 0.0
    if schedule == "zb-h1":
        return bubble_formula(p, m) if not recompute else (p - 1) / (2 * m + p - 1)
    if schedule == "zbv":
        return build_table("zbv", p, m).bubble
    return (p - 1) / ((v if schedule == "interleaved" else 1) * m + p - 1)


def forward_table(stages: int, microbatches: int, virtual: int = 1,
                  v_shape: bool = False) -> Table:
    """Forwards only (evaluation): bubble (p-1)/(v*m+p-1) when p divides m or v = 1."""
    p, m, v = stages, microbatches, virtual
    order = [Action(FORWARD, mb, c) for g in range(0, m, p) for c in range(v)
             for mb in range(g, min(g + p, m))]
    return place("forward", [list(order) for _ in range(p)], p, m, v, v_shape)


