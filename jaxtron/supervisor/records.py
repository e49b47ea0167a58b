"""What the supervisor writes into the run folder: one line per restart (`restarts.jsonl`) and
the job's goodput at the end (`launch.json`), each also printed."""

from __future__ import annotations

import json
from pathlib import Path

from jaxtron.runtime.run_dir import metric_rows


def productive_seconds(run_dir: Path, tokens_per_step: int, log_every: int) -> float:
    """Time the run's final steps took: each step's last logged window (a step logged again
    after a restart replaces the earlier record), `log_every` steps at its tokens/s."""
    windows = {row["step"]: row["tokens_per_s"] for row in metric_rows(run_dir)
               if row.get("tokens_per_s")}
    return sum(min(log_every, step) * tokens_per_step / rate for step, rate in windows.items())


def record(run_dir: Path, restart: int, event: str, **fields) -> None:
    entry = {"restart": restart, "event": event, **fields}
    with open(run_dir / "restarts.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    details = ", ".join(f"{k} {v}" for k, v in fields.items())
    print(f"launch: restart {restart}: {event}" + (f" ({details})" if details else ""),
          flush=True)


def summarise(run_dir: Path, restarts: int, lost: int, wall_s: float,
              productive_s: float) -> None:
    """Google's ML goodput: the time the final steps took over the wall time since the launch,
    so compiling, evaluating, saving, restarting and steps computed twice all count against it."""
    goodput = productive_s / wall_s if wall_s > 0 else 0.0
    summary = {"restarts": restarts, "lost_steps": lost, "wall_s": round(wall_s, 1),
               "productive_s": round(productive_s, 1), "goodput": round(goodput, 4)}
    (run_dir / "launch.json").write_text(json.dumps(summary, indent=1))
    print(f"launch: done after {restarts} restart(s), {lost} step(s) computed again; goodput "
          f"{goodput:.1%} ({productive_s:.1f} s of steps in {wall_s:.1f} s)", flush=True)
