"""A tick table's length where ranks run side by side, jobs at their real lengths
(`jaxtron/pipeline/timeline.py`): hand-walked tables, the unit-tick limit, and the paper's
ZB-H1 bubble where its B and W each take one forward. Plain numpy, no devices."""

import pytest

from jaxtron.pipeline.schedules import build_table
from jaxtron.pipeline.timeline import step_units, weighted_idle, work_units


def test_one_microbatch_over_two_stages_walked_by_hand():
    # F0 on rank 0, F0 on rank 1, its backward on rank 1, then on rank 0: nothing overlaps.
    table = build_table("1f1b", 2, 1)
    assert step_units(table, recompute=True) == 1 + 1 + 3 + 3
    assert step_units(table, recompute=False) == 1 + 1 + 2 + 2
    assert work_units(table, recompute=True) == 4


def test_a_backward_stalls_the_neighbour_that_ran_a_forward():
    # 1F1B, p=2, m=2: rank 0's B0 (two forwards' work without recomputation) shares a tick
    # with rank 1's F1 (one), and rank 1 waits for it at the exchange. With two ranks each is
    # the other's neighbour both ways, so a tick starts when both have finished the last.
    table = build_table("1f1b", 2, 2)
    finish = [0.0, 0.0]
    lengths = {"F": 1, "B": 2, ".": 0}
    for t in range(table.ticks):
        start = max(finish)  # two ranks: each is the other's neighbour both ways
        cells = [("F" if k == 1 else "B" if k == 2 else ".") for k in table.kind[t]]
        finish = [start + lengths[c] for c in cells]
    assert step_units(table, recompute=False) == max(finish)
    assert step_units(table, recompute=False) > table.ticks  # some ticks last two units


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_zb_h1_without_recompute_has_the_papers_bubble(p, m):
    """B and W one forward each: every job one tick, so the idle share is the table's,
    (p-1)/(3m+p-1) (Qi et al.); 1F1B's backwards make its own ticks uneven and it idles
    more than its (p-1)/(m+p-1)."""
    zb = build_table("zb-h1", p, m)
    assert weighted_idle(zb, recompute=False) == pytest.approx((p - 1) / (3 * m + p - 1))
    one_f_one_b = build_table("1f1b", p, m)
    assert weighted_idle(one_f_one_b, recompute=False) > (p - 1) / (m + p - 1)
    assert step_units(zb, recompute=False) < step_units(one_f_one_b, recompute=False)


def test_gpipe_never_mixes_forwards_and_backwards_in_a_tick():
    # all forwards, then all backwards: its idle share stays the formula at any job length
    p, m = 4, 8
    table = build_table("gpipe", p, m)
    assert weighted_idle(table, recompute=True) == pytest.approx((p - 1) / (m + p - 1))


def test_show_prints_every_schedules_formula_beside_its_lockstep_idle(capsys):
    """The published formulas, written here, beside the walk: 1F1B loses 0.448 - 0.273 of the
    step to lockstep at p=4, m=8; GPipe and stored zb-h1 keep their formulas."""
    from jaxtron.pipeline import show

    p, m = 4, 8
    assert show.main(["--stages", str(p), "--microbatches", str(m)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0] + (" " + line.split()[1] if "v=" in line else ""):
            [float(x) for x in line.split()[-4:]]
            for line in out.split("lockstep stored\n")[1].splitlines()}
    formulas = {"gpipe": 3 / 11, "1f1b": 3 / 11, "interleaved v=2": 3 / 19, "zb-h1": 3 / 27,
                "zbv": build_table("zbv", p, m).bubble}
    assert set(rows) == set(formulas)
    for name, (formula, bubble, recomputing, stored) in rows.items():
        table = build_table(name.split()[0], p, m, 2 if "v=" in name else 1)
        assert formula == pytest.approx(formulas[name], abs=1e-4)
        assert bubble == pytest.approx(table.bubble, abs=1e-4)
        assert recomputing == pytest.approx(weighted_idle(table, True), abs=1e-4)
        assert stored == pytest.approx(weighted_idle(table, False), abs=1e-4)
    assert rows["1f1b"][2] == pytest.approx(0.4483, abs=1e-4)
    assert rows["gpipe"][2] == pytest.approx(rows["gpipe"][0])
    assert rows["zb-h1"][3] == pytest.approx(rows["zb-h1"][0])
