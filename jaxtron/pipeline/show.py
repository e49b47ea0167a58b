"""Print a pipeline schedule's timeline and bubble.

    python -m jaxtron.pipeline.show --stages 4 --microbatches 8 --schedule 1f1b
    python -m jaxtron.pipeline.show --stages 4 --microbatches 8 --schedule interleaved --virtual 2
    python -m jaxtron.pipeline.show --stages 4 --microbatches 8 --schedule zb-h1 --stored
    python -m jaxtron.pipeline.show --stages 4 --microbatches 8 --schedule zbv

Each row is a pipeline rank, each column a tick (one job of one microbatch chunk): `F3` / `B3`
run microbatch 3 (`F3.1`: chunk 1), `.` is idle. With the split-backward schedules
(`interleaved`, `zb-h1`, `zbv`) a tick is one F, one B (input gradient) or one W (weight
gradient), and, where the backward recomputes the stage (`pipeline.recompute: true`, the table
shown unless `--stored`), one R (the stage run again before its B); `zbv`'s rows show each
rank's two chunks (`.0` down the V, `.1` back up). Every table shown is first checked by
`jaxtron.pipeline.table_check`. The next line gives the idle share where ranks run side by side
with jobs at their real lengths (`jaxtron.pipeline.timeline`); then every schedule at the same
p and m, its formula's idle share beside its idle in this engine, recomputing and stored.
"""

from __future__ import annotations

import argparse
import sys

from jaxtron.pipeline import table_check, timeline, zero_bubble
from jaxtron.pipeline.schedules import SCHEDULES, build_table, formula_idle
from jaxtron.pipeline.ticks import Table, render


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.pipeline.show",
                                     description="Show a pipeline schedule and its bubble.")
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--schedule", choices=SCHEDULES,
                        default="1f1b")
    parser.add_argument("--virtual", type=int, default=1, help="chunks per rank (interleaved)")
    parser.add_argument("--stored", action="store_true",
                        help="the table of pipeline.recompute=false (backwards read stored "
                             "residuals; no R jobs)")
    args = parser.parse_args(argv)
    p, m, v = args.stages, args.microbatches, args.virtual
    if args.schedule == "interleaved" and (v < 2 or m % p):
        parser.error("interleaved needs --virtual >= 2 and --microbatches a multiple of --stages")
    if args.schedule != "interleaved" and v != 1:
        parser.error("--virtual > 1 needs --schedule interleaved")
    recompute = not args.stored
    table = build_table(args.schedule, p, m, v, recompute)
    checked = table_check.check(table)
    print(render(table))
    print(describe(args.schedule, table, checked))
    mode = ("recomputing (pipeline.recompute=true)" if recompute
            else "from stored residuals (pipeline.recompute=false)")
    print(f"ranks side by side, jobs at their lengths, {mode}: idle "
          f"{timeline.weighted_idle(table, recompute):.4f}; step "
          f"{timeline.step_units(table, recompute):g} forwards of one stage")
    print(side_by_side(p, m, v if v > 1 else 2))
    return 0


def describe(schedule: str, table: Table, checked: table_check.Check) -> str:
    """The table's size, bubble and memory, beside its formula."""
    p, m, v = table.stages, table.microbatches, table.virtual
    one_f_one_b = f"1F1B in the same units: (p-1)/(m+p-1) = {formula_idle('1f1b', p, m):.4f}"
    jobs = "F = R = B = W" if table.recomputes else "F = B = W"
    if schedule == "zbv":  # two half-stage chunks per rank: a tick is half a stage's job
        return (f"zbv: {p} stages, {m} microbatches, 2 chunks per rank in a V, {jobs} = one "
                f"tick: {table.ticks} ticks, bubble {table.bubble:.4f} ({one_f_one_b}); chunk "
                f"activations held per rank at most {max(checked.peak_in_flight)} (1F1B: "
                f"{min(p, m)} whole stages = {2 * min(p, m)} chunks)")
    if schedule == "zb-h1":
        return (f"zb-h1: {p} stages, {m} microbatches, {jobs} = one tick: {table.ticks} "
                f"ticks, bubble {table.bubble:.4f} (formula (p-1)/(3m+p-1) = "
                f"{zero_bubble.bubble_formula(p, m):.4f}; {one_f_one_b}); microbatches held "
                f"per rank at most {max(checked.peak_in_flight)} (1F1B: {min(p, m)})")
    split = f", {jobs} = one tick" if table.split else ""
    return (f"{schedule}: {p} stages, {m} microbatches, {v} chunk(s) per rank{split}: "
            f"{table.ticks} ticks, bubble {table.bubble:.4f} (formula (p-1)/(v*m+p-1) = "
            f"{formula_idle(schedule, p, m, v):.4f}); activations held per rank at most "
            f"{table.act_slots}")


def idle_shares(p: int, m: int, v: int) -> list[tuple[str, float, float, float, float]]:
    """(schedule, formula and engine idle recomputing, formula and engine idle stored) of
    every schedule that runs at p stages and m microbatches (interleaved with v chunks)."""
    rows = []
    for schedule in SCHEDULES:
        if schedule == "interleaved" and m % p:
            continue
        virtual = v if schedule == "interleaved" else 1
        shares = []
        for recompute in (True, False):
            table = build_table(schedule, p, m, virtual, recompute)
            shares += [formula_idle(schedule, p, m, virtual, recompute),
                       timeline.weighted_idle(table, recompute)]
        rows.append((schedule if virtual == 1 else f"{schedule} v={virtual}", *shares))
    return rows


def side_by_side(p: int, m: int, v: int) -> str:
    """Every schedule's formula idle next to its idle in this engine, where a rank waits at
    a tick's end for the ranks it trades with then (`timeline.py`)."""
    lines = [f"every schedule at {p} stages, {m} microbatches: idle share by its formula "
             "(ranks asynchronous) and in this engine (jobs at their lengths, each tick's "
             "senders and receivers meeting at its end)",
             f"  {'':<16}{'recomputing':>20}{'stored':>20}",
             f"  {'schedule':<16}{'formula':>10}{'engine':>10}{'formula':>10}{'engine':>10}"]
    for name, *shares in idle_shares(p, m, v):
        lines.append(f"  {name:<16}" + "".join(f"{share:>10.4f}" for share in shares))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
