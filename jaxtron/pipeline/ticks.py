"""Tick tables: which job each pipeline rank runs at each tick, and where values wait.

A table is plain data, testable without devices: per tick and rank the job's kind (forward,
backward, or a split backward's B and W), microbatch and model chunk, and the buffer slots the
engine reads and writes. `place` puts each rank's jobs, in the order its schedule lists them
(`schedules.py`, `zero_bubble.py`), at the earliest tick their inputs exist (a value sent at
tick t is usable at tick t + 1), one job per rank per tick; `assign_slots` then gives each
value a slot for as long as it is needed:

- a received activation, from its arrival until its backward (or, forward-only, its next
  forward) has used it; a received gradient, until its backward has used it;
- a B's stash (split tables), until its W has run;
- a forward's residuals (`pipeline.recompute: false`), until its backward has run; in a table
  that recomputes as a job of its own (R, run before its B), the R's residuals until that B.

The number of slots is the memory a schedule needs: GPipe's grows with m, 1F1B's stays near p.
The idle cells are the bubble.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import numpy as np

IDLE, FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, RECOMPUTE = 0, 1, 2, 3, 4, 5
DOWN, UP, SELF, NOWHERE = 0, 1, 2, 3  # where a value goes: rank d + 1, d - 1, d itself
LETTERS = {FORWARD: "F", BACKWARD: "B", INPUT_GRAD: "B", WEIGHT_GRAD: "W", RECOMPUTE: "R"}


@dataclasses.dataclass(frozen=True)
class Action:
    kind: int  # FORWARD, BACKWARD, or INPUT_GRAD and WEIGHT_GRAD (and RECOMPUTE before B)
    microbatch: int
    chunk: int


def virtual_stage(rank: int, chunk: int, p: int, v_shape: bool = False) -> int:
    """The virtual stage a rank's chunk runs: c*p + d around a ring (interleaved), or down the
    ranks and back up a V (zbv: chunk 1 of rank d is stage 2p-1-d, so rank 0 holds both
    ends)."""
    if v_shape:
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def owner(stage: int, p: int, v_shape: bool = False) -> tuple[int, int]:
    """(rank, chunk) that runs virtual stage `stage`: the inverse of `virtual_stage`."""
    if v_shape:
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


class TickTable:
    """What every tick table shares: `kind` is [ticks, ranks], 0 where a rank idles."""
    kind: np.ndarray

    @property
    def ticks(self) -> int:
        return self.kind.shape[0]

    @property
    def bubble(self) -> float:
        return float(np.mean(self.kind == IDLE))


@dataclasses.dataclass(frozen=True)
class Table(TickTable):
    """Per tick and device: action kind, microbatch, chunk, and buffer slots.

    act_slot / grad_slot: where the input activation / incoming gradient of the action is.
    recv_act / recv_grad: where to store what arrives at the end of the tick; the last slot
    (index act_slots / grad_slots) is scratch for values nobody needs. w_slot: where a B leaves
    what its W reads (split tables; w_slots is 0 for the others). Around a ring activations
    arrive from rank d - 1 (`recv_act`) and gradients from d + 1 (`recv_grad`); a V table's
    values travel both ways and turn at rank p - 1 without a send, so it also has
    `recv_act_up` (from d + 1), `recv_act_self`, `recv_grad_down` (from d - 1) and
    `recv_grad_self`, and `send_dir` says where each job's output goes (`DOWN`, `UP`, `SELF`,
    or `NOWHERE`).
    """
    kind: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    act_slot: np.ndarray
    grad_slot: np.ndarray
    recv_act: np.ndarray
    recv_grad: np.ndarray
    act_slots: int
    grad_slots: int
    stages: int
    virtual: int
    microbatches: int
    w_slot: np.ndarray
    w_slots: int
    recv_act_up: np.ndarray
    recv_act_self: np.ndarray
    recv_grad_down: np.ndarray
    recv_grad_self: np.ndarray
    send_dir: np.ndarray
    v_shape: bool = False  # chunks placed down and back up the ranks (`virtual_stage`)
    # where a forward (`pipeline.recompute: false`) or an R leaves the residuals its backward
    # reads, held from that job to the backward (or B); res_slots of them per rank
    res_slot: np.ndarray | None = None
    res_slots: int = 0

    @property
    def split(self) -> bool:
        return self.w_slots > 0

    @functools.cached_property
    def recomputes(self) -> bool:
        """Whether the stage is run again as its own job (R) before each B, which then reads
        R's residuals: every job one forward of work."""
        return bool((self.kind == RECOMPUTE).any())


