"""A tick table's length where ranks run side by side, jobs at their real lengths
(`jaxtron/pipeline/timeline.py`): hand-walked tables, the unit-tick limit, and the paper's
ZB-H1 bubble where its B and W each take one forward. Plain numpy, no devices."""

import pytest

from jaxtron.pipeline.schedules import build_table, formula_idle
from jaxtron.pipeline.ticks import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    RECOMPUTE,
    WEIGHT_GRAD,
    Action,
    place,
)
from jaxtron.pipeline.timeline import step_units, weighted_idle, work_units


def test_one_microbatch_over_two_stages_walked_by_hand():
    # F0 on rank 0, F0 on rank 1, its backward on rank 1, then on rank 0: nothing overlaps.
    table = build_table("1f1b", 2, 1)
    assert step_units(table, recompute=True) == 1 + 1 + 3 + 3
    assert step_units(table, recompute=False) == 1 + 1 + 2 + 2
    assert work_units(table, recompute=True) == 4


def asynchronous_step(table, lengths) -> float:
    """The step with no ticks at all: each rank runs its jobs in the table's order, a job
    starting once its rank is free and its input exists (the forward of the stage before,
    the backward of the stage after), as asynchronous send/receive pipelines run."""
    p, jobs = table.stages, []
    for t in range(table.ticks):
        for d in range(p):
            if table.kind[t, d]:
                jobs.append((d, int(table.kind[t, d]), int(table.microbatch[t, d]),
                             int(table.chunk[t, d]) * p + d))
    done, free, last = {}, [0.0] * p, p * table.virtual - 1
    for d, kind, mb, vs in jobs:  # tick order: every input is placed before its user
        if kind == 1:  # a forward: the stage before's
            needs = [(1, mb, vs - 1)] if vs else []
        else:  # a whole backward: its forward and the stage after's backward
            needs = [(1, mb, vs)] + ([(2, mb, vs + 1)] if vs < last else [])
        start = max([free[d]] + [done[n] for n in needs])
        done[(kind, mb, vs)] = free[d] = start + lengths[kind]
    return max(free)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p, m", [(2, 2), (4, 8), (8, 32)])
@pytest.mark.parametrize("recompute", [True, False])
def test_the_engines_walk_is_an_asynchronous_pipelines_for_1f1b_and_gpipe(schedule, p, m,
                                                                          recompute):
    """Only the ranks that trade meet at a tick's end, so 1F1B runs as Megatron's
    asynchronous 1F1B does and keeps (p-1)/(m+p-1); interleaved chunks still stall."""
    table = build_table(schedule, p, m)
    lengths = {1: 1.0, 2: 3.0 if recompute else 2.0}
    assert step_units(table, recompute) == pytest.approx(asynchronous_step(table, lengths))
    assert weighted_idle(table, recompute) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_zb_h1_without_recompute_has_the_papers_bubble(p, m):
    """B and W one forward each: every job one tick, so the idle share is the table's,
    (p-1)/(3m+p-1) (Qi et al.), a third of 1F1B's (p-1)/(m+p-1) for large m."""
    zb = build_table("zb-h1", p, m)
    assert weighted_idle(zb, recompute=False) == pytest.approx((p - 1) / (3 * m + p - 1))
    one_f_one_b = build_table("1f1b", p, m)
    assert weighted_idle(one_f_one_b, recompute=False) == pytest.approx((p - 1) / (m + p - 1))
    assert step_units(zb, recompute=False) < step_units(one_f_one_b, recompute=False)


def test_gpipe_never_mixes_forwards_and_backwards_in_a_tick():
    # all forwards, then all backwards: its idle share stays the formula at any job length
    p, m = 4, 8
    table = build_table("gpipe", p, m)
    assert weighted_idle(table, recompute=True) == pytest.approx((p - 1) / (m + p - 1))


