"""Check a pipeline tick table: every job once, on its rank, after its inputs exist, and how
many microbatches each rank holds.

One checker for every table the engine runs (`ticks.Table`): forwards and whole backwards of
`gpipe` and `1f1b`, the forward-only evaluation table, and the split-backward `interleaved`,
`zb-h1` and `zbv` (F, B and W, and R where the stage is recomputed as a job of its own; zbv's
chunks in a V). The rules:

- every forward of every microbatch on every virtual stage runs exactly once, on the rank that
  owns that virtual stage, and for training tables every backward too (a whole one, or B then W,
  with an R before each B or none);
- a job runs strictly after the ticks that produced its inputs (a value sent at tick t is usable
  at tick t + 1): F after the previous virtual stage's F; a backward (whole, or B) after its own
  F and the next virtual stage's backward (B), and after its own R; R after its own F; W
  after its own B;
- a rank holds a microbatch's activations from its forward until its last backward job (the
  whole backward, or W); the peak of that count per rank is the schedule's activation memory.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxtron.pipeline import ticks

F, WHOLE_BACKWARD, B, W, R = "F", "BW", "B", "W", "R"


class ScheduleError(ValueError):
    """A tick table that runs a job twice, never, on the wrong rank or before its inputs."""


@dataclasses.dataclass(frozen=True)
class Check:
    bubble: float  # idle cells over all cells
    peak_in_flight: tuple[int, ...]  # per rank: most microbatch-chunks held at once


def jobs(table) -> tuple[list[tuple[int, int, str, int, int]], int, int]:
    """(tick, rank, kind, microbatch, virtual stage) of every job; microbatches; virtual
    stages."""
    p = table.stages
    names = {ticks.FORWARD: F, ticks.BACKWARD: WHOLE_BACKWARD, ticks.INPUT_GRAD: B,
             ticks.WEIGHT_GRAD: W, ticks.RECOMPUTE: R}
    out = []
    for t, d in zip(*np.nonzero(table.kind)):
        out.append((int(t), int(d), names[int(table.kind[t, d])], int(table.microbatch[t, d]),
                    ticks.virtual_stage(int(d), int(table.chunk[t, d]), p, table.v_shape)))
    return out, table.microbatches, p * table.virtual


def check(table, training: bool = True) -> Check:
    """Validate `table`; ScheduleError naming the first broken rule."""
    listed, m, stages = jobs(table)
    p = table.stages
    when: dict[tuple[str, int, int], int] = {}
    for t, d, kind, mb, vs in listed:
        if (kind, mb, vs) in when:
            raise ScheduleError(f"{kind} of microbatch {mb} on virtual stage {vs} runs twice "
                                f"(ticks {when[(kind, mb, vs)]} and {t})")
        rank = ticks.owner(vs, p, table.v_shape)[0]
        if rank != d:
            raise ScheduleError(f"{kind} of microbatch {mb} on virtual stage {vs} runs on rank "
                                f"{d}, not its owner {rank}")
        when[(kind, mb, vs)] = t
    kinds = {kind for kind, _, _ in when}
    split = B in kinds or W in kinds
    wanted = [F] + ([B, W] if split else [WHOLE_BACKWARD] if training else []) + (
        [R] if R in kinds else [])
    for kind in wanted:
        missing = [(mb, vs) for mb in range(m) for vs in range(stages)
                   if (kind, mb, vs) not in when]
        if missing:
            raise ScheduleError(f"{kind} never runs for (microbatch, virtual stage) "
                                f"{missing[:3]}")
    backward = B if split else WHOLE_BACKWARD
    for (kind, mb, vs), t in when.items():
        needs = []
        if kind == F and vs > 0:
            needs = [(F, mb, vs - 1)]
        elif kind == backward:
            needs = [(F, mb, vs)] + ([(backward, mb, vs + 1)] if vs < stages - 1 else []) + (
                [(R, mb, vs)] if R in kinds else [])
        elif kind in (W, R):
            needs = [(B if kind == W else F, mb, vs)]
        for need in needs:
            if when[need] >= t:
                raise ScheduleError(f"{kind} of microbatch {mb} on virtual stage {vs} at tick "
                                    f"{t} runs before its input {need[0]} of microbatch "
                                    f"{need[1]} on virtual stage {need[2]} (tick {when[need]})")
    release = W if split else WHOLE_BACKWARD if training else F
    return Check(bubble=float(np.mean(table.kind == 0)),
                 peak_in_flight=_peaks(listed, p, release))


def _peaks(listed, p: int, release: str) -> tuple[int, ...]:
    held, peak = [0] * p, [0] * p
    for _, d, kind, _, _ in sorted(listed):
        held[d] += (kind == F) - (kind == release)
        peak[d] = max(peak[d], held[d])
    return tuple(peak)