def place(schedule: str, orders: list[list[Action]], p: int, m: int, v: int,
          v_shape: bool = False) -> Table:
    """Each device's actions in its order, each at the earliest tick after both its device's
    previous action and its inputs. A device is placed on until an input is not placed yet,
    then waits for that job: placing it wakes the device again. Devices left waiting at the
    end are a deadlock. Jobs are numbered (`_job_numbers`) so the walk, over tens of thousands
    of jobs in the planner's tables, touches only ints."""
    columns = [_order_columns(order, d, p, v_shape) for d, order in enumerate(orders)]
    for d, c in enumerate(columns):
        _check_in_range(schedule, c, d, m, v)
    numbered = [_job_numbers(c, m, p * v) for c in columns]
    done = [-1] * ((RECOMPUTE + 1) * m * p * v)  # job number -> its tick, -1 not yet placed
    ticks: list[list[int]] = [[] for _ in range(p)]
    waiting: dict[int, list[int]] = {}  # job number -> devices waiting for it
    awake = list(range(p))
    while awake:
        d = awake.pop()
        jobs, placed = numbered[d], ticks[d]
        i = len(placed)
        tick = placed[-1] + 1 if placed else 0
        while i < len(jobs):
            job, first, second = jobs[i]
            for needed in (first, second):
                if needed < 0:
                    continue
                at = done[needed]
                if at < 0:
                    waiting.setdefault(needed, []).append(d)
                    break
                if at >= tick:
                    tick = at + 1
            else:
                if done[job] >= 0:
                    kind, micro, _, vs = columns[d][:, i].tolist()
                    raise ValueError(f"schedule {schedule} lists {(kind, micro, vs)} twice")
                done[job] = tick
                placed.append(tick)
                awake += waiting.pop(job, [])
                i, tick = i + 1, tick + 1
                continue
            break
    if any(len(ticks[d]) < len(orders[d]) for d in range(p)):
        raise RuntimeError(f"schedule {schedule} deadlocked")
    jobs = np.concatenate([np.stack([np.asarray(ticks[d], np.int64).reshape(-1),
                                     np.full(len(ticks[d]), d), *columns[d][:3],
                                     columns[d][3]], axis=1) for d in range(p)])
    return assign_slots(jobs, 1 + max((t[-1] for t in ticks if t), default=-1), p, v, m, v_shape)


def _order_columns(order: list[Action], d: int, p: int, v_shape: bool) -> np.ndarray:
    """A device's order as [4, n] int64: kind, microbatch, chunk, virtual stage."""
    if not order:
        return np.zeros((4, 0), np.int64)
    kind, micro, chunk = np.array([(a.kind, a.microbatch, a.chunk) for a in order],
                                  np.int64).T
    vs = np.where(chunk == 0, d, 2 * p - 1 - d) if v_shape else chunk * p + d
    return np.stack([kind, micro, chunk, vs])


def _check_in_range(schedule: str, columns: np.ndarray, d: int, m: int, v: int) -> None:
    """Refuse an action outside the table's kinds, microbatches or chunks: its job number
    (`_job_numbers`) would be another job's."""
    kind, micro, chunk, _ = columns
    outside = ((kind < 0) | (kind > RECOMPUTE) | (micro < 0) | (micro >= m) | (chunk < 0)
               | (chunk >= v))
    if outside.any():
        i = int(np.argmax(outside))
        raise ValueError(f"{schedule}: device {d}'s action {i} (kind {kind[i]}, microbatch "
                         f"{micro[i]}, chunk {chunk[i]}) is outside {m} microbatches and {v} "
                         "chunks")


def _job_numbers(columns: np.ndarray, m: int, stages: int) -> list[tuple[int, int, int]]:
    """(job, first input, second input) per action, each a job number (kind, microbatch,
    virtual stage) -> (kind * m + microbatch) * stages + stage, -1 for none: a forward reads
    the previous stage's forward; a whole backward or a B its forward and the next stage's
    same job; an R its forward; a W its B."""
    kind, micro, _, vs = columns
    number = lambda k, s: (k * m + micro) * stages + s  # noqa: E731
    none = np.full_like(kind, -1)
    backward = (kind == BACKWARD) | (kind == INPUT_GRAD)
    first = np.select([kind == FORWARD, kind == WEIGHT_GRAD],
                      [np.where(vs > 0, number(FORWARD, vs - 1), -1), number(INPUT_GRAD, vs)],
                      number(FORWARD, vs))
    second = np.where(backward & (vs < stages - 1), number(kind, vs + 1), none)
    return list(zip(number(kind, vs).tolist(), first.tolist(), second.tolist()))


