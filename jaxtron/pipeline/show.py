"""Print a pipeline schedule's timeline and bubble.

    python -m jaxtron.pipeline.show --stages 4 --microbatches 8 --schedule 1f1b
    python -m jaxtron.pipeline.show --stages 4 --microbatches 8 --schedule interleaved --virtual 2

Each row is a pipeline rank, each column a tick (one forward or one backward of one
microbatch chunk): `F3` / `B3` run microbatch 3 (`F3.1`: chunk 1), `.` is idle.
"""

from __future__ import annotations

import argparse
import sys

from jaxtron.pipeline.schedule import SCHEDULES, build_table, render


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.pipeline.show",
                                     description="Show a pipeline schedule and its bubble.")
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--virtual", type=int, default=1, help="chunks per rank (interleaved)")
    args = parser.parse_args(argv)
    p, m, v = args.stages, args.microbatches, args.virtual
    if args.schedule == "interleaved" and (v < 2 or m % p):
        parser.error("interleaved needs --virtual >= 2 and --microbatches a multiple of --stages")
    if args.schedule != "interleaved" and v != 1:
        parser.error("--virtual > 1 needs --schedule interleaved")
    table = build_table(args.schedule, p, m, v)
    print(render(table))
    formula = (p - 1) / (v * m + p - 1)
    print(f"{args.schedule}: {p} stages, {m} microbatches, {v} chunk(s) per rank: "
          f"{table.ticks} ticks, bubble {table.bubble:.4f} "
          f"(formula (p-1)/(v*m+p-1) = {formula:.4f}); activations held per rank at most "
          f"{table.act_slots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