def test_show_prints_every_schedules_formula_beside_the_engines_idle(capsys):
    """The published formulas, written here, beside the walk at p=4, m=8."""
    from jaxtron.pipeline import show

    p, m = 4, 8
    assert show.main(["--stages", str(p), "--microbatches", str(m)]) == 0
    out = capsys.readouterr().out
    rows = {" ".join(line.split()[:-4]): [float(x) for x in line.split()[-4:]]
            for line in out.split("formula    engine\n")[1].splitlines()}
    formulas = {"gpipe": (3 / 11, 3 / 11), "1f1b": (3 / 11, 3 / 11),
                "interleaved v=2": (3 / 19, 3 / 19), "zb-h1": (3 / 19, 3 / 27),
                "zbv": (build_table("zbv", p, m).bubble,) * 2}
    assert set(rows) == set(formulas)
    for name, (formula_r, engine_r, formula_s, engine_s) in rows.items():
        schedule, v = name.split()[0], 2 if "v=" in name else 1
        assert (formula_r, formula_s) == pytest.approx(formulas[name], abs=1e-4)
        assert engine_r == pytest.approx(
            weighted_idle(build_table(schedule, p, m, v, True), True), abs=1e-4)
        assert engine_s == pytest.approx(
            weighted_idle(build_table(schedule, p, m, v, False), False), abs=1e-4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"])
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("m", [8, 16, 32])
def test_the_engine_idles_no_more_than_each_schedules_formula_says(schedule, recompute, p, m):
    """Jobs at their real lengths, ranks meeting only where they trade: at most 0.02 over the
    formula, and for the whole-backward tables within 0.02 of it. The split tables run only
    jobs of one forward each, and their W's (interleaved's and zbv's R's too) leave the
    gradients' path, so they idle less than the formula, which puts the whole backward on it;
    zb-h1 stored and zbv stored are their formulas' own tables."""
    v = 2 if schedule == "interleaved" else 1
    table = build_table(schedule, p, m, v, recompute)
    formula = formula_idle(schedule, p, m, v, recompute)
    idle = weighted_idle(table, recompute)
    assert idle <= formula + 0.02
    if schedule in ("gpipe", "1f1b") or not recompute and schedule != "interleaved":
        assert idle == pytest.approx(formula, abs=0.02)
    if schedule == "zb-h1" and recompute:
        assert idle == pytest.approx(formula, abs=0.02)


def megatrons_interleaved_table(p: int, m: int, v: int, split: bool = False,
                                recompute: bool = False):
    """Interleaved 1F1B with Megatron-LM's warm-up, 2(p-d-1) + (v-1)p chunk forwards on rank d
    (its `get_forward_backward_func`), placed as the engine places any order; `split`: each
    backward as B then W, with an R before B when `recompute`."""
    groups = range(0, m, p)
    forwards = [Action(FORWARD, mb, c) for g in groups for c in range(v)
                for mb in range(g, g + p)]
    kinds = ([RECOMPUTE] if recompute else []) + [INPUT_GRAD, WEIGHT_GRAD] if split else [BACKWARD]
    backwards = [[Action(kind, mb, c) for kind in kinds]
                 for g in groups for c in reversed(range(v)) for mb in range(g, g + p)]
    orders = []
    for d in range(p):
        warmup = min(2 * (p - d - 1) + (v - 1) * p, m * v)
        order = forwards[:warmup]
        for i, forward in enumerate(forwards[warmup:]):
            order += [forward, *backwards[i]]
        orders.append(order + [a for jobs in backwards[len(forwards) - warmup:] for a in jobs])
    return place("interleaved", orders, p, m, v)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("m_per_p", [1, 2, 4, 8])
def test_interleaved_warmup_fitted_to_lockstep_idles_less_than_megatrons(p, v, m_per_p):
    """Against Megatron's warm-up and whole backwards: the same activation slots, at most
    p/2 + 1 more gradient buffers (a stage input's size each, beside about p * v activation
    slots), and never more idle with jobs at their lengths; nor more than Megatron's warm-up
    with the same R, B and W jobs."""
    m = p * m_per_p
    megatrons = megatrons_interleaved_table(p, m, v)
    for recompute in (True, False):
        ours = build_table("interleaved", p, m, v, recompute)
        assert ours.act_slots == megatrons.act_slots
        assert ours.grad_slots <= megatrons.grad_slots + p // 2 + 1
        assert weighted_idle(ours, recompute) <= weighted_idle(megatrons, recompute) + 1e-12
        same_jobs = megatrons_interleaved_table(p, m, v, split=True, recompute=recompute)
        assert weighted_idle(ours, recompute) <= weighted_idle(same_jobs, recompute) + 1e-12