def assign_slots(jobs: np.ndarray, ticks: int, p: int, v: int, m: int,
                 v_shape: bool = False) -> Table:
    """The table of `jobs`, one row (tick, device, kind, microbatch, chunk, virtual stage) per
    placed job in any order: buffer slots for what arrives and what a B stashes. Computed
    over arrays of every job at once (the planner builds tables of tens of thousands of
    jobs)."""
    shape, stages = (ticks, p), p * v
    rank_of = np.array([owner(vs, p, v_shape)[0] for vs in range(stages)])
    jobs = np.asarray(jobs, np.int64).reshape(-1, 6)
    tick, device, kinds, micro, chunks, vs = jobs.T
    kind, mb, chunk = (np.zeros(shape, np.int32) for _ in range(3))
    kind[tick, device], mb[tick, device], chunk[tick, device] = kinds, micro, chunks
    act, grad, w, res = _held_values(jobs, m, stages, rank_of)
    act_at, act_slots = _allocate(act, p, m, stages)
    grad_at, grad_slots = _allocate(grad, p, m, stages)
    nothing_held = (np.full_like(act_at, -1), 0)  # no B's stashes, or no kept residuals
    w_at, w_slots = _allocate(w, p, m, stages) if len(w) else nothing_held
    res_at, res_slots = _allocate(res, p, m, stages) if len(res) else nothing_held

    def channels(sender, receiver, ring: int):
        if not v_shape:
            return np.full(len(sender), ring)
        return np.where(sender == receiver, SELF, np.where(receiver == sender + 1, DOWN, UP))

    # [channel] -> [ticks, ranks] slot arrays, scratch where nothing arrives that way
    recv_acts = [np.full(shape, act_slots, np.int32) for _ in (DOWN, UP, SELF)]
    recv_grads = [np.full(shape, grad_slots, np.int32) for _ in (DOWN, UP, SELF)]
    send_dir = np.full(shape, NOWHERE, np.int32)
    for arrivals, recv, slot_at, step, ring in ((act, recv_acts, act_at, -1, DOWN),
                                                (grad, recv_grads, grad_at, 1, UP)):
        t, d, value_mb, value_vs = arrivals[:, 0], arrivals[:, 2], arrivals[:, 3], arrivals[:, 4]
        sender = rank_of[value_vs + step]
        way = channels(sender, d, ring)
        for c in (DOWN, UP, SELF):
            here = way == c
            recv[c][t[here], d[here]] = slot_at[value_mb[here], value_vs[here]]
        send_dir[t, sender] = way

    def slots_read(jobs_mask, slot_at, scratch: int) -> np.ndarray:
        """[ticks, ranks]: the slot each job in `jobs_mask` reads, `scratch` for none."""
        out = np.zeros(shape, np.int32)
        held = slot_at[micro[jobs_mask], vs[jobs_mask]]
        out[tick[jobs_mask], device[jobs_mask]] = np.where(held >= 0, held, scratch)
        return out

    every = np.ones(len(kinds), bool)
    act_slot = slots_read(every, act_at, act_slots)
    grad_slot = slots_read((kinds == BACKWARD) | (kinds == INPUT_GRAD), grad_at, grad_slots)
    w_slot = slots_read((kinds == INPUT_GRAD) | (kinds == WEIGHT_GRAD), w_at, 0)
    res_slot = slots_read(kinds != WEIGHT_GRAD, res_at, res_slots)
    return Table(kind, mb, chunk, act_slot, grad_slot, recv_acts[DOWN], recv_grads[UP],
                 act_slots, grad_slots, p, v, m, w_slot, w_slots, recv_acts[UP],
                 recv_acts[SELF], recv_grads[DOWN], recv_grads[SELF], send_dir, v_shape,
                 res_slot, res_slots)


def _held_values(jobs: np.ndarray, m: int, stages: int, rank_of: np.ndarray):
    """What waits in a buffer, from jobs (tick, device, kind, microbatch, chunk, virtual
    stage): the forward output of (mb, vs - 1) reaches the device of vs at the end of the tick
    it was computed, and the backward (or B) output of (mb, vs + 1) likewise; each is held
    until the backward (or B) of (mb, vs) has run (forward-only: until its forward). A B's
    stash is held until its W, a forward's (or R's) residuals until its backward. -> events
    (arrival, release, device, microbatch, virtual stage) of (activations, gradients,
    stashes, residuals)."""
    tick, _, kinds, micro, _, vs = jobs.T
    tick_of_job = np.full((RECOMPUTE + 1, m, stages), -1, np.int64)  # -1: no such job
    tick_of_job[kinds, micro, vs] = tick
    backward = INPUT_GRAD if (kinds == INPUT_GRAD).any() else BACKWARD
    residuals_from = RECOMPUTE if (kinds == RECOMPUTE).any() else FORWARD

    def events(mask, value_vs, release):
        if (release < 0).any():
            raise ValueError("a job's value is held for a job the table does not have")
        return np.stack([tick[mask], release, rank_of[value_vs], micro[mask], value_vs], axis=1)

    forwards = (kinds == FORWARD) & (vs < stages - 1)
    next_vs = vs[forwards] + 1
    its_backward = tick_of_job[backward, micro[forwards], next_vs]
    activations = events(forwards, next_vs, np.where(
        its_backward >= 0, its_backward, tick_of_job[FORWARD, micro[forwards], next_vs]))
    backwards = (kinds == backward) & (vs > 0)
    gradients = events(backwards, vs[backwards] - 1,
                       tick_of_job[backward, micro[backwards], vs[backwards] - 1])
    bs = kinds == INPUT_GRAD
    stashes = events(bs, vs[bs], tick_of_job[WEIGHT_GRAD, micro[bs], vs[bs]])
    kept = (kinds == residuals_from) & (tick_of_job[backward, micro, vs] >= 0)
    residuals = events(kept, vs[kept], tick_of_job[backward, micro[kept], vs[kept]])
    return activations, gradients, stashes, residuals


