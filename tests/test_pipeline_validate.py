"""The tick-table validator on every schedule, and the zero-bubble ZB-H1 table against the
paper's bubble formula and 1F1B's memory (Qi et al., ICLR 2024). Plain numpy, no devices."""

import dataclasses

import numpy as np
import pytest

from jaxtron.pipeline import zero_bubble as split_backward
from jaxtron.pipeline.schedules import build_table, device_orders, forward_table
from jaxtron.pipeline.table_check import ScheduleError, check
from jaxtron.pipeline.ticks import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    RECOMPUTE,
    WEIGHT_GRAD,
    Action,
    place,
    virtual_stage,
)

from conftest import run_in_process


@pytest.mark.parametrize("schedule, p, v, m", [
    ("gpipe", 2, 1, 3), ("gpipe", 4, 1, 8), ("1f1b", 2, 1, 1), ("1f1b", 4, 1, 3),
    ("1f1b", 4, 1, 8), ("1f1b", 8, 1, 16), ("interleaved", 2, 2, 4), ("interleaved", 4, 2, 8),
    ("interleaved", 4, 3, 4)])
@pytest.mark.parametrize("recompute", [True, False])
def test_every_engine_schedule_passes_and_holds_what_its_formula_says(schedule, p, v, m,
                                                                       recompute):
    result = check(build_table(schedule, p, m, v, recompute))
    if schedule == "gpipe":
        assert result.peak_in_flight == (m,) * p
    elif schedule == "1f1b":  # rank d: its p - d - 1 warm-up forwards and one more
        assert result.peak_in_flight == tuple(min(p - d, m) for d in range(p))
    else:  # the lockstep warm-up: (p - d - 1) + (v - 1)p + (p - 2) chunk forwards, one more
        assert result.peak_in_flight == tuple(min((p - d - 1) + (v - 1) * p + (p - 2) + 1, v * m)
                                              for d in range(p))
    check(forward_table(p, m, v), training=False)


def ticked(orders, p: int, v: int, v_shape: bool = False) -> dict:
    """The placement simulated tick by tick: at each tick every rank runs its next job if
    the jobs it reads ran at earlier ticks. -> {(rank, tick): (kind, microbatch, chunk)}"""
    last, done, cells, cursor, tick = p * v - 1, {}, {}, [0] * p, 0
    while any(cursor[d] < len(orders[d]) for d in range(p)):
        ready = []
        for d in range(p):
            if cursor[d] == len(orders[d]):
                continue
            a = orders[d][cursor[d]]
            vs = virtual_stage(d, a.chunk, p, v_shape)
            reads = {FORWARD: [(FORWARD, a.microbatch, vs - 1)] if vs else [],
                     WEIGHT_GRAD: [(INPUT_GRAD, a.microbatch, vs)],
                     RECOMPUTE: [(FORWARD, a.microbatch, vs)]}.get(
                a.kind, [(FORWARD, a.microbatch, vs)]
                + ([(a.kind, a.microbatch, vs + 1)] if vs < last else []))
            if all(done.get(job, tick) < tick for job in reads):
                ready.append((d, a, vs))
        assert ready, "deadlock"
        for d, a, vs in ready:
            done[(a.kind, a.microbatch, vs)] = tick
            cells[(d, tick)] = (a.kind, a.microbatch, a.chunk)
            cursor[d] += 1
        tick += 1
    return cells


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved", "forward",
                                      "forward_v"])
def test_each_job_is_placed_where_a_tick_by_tick_simulation_runs_it(schedule):
    """`place` computes each job's tick from its inputs' and its rank's previous job's; a
    simulation of the ticks one by one must agree on every cell, and the table (with its
    slots) must pass the checker."""
    v_shape = schedule == "forward_v"  # zbv's evaluation: two chunks down and up a V
    for p, m, v, recompute in [(1, 3, 1, True), (2, 4, 1, True), (4, 8, 1, False),
                               (4, 3, 1, True), (3, 6, 2, True), (4, 8, 2, False),
                               (4, 4, 3, True)]:
        if v > 1 and (not schedule.startswith(("interleaved", "forward")) or m % p):
            continue
        if v_shape and v != 2:
            continue
        if schedule.startswith("forward"):
            orders = [[Action(FORWARD, mb, c) for g in range(0, m, p) for c in range(v)
                       for mb in range(g, min(g + p, m))]] * p
        else:
            orders = device_orders(schedule, p, m, v, recompute)
        table = place(schedule, orders, p, m, v, v_shape)
        busy = {(int(d), int(t)): (int(table.kind[t, d]), int(table.microbatch[t, d]),
                                   int(table.chunk[t, d]))
                for t, d in np.argwhere(table.kind != 0)}
        want = ticked(orders, p, v, v_shape)
        assert busy == want and table.ticks == 1 + max(t for _, t in want), (p, m, v)
        assert {k for k, _, _ in busy.values()} <= {FORWARD, BACKWARD, INPUT_GRAD,
                                                    WEIGHT_GRAD, RECOMPUTE}
        check(table, training=not schedule.startswith("forward"))


