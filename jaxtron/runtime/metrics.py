"""What training reports: metrics.jsonl rows, TensorBoard scalars and progress lines.

`Reporter` turns a finished step's device metrics into a row (waiting for that step only when
the row is written, one step late, so dispatch stays ahead of the device) with throughput
measured between logged steps, evaluation time excluded.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
from tqdm import tqdm

from jaxtron.runtime.run_dir import keep_metrics_through


class MetricsLog:
    """Appends one JSON object per logged step to metrics.jsonl (and TensorBoard scalars with
    `tensorboard=True`) and prints a progress line; on a terminal a tqdm bar also advances every
    step and shows the latest loss, tok/s and MFU."""

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool = True, start: int = 0,
                 tensorboard: bool = False):
        """Rows of steps after `start` (a resumed run's checkpoint; 0 for a new run) are
        dropped first: those steps run again, and each step keeps one row."""
        self.path = run_dir / "metrics.jsonl"
        self.total = total_steps
        self.enabled = enabled
        if enabled:
            keep_metrics_through(run_dir, start)
        self.events = None
        if enabled and tensorboard:
            from tensorboardX import SummaryWriter
            self.events = SummaryWriter(str(run_dir / "tensorboard"))
        self.bar = tqdm(total=total_steps, initial=start, unit="step", dynamic_ncols=True,
                        disable=not (enabled and sys.stderr.isatty()), leave=False)

    def advance(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self.events is not None:
            self.events.close()

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.events is not None:
            for key, value in record.items():
                if key != "step":
                    tag = (f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_loss")
                           else f"train/{key}")
                    self.events.add_scalar(tag, value, record["step"])
            self.events.flush()
        line = (f"step {record['step']:>{len(str(self.total))}}/{self.total} | "
                f"loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"grad_norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
                f"mfu {100 * record['mfu']:.2f}%")
        if "moe_dropped" in record:
            line += (f" | moe balance {record['moe_balance']:.3f} max_load "
                     f"{record['moe_max_load']:.2f} dropped {100 * record['moe_dropped']:.1f}%")
        if "mtp_loss" in record:
            line += f" | mtp_loss {record['mtp_loss']:.4f}"
        if "eval_loss" in record:
            line += f" | eval_loss {record['eval_loss']:.4f}"
            per_source = [f"{key.removeprefix('eval_loss/')} {value:.4f}"
                          for key, value in record.items() if key.startswith("eval_loss/")]
            if per_source:
                line += f" ({', '.join(per_source)})"
        if self.bar.disable:
            print(line, flush=True)
            return
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                             mfu=f"{100 * record['mfu']:.1f}%", refresh=False)
        self.bar.write(line)


class Reporter:
    """Holds the one step waiting to be reported and the throughput clock."""

    def __init__(self, log: MetricsLog, start: int, flops_per_step: float,
                 tokens_per_step: int, peak: float):
        self.log, self.flops, self.tokens, self.peak = log, flops_per_step, tokens_per_step, peak
        self.pending = None
        self.last: dict = {}
        self._time, self._step, self._eval_s = time.perf_counter(), start, 0.0
        self._data_wait_s = 0.0

    def add_eval_time(self, seconds: float) -> None:
        self._eval_s += seconds

    def add_data_wait(self, seconds: float) -> None:
        """Time the loop waited for the input pipeline to hand over a batch."""
        self._data_wait_s += seconds

    def hold(self, step: int, metrics, eval_losses: dict | None) -> None:
        """Report `step` later (it is still running on the device). `eval_losses`:
        {"eval_loss": ..., "eval_loss/<source>": ...} where evaluated."""
        self.pending = (step, metrics, eval_losses)

    def flush(self) -> dict | None:
        """Write the held step's row, waiting for it; returns it (None if nothing was held)."""
        if self.pending is None:
            return None
        step, metrics, eval_losses = self.pending
        self.pending = None
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        seconds = max(now - self._time - self._eval_s, 1e-9)
        steps = max(step - self._step, 1)
        steps_per_s = (step - self._step) / seconds
        record = {"step": step, "loss": values["loss"], "lr": values["lr"],
                  "grad_norm": values["grad_norm"], "tokens_per_s": self.tokens * steps_per_s,
                  "mfu": self.flops * steps_per_s / self.peak,
                  "data_wait_s": self._data_wait_s / steps}
        self._time, self._step, self._eval_s, self._data_wait_s = now, step, 0.0, 0.0
        record.update({k: v for k, v in values.items()
                       if k.startswith("moe_") or k == "mtp_loss"})
        record["skipped_updates"] = int(values.get("skipped_updates", 0))
        record.update(eval_losses or {})
        self.log.write(record)
        self.last = record
        return record