def _allocate(events: np.ndarray, p: int, m: int, stages: int) -> tuple[np.ndarray, int]:
    """Smallest free slot per device, held from arrival (end of tick) to release (end of
    tick), for events (arrival, release, device, microbatch, virtual stage) -> ([m, stages]
    slot of each held value, -1 elsewhere; slots per device). Each device's values are
    given slots in the order they arrive (then release, microbatch, stage)."""
    slot_at = np.full((m, stages), -1, np.int64)
    if not len(events):
        return slot_at, 1
    arrive, release, device, micro, stage = events.T
    order = np.lexsort((stage, micro, release, arrive, device))
    arrive, release, device = arrive[order].tolist(), release[order].tolist(), device[order]
    slots, count = [0] * len(order), 1
    for start, end in zip(np.searchsorted(device, range(p)),
                          np.searchsorted(device, range(p), side="right")):
        busy: list[tuple[int, int]] = []  # (release, slot) of the values held now
        free: list[int] = []
        used = 0
        for i in range(start, end):
            while busy and busy[0][0] <= arrive[i]:  # released by now: free again
                heapq.heappush(free, heapq.heappop(busy)[1])
            if free:
                slot = heapq.heappop(free)
            else:
                slot, used = used, used + 1
            heapq.heappush(busy, (release[i], slot))
            slots[i] = slot
        count = max(count, used)
    slot_at[micro[order], stage[order]] = slots
    return slot_at, count


def receivers(table: Table) -> np.ndarray:
    """The rank each tick's send from each rank reaches, [ticks, stages], -1 for none: around
    a ring d + 1 / d - 1 (the last rank's DOWN wrapping to rank 0); in a V the neighbour.
    SELF and NOWHERE make no collective."""
    ranks = np.arange(table.stages)
    return np.where(table.send_dir == DOWN, (ranks + 1) % table.stages,
                    np.where(table.send_dir == UP, (ranks - 1) % table.stages, -1))


def exchange_patterns(table: Table) -> tuple[list[tuple[tuple, tuple]], np.ndarray]:
    """The distinct exchanges of a table and which one each tick makes: ([(DOWN pairs, UP
    pairs)], pattern index per tick), a pair being (sender, receiver). Only the ranks whose
    job's output goes to a neighbour are in a pattern: a tick sends nothing it does not need."""
    to = receivers(table)
    patterns: dict[tuple[tuple, tuple], int] = {}
    index = np.zeros(table.ticks, np.int32)
    for t in range(table.ticks):
        pairs = tuple(tuple((int(d), int(to[t, d]))
                            for d in np.nonzero(table.send_dir[t] == direction)[0])
                      for direction in (DOWN, UP))
        index[t] = patterns.setdefault(pairs, len(patterns))
    return list(patterns), index


def transfers(table: Table) -> int:
    """Sends to another rank over the whole table (a V's turn at its bottom stays local)."""
    return int((receivers(table) >= 0).sum())


def render(table: Table) -> str:
    """A text timeline: one row per device, `F3`/`B3`/`W3` (chunk as a suffix `F3.1`) or `.`."""
    cells = []
    for d in range(table.stages):
        row = []
        for t in range(table.ticks):
            k = table.kind[t, d]
            if k == IDLE:
                row.append(".")
            else:
                suffix = f".{table.chunk[t, d]}" if table.virtual > 1 else ""
                row.append(f"{LETTERS[int(k)]}{table.microbatch[t, d]}{suffix}")
        cells.append(row)
    width = max(len(c) for row in cells for c in row)
    return "\n".join(f"stage {d}: " + " ".join(c.rjust(width) for c in row)
                     for d, row in enumerate(cells))
