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
    """Each device's next action at the earliest tick its inputs exist."""
    last = p * v - 1
    done: dict[tuple[int, int, int], int] = {}  # (kind, microbatch, virtual stage) -> tick
    placed: list[list[tuple[int, Action]]] = [[] for _ in range(p)]
    cursor = [0] * p
    tick = 0
    while any(cursor[d] < len(orders[d]) for d in range(p)):
        ready = []
        for d in range(p):
            if cursor[d] == len(orders[d]):
                continue
            a = orders[d][cursor[d]]
            vs = virtual_stage(d, a.chunk, p, v_shape)
            if a.kind == FORWARD:
                deps = [] if vs == 0 else [(FORWARD, a.microbatch, vs - 1)]
            elif a.kind == WEIGHT_GRAD:
                deps = [(INPUT_GRAD, a.microbatch, vs)]
            elif a.kind == RECOMPUTE:
                deps = [(FORWARD, a.microbatch, vs)]
            else:  # a whole backward or a B: its forward and the next stage's same job
                deps = [(FORWARD, a.microbatch, vs)] + (
                    [] if vs == last else [(a.kind, a.microbatch, vs + 1)])
            if all(done.get(dep, tick) < tick for dep in deps):
                ready.append((d, a, vs))
        if not ready and tick > 4 * (m * v + p) * 2:
            raise RuntimeError(f"schedule {schedule} deadlocked at tick {tick}")
        for d, a, vs in ready:
            done[(a.kind, a.microbatch, vs)] = tick
            placed[d].append((tick, a))
            cursor[d] += 1
        tick += 1
    return assign_slots(placed, tick, p, v, m, done, v_shape)


def assign_slots(placed, ticks: int, p: int, v: int, m: int, done,
                 v_shape: bool = False) -> Table:
    """The table of jobs `placed` per device as (tick, Action), with `done` the tick of every
    (kind, microbatch, virtual stage): buffer slots for what arrives and what a B stashes."""
    last = p * v - 1
    shape = (ticks, p)
    kind, mb, chunk = (np.zeros(shape, np.int32) for _ in range(3))
    act_slot, grad_slot = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    for d in range(p):
        for t, a in placed[d]:
            kind[t, d], mb[t, d], chunk[t, d] = a.kind, a.microbatch, a.chunk
    # Arrivals: the forward output of (mb, vs - 1) reaches the device of vs at the end of the
    # tick it was computed; the backward (or B) output of (mb, vs + 1) likewise. Each is held
    # until the backward (or B) of (mb, vs) has run; a B's stash until its W.
    backward = INPUT_GRAD if any(k == INPUT_GRAD for k, _, _ in done) else BACKWARD
    residuals_from = RECOMPUTE if any(k == RECOMPUTE for k, _, _ in done) else FORWARD
    act_events, grad_events, w_events = [], [], []  # (arrival, release, device, (mb, vs))
    res_events = []
    for (k, micro, vs), t in done.items():
        if k == residuals_from and (backward, micro, vs) in done:
            res_events.append((t, done[(backward, micro, vs)], owner(vs, p, v_shape)[0],
                               (micro, vs)))
        if k == FORWARD and vs < last:
            dest = vs + 1  # held until its backward; without backwards, until its forward
            release = done.get((backward, micro, dest), done[(FORWARD, micro, dest)])
            act_events.append((t, release, owner(dest, p, v_shape)[0], (micro, dest)))
        if k == backward and vs > 0:
            dest = vs - 1
            grad_events.append((t, done[(backward, micro, dest)], owner(dest, p, v_shape)[0],
                                (micro, dest)))
        if k == INPUT_GRAD:
            w_events.append((t, done[(WEIGHT_GRAD, micro, vs)], owner(vs, p, v_shape)[0],
                             (micro, vs)))
    act_of, act_slots = _allocate(act_events, p)
    grad_of, grad_slots = _allocate(grad_events, p)
    w_of, w_slots = _allocate(w_events, p) if w_events else ({}, 0)
    res_of, res_slots = _allocate(res_events, p) if res_events else ({}, 0)
    w_slot, res_slot = np.zeros(shape, np.int32), np.zeros(shape, np.int32)

    def channel(sender: int, receiver: int, ring: int) -> int:
        if not v_shape:
            return ring
        return SELF if sender == receiver else DOWN if receiver == sender + 1 else UP

    # [channel] -> [ticks, ranks] slot arrays, scratch where nothing arrives that way
    recv_acts = [np.full(shape, act_slots, np.int32) for _ in (DOWN, UP, SELF)]
    recv_grads = [np.full(shape, grad_slots, np.int32) for _ in (DOWN, UP, SELF)]
    send_dir = np.full(shape, NOWHERE, np.int32)
    for t, _, d, (micro, dest) in act_events:
        sender = owner(dest - 1, p, v_shape)[0]
        recv_acts[channel(sender, d, DOWN)][t, d] = act_of[(micro, dest)]
        send_dir[t, sender] = channel(sender, d, DOWN)
    for t, _, d, (micro, dest) in grad_events:
        sender = owner(dest + 1, p, v_shape)[0]
        recv_grads[channel(sender, d, UP)][t, d] = grad_of[(micro, dest)]
        send_dir[t, sender] = channel(sender, d, UP)
    recv_act, recv_grad = recv_acts[DOWN], recv_grads[UP]
    for d in range(p):
        for t, a in placed[d]:
            key = (a.microbatch, virtual_stage(d, a.chunk, p, v_shape))
            act_slot[t, d] = act_of.get(key, act_slots)
            if a.kind in (BACKWARD, INPUT_GRAD):
                grad_slot[t, d] = grad_of.get(key, grad_slots)
            if a.kind in (INPUT_GRAD, WEIGHT_GRAD):
                w_slot[t, d] = w_of[key]
            if a.kind in (FORWARD, BACKWARD, INPUT_GRAD, RECOMPUTE):
                res_slot[t, d] = res_of.get(key, res_slots)
    return Table(kind, mb, chunk, act_slot, grad_slot, recv_act, recv_grad, act_slots,
                 grad_slots, p, v, m, w_slot, w_slots, recv_acts[UP], recv_acts[SELF],
                 recv_grads[DOWN], recv_grads[SELF], send_dir, v_shape, res_slot, res_slots)


def _allocate(events, p: int):
    """Smallest free slot per device, held from arrival (end of tick) to release (end of tick)."""
    slot_of, busy, free, count = {}, [[] for _ in range(p)], [[] for _ in range(p)], [0] * p
    for arrive, release, d, key in sorted(events):
        while busy[d] and busy[d][0][0] <= arrive:  # released by now: free again
            heapq.heappush(free[d], heapq.heappop(busy[d])[1])
        if free[d]:
            slot = heapq.heappop(free[d])
        else:
            slot, count[d] = count[d], count[d] + 1
        heapq.heappush(busy[d], (release, slot))
        slot_of[key] = slot
    return slot_of, max(count + [1])


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