def test_a_job_listed_twice_is_refused():
    orders = device_orders("1f1b", 2, 2)
    orders[0].append(orders[0][0])
    with pytest.raises(ValueError, match="twice"):
        place("1f1b", orders, 2, 2, 1)


def test_a_job_outside_the_tables_microbatches_or_stages_is_refused():
    """Jobs are numbered from (kind, microbatch, virtual stage): one out of range would take
    another job's number."""
    for bad in (Action(FORWARD, 2, 0), Action(FORWARD, 0, 1)):  # microbatch 2 of 2; chunk 1 of 1
        orders = device_orders("1f1b", 2, 2)
        orders[1].append(bad)
        with pytest.raises(ValueError, match=r"device 1's action \d+ .* outside 2 microbatches "
                                             "and 1 chunks"):
            place("1f1b", orders, 2, 2, 1)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [8, 16, 32])
def test_zb_h1_bubble_is_the_papers_and_its_memory_is_1f1bs(p, m):
    table = build_table("zb-h1", p, m)
    result = check(table)
    # (p-1)(T_F + T_B - T_W) idle ticks per rank out of 3m busy ones, T_F = T_B = T_W = 1
    assert table.ticks == 3 * m + p - 1
    assert table.bubble == pytest.approx((p - 1) / (3 * m + p - 1))
    assert table.bubble == pytest.approx(split_backward.bubble_formula(p, m))
    assert table.bubble < (p - 1) / (m + p - 1) / 2  # 1F1B's, counted in the same units
    assert result.peak_in_flight == (p,) * p  # 1F1B's peak (rank 0's), on every rank


@pytest.mark.parametrize("p, m", [(4, 2), (8, 3), (2, 1)])
def test_zb_h1_with_fewer_microbatches_than_stages_is_still_valid(p, m):
    check(build_table("zb-h1", p, m))


def test_broken_tables_are_refused():
    table = build_table("1f1b", 4, 8)
    kind = table.kind.copy()
    t, d = np.argwhere(kind == 2)[0]  # the first backward, moved onto tick 0
    early = kind.copy()
    early[0, d], early[t, d] = kind[t, d], kind[0, d]
    micro = table.microbatch.copy()
    micro[0, d], micro[t, d] = table.microbatch[t, d], table.microbatch[0, d]
    with pytest.raises(ScheduleError, match="before its input"):
        check(dataclasses.replace(table, kind=early, microbatch=micro))
    dropped = kind.copy()
    dropped[t, d] = 0
    with pytest.raises(ScheduleError, match="never runs"):
        check(dataclasses.replace(table, kind=dropped))
    split = build_table("zb-h1", 4, 8)
    t, d = np.argwhere(split.kind == WEIGHT_GRAD)[0]
    twice = split.microbatch.copy()
    twice[t, d] = twice[t, d] + 1  # one W of another microbatch instead: it runs twice
    with pytest.raises(ScheduleError):
        check(dataclasses.replace(split, microbatch=twice))


def shown(*args: str) -> str:
    """What `python -m jaxtron.pipeline.show <args>` prints."""
    result = run_in_process("jaxtron.pipeline.show", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_show_draws_zb_h1_with_its_bubble():
    out = shown("--stages", "4", "--microbatches", "8", "--schedule", "zb-h1")
    assert "W7" in out and "bubble 0.1111" in out and "1F1B in the same units" in out


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [2, 8, 16, 32])
@pytest.mark.parametrize("recompute", [True, False])
def test_zbv_nearly_removes_the_bubble_at_1f1bs_memory(p, m, recompute):
    """Two chunks per rank in a V: both ends on rank 0, a smaller bubble than ZB-H1's at the
    same (p, m) (ticks of chunk jobs against ticks of stage jobs), and at most 2p chunk
    activations held, 1F1B's p whole stages; recomputing, with an R before each B."""
    table = build_table("zbv", p, m, recompute=recompute)
    assert table.recomputes == recompute
    result = check(table)
    assert table.v_shape and table.virtual == 2
    assert set(table.chunk[table.kind > 0]) == {0, 1}
    # the validator checked each job on its owner: rank 0 runs virtual stage 2p - 1 (the loss)
    assert virtual_stage(0, 1, p, v_shape=True) == 2 * p - 1 and table.chunk[:, 0].max() == 1
    assert table.bubble < build_table("zb-h1", p, m).bubble
    assert max(result.peak_in_flight) <= 2 * p
    if m >= 2 * p:
        assert table.bubble < 0.08, table.bubble


def test_show_draws_zbv():
    """The paper's table (stored residuals), and the recomputing one with its R's."""
    show = ["--stages", "4", "--microbatches", "8", "--schedule", "zbv"]
    out = shown(*show, "--stored")
    assert "W7.0" in out and "F0.1" in out and "bubble 0.0588" in out and "R0" not in out
    out = shown(*show)
    assert "R7.0" in out and "F = R = B = W" in out and "bubble 0.0448" in out
