"""What a run leaves behind for people to look at: a profiler trace and the loss curve.

`train.profile_steps: [first, last]` records a JAX profiler trace of those steps into
`<run_dir>/profile` (open it with TensorBoard's profile plugin or Perfetto, ui.perfetto.dev);
the first steps are compile-dominated, so pick a window after warm-up. At the end of a run
`<run_dir>/loss.png` plots the training loss and, where evaluated, the held-out loss.
"""

from __future__ import annotations

from pathlib import Path

import jax

from jaxtron.runtime.run_dir import metric_rows


class StepProfiler:
    """Starts a trace before step `first` runs and stops it once step `last` has finished."""

    def __init__(self, run_dir: Path, window: tuple[int, int] | None, enabled: bool = True):
        self.folder = run_dir / "profile"
        self.first, self.last = window or (0, -1)
        self.enabled = enabled and window is not None
        self.active = False

    def before(self, step: int) -> None:
        if self.enabled and step == self.first:
            jax.profiler.start_trace(str(self.folder))
            self.active = True

    def after(self, step: int, outputs) -> None:
        if self.active and step >= self.last:
            jax.block_until_ready(outputs)  # the last step's work belongs in the trace
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def plot_loss_curve(run_dir: Path) -> Path | None:
    """Write <run_dir>/loss.png from metrics.jsonl; None when nothing was logged. Drawn on a
    figure of its own, without pyplot: no display (clusters have none) and no global figure
    state to close."""
    from matplotlib.figure import Figure

    records = metric_rows(run_dir)
    if not records:
        return None
    evals = [r for r in records if "eval_loss" in r]
    figure = Figure(figsize=(6, 4), dpi=100, layout="tight")
    axes = figure.add_subplot()
    axes.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    if evals:
        axes.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-",
                  label="eval loss")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats/token)")
    axes.grid(alpha=0.3)
    axes.legend()
    out = run_dir / "loss.png"
    figure.savefig(out)
    return out
