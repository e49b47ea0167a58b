"""The planner's fastest layout for Llama 3 8B at long sequence lengths on H100s, overall and
for each form of context parallelism: the table of docs/long-context.md ("-": no layout of that form fits).

    python scripts/long_context_table.py                 # 32K / 128K / 1M on 8, 64, 512
    python scripts/long_context_table.py --lengths 32768 --devices 8

Each sequence length keeps about 16M tokens a step (train.batch_size = 2^24 / length, at
least the device count's share the planner needs); nothing is compiled.
"""

from __future__ import annotations

import argparse

from jaxtron.config.loading import load_config
from jaxtron.planner.hardware import HARDWARE
from jaxtron.planner.search import is_legal, plan

MODES = ("none", "ring", "all_to_all", "hybrid")


def fastest_by_mode(length: int, devices: int, config_path: str = "configs/llama3-8b.yaml"):
    """{mode: best candidate or None} for one cell: `none` is the fastest without context
    parallelism."""
    batch = max(2**24 // length, 1)
    config = load_config(config_path, [f"data.seq_len={length}",
                                       f"model.max_seq_len={length}",
                                       f"train.batch_size={batch}", "optim.grad_accum=1"])
    hardware = HARDWARE["h100"]
    ranked = plan(config, devices, hardware, hardware.memory_bytes)
    best = {}
    for candidate in ranked.fitting:  # fastest first
        layout = candidate.layout
        mode = "none" if layout.sequence == 1 else layout.context_parallel
        if mode not in best and is_legal(config, layout):
            best[mode] = candidate
            if len(best) == len(MODES):
                break
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 1048576])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--config", default="configs/llama3-8b.yaml")
    args = parser.parse_args(argv)
    print("| tokens | H100s | " + " | ".join(MODES) + " |")
    print("|---|---|" + "---|" * len(MODES))
    for length in args.lengths:
        for devices in args.devices:
            best = fastest_by_mode(length, devices, args.config)
            cells = [f"{best[m].cost.mfu:.0%} `{best[m].layout.describe()}`" if m in best
                     else "-" for m in MODES]
            print(f"| {length // 1024}K | {devices} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
