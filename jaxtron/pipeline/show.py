"""Print a pipeline schedule's timeline and bubble.

    python -m jaxtron.pipeline.show --stages 4 --microbatches 8 --schedule 1f1b
    python -m jaxtron.pipeline.show --stages 4 --microbatches 8 --schedule interleaved --virtual 2
    python -m jaxtron.pipeline.show --stages 4 --microbatches 8 --schedule zb-h1
    python -m jaxtron.pipeline.show --stages 4 --microbatches 8 --schedule zbv

Each row is a pipeline rank, each column a tick (one forward or one backward of one
microbatch chunk): `F3` / `B3` run microbatch 3 (`F3.1`: chunk 1), `.` is idle. With the
split-backward schedules `zb-h1` and `zbv` a tick is one F, one B (input gradient) or one W
(weight gradient); `zbv`'s rows show each rank's two chunks (`.0` down the V, `.1` back up).
Every table shown is first checked by `jaxtron.pipeline.table_check`. The last line gives the
idle share where ranks run side by side with jobs at their real lengths
(`jaxtron.pipeline.timeline`), with the backward recomputing the stage and without; then every
schedule at the same p and m, its formula's idle share beside its idle in this engine.
"""

from __future__ import annotations

import argparse
import sys

from jaxtron.pipeline import table_check, timeline, zero_bubble
from jaxtron.pipeline.schedules import SCHEDULES, SPLIT_SCHEDULES, build_table, formula_idle
from jaxtron.pipeline.ticks import Table, render


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.pipeline.show",
                                     description="Show a pipeline schedule and its bubble.")
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--schedule", choices=SCHEDULES,
                        default="1f1b")
    parser.add_argument("--virtual", type=int, default=1, help="chunks per rank (interleaved)")
    args = parser.parse_args(argv)
    p, m, v = args.stages, args.microbatches, args.virtual
    if args.schedule == "interleaved" and (v < 2 or m % p):
        parser.error("interleaved needs --virtual >= 2 and --microbatches a multiple of --stages")
    if args.schedule != "interleaved" and v != 1:
        parser.error("--virtual > 1 needs --schedule interleaved")
    if args.schedule in SPLIT_SCHEDULES:
        table = show_split(args.schedule, p, m)
    else:
        table = show_table(args.schedule, p, m, v)
    print(f"ranks side by side, jobs at their lengths: idle "
          f"{timeline.weighted_idle(table, recompute=True):.4f} recomputing "
          f"(pipeline.recompute=true), {timeline.weighted_idle(table, recompute=False):.4f} "
          f"from stored residuals; step {timeline.step_units(table, True):g} and "
          f"{timeline.step_units(table, False):g} forwards of one stage")
    print(side_by_side(p, m, v if v > 1 else 2))
    return 0


def idle_shares(p: int, m: int, v: int) -> list[tuple[str, float, float, float, float]]:
    """(schedule, formula and engine idle recomputing, formula and engine idle stored) of
    every schedule that runs at p stages and m microbatches (interleaved with v chunks)."""
    rows = []
    for schedule in SCHEDULES:
        if schedule == "interleaved" and m % p:
            continue
        virtual = v if schedule == "interleaved" else 1
        table = build_table(schedule, p, m, virtual)
        rows.append((schedule if virtual == 1 else f"{schedule} v={virtual}",
                     formula_idle(schedule, p, m, virtual, recompute=True),
                     timeline.weighted_idle(table, recompute=True),
                     formula_idle(schedule, p, m, virtual, recompute=False),
                     timeline.weighted_idle(table, recompute=False)))
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


def show_table(schedule: str, p: int, m: int, v: int) -> Table:
    table = build_table(schedule, p, m, v)
    table_check.check(table)
    print(render(table))
    formula = (p - 1) / (v * m + p - 1)
    print(f"{schedule}: {p} stages, {m} microbatches, {v} chunk(s) per rank: "
          f"{table.ticks} ticks, bubble {table.bubble:.4f} "
          f"(formula (p-1)/(v*m+p-1) = {formula:.4f}); activations held per rank at most "
          f"{table.act_slots}")
    return table


def show_split(schedule: str, p: int, m: int) -> Table:
    table = build_table(schedule, p, m)
    checked = table_check.check(table)
    print(render(table))
    one_f_one_b = f"1F1B in the same units: (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.4f}"
    if schedule == "zbv":  # two half-stage chunks per rank: a tick is half a stage's job
        print(f"zbv: {p} stages, {m} microbatches, 2 chunks per rank in a V, F = B = W = one "
              f"tick: {table.ticks} ticks, bubble {table.bubble:.4f} ({one_f_one_b}); chunk "
              f"activations held per rank at most {max(checked.peak_in_flight)} (1F1B: "
              f"{min(p, m)} whole stages = {2 * min(p, m)} chunks)")
        return table
    print(f"{schedule}: {p} stages, {m} microbatches, F = B = W = one tick: {table.ticks} "
          f"ticks, bubble {table.bubble:.4f} (formula (p-1)/(3m+p-1) = "
          f"{zero_bubble.bubble_formula(p, m):.4f}; {one_f_one_b}); microbatches held per "
          f"rank at most {max(checked.peak_in_flight)} (1F1B: {min(p, m)})")
    return table


if __name__ == "__main__":
    sys.exit(main())
