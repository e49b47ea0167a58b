"""Run a job under the supervisor's state machine (`machine.py`): start its processes, poll
them, and carry out what the machine decides (stop, restart after a back-off, shrink, grow),
writing each event into the run folder (`records.py`)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Protocol

from jaxtron.checkpoint.manager import checkpoint_dir, saved_steps
from jaxtron.errors import JaxtronError
from jaxtron.runtime.run_dir import last_logged_step
from jaxtron.supervisor.local_job import stop
from jaxtron.supervisor.machine import (
    USER_ERROR,
    Finish,
    GiveUp,
    Grow,
    Phase,
    Poll,
    Restart,
    Supervision,
    UserError,
)
from jaxtron.supervisor.records import productive_seconds, record, summarise


class LaunchFailed(JaxtronError):
    """The job kept failing: restarts exhausted."""


class LaunchBusy(JaxtronError):
    """Another supervisor's processes run in this folder."""


class Job(Protocol):
    def start(self, restart: bool) -> list[subprocess.Popen]: ...


def supervise(job: Job, run_dir: Path, supervision: Supervision, *, poll_s: float = 0.2,
              tokens_per_step: int = 0, log_every: int = 1) -> int:
    """Run `job` until it succeeds; -> 0, or the user-error status. LaunchFailed when the
    restarts are exhausted. A job that can shrink and grow has `shrink(culprit)` and
    `grow()`; one whose processes srun starts names culprits with `blame(rank)`."""
    _check_not_supervised(run_dir)
    launched = time.monotonic()
    restarted = False
    while True:
        children = _start(job, run_dir, supervision, restarted)
        _watch(children, run_dir, supervision, poll_s)
        stop(children)
        if supervision.phase is Phase.FINISHED:
            outcome = Finish()
        else:
            outcome = supervision.after_job(_newest_checkpoint(run_dir),
                                            last_logged_step(run_dir), time.monotonic())
        if isinstance(outcome, Finish):
            summarise(run_dir, supervision.restarts, supervision.lost_total,
                      time.monotonic() - launched,
                      productive_seconds(run_dir, tokens_per_step, log_every))
            return 0
        if isinstance(outcome, Grow):
            record(run_dir, supervision.restarts, job.grow())
        elif isinstance(outcome, UserError):
            print(f"launch: {outcome.reason} (a bad input, not retried); see its error above",
                  flush=True)
            return USER_ERROR
        elif isinstance(outcome, GiveUp):
            raise LaunchFailed(
                f"the job failed again ({outcome.reason}) after {outcome.restarts} restart(s), "
                f"the most --max-restarts allows; the checkpoints in {checkpoint_dir(run_dir)} "
                "are kept: fix the cause and run the same command to resume.")
        else:
            _restart(job, run_dir, supervision, outcome)
        restarted = True


def _check_not_supervised(run_dir: Path) -> None:
    """One supervisor per run folder: another one's live processes (processes.json) stop this
    one before it starts anything or writes there."""
    listed = run_dir / "processes.json"
    try:
        pids = json.loads(listed.read_text()) if listed.is_file() else []
    except ValueError:
        pids = []
    alive = [pid for pid in pids if isinstance(pid, int) and _runs_jaxtron(pid)]
    if alive:
        raise LaunchBusy(f"train.run_dir={run_dir} is in use by another launch (processes "
                         f"{', '.join(map(str, alive))} still run); wait for it to finish or "
                         "stop it, or choose another train.run_dir.")


def _runs_jaxtron(pid: int) -> bool:
    try:
        return b"jaxtron" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _start(job: Job, run_dir: Path, supervision: Supervision, restarted: bool):
    children = job.start(restarted)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "processes.json").write_text(json.dumps([c.pid for c in children]))
    supervision.job_started(time.monotonic(), _newest_checkpoint(run_dir),
                            last_logged_step(run_dir))
    return children


def _watch(children, run_dir: Path, supervision: Supervision, poll_s: float) -> None:
    """Poll until the machine says the job has ended (or finished)."""
    while supervision.live:
        time.sleep(poll_s)
        result = supervision.poll(Poll(tuple(c.poll() for c in children),
                                       last_logged_step(run_dir), time.monotonic()))
        if result.stop_to_grow:  # each process saves the step they agree on, and exits 0
            for child in children:
                child.send_signal(signal.SIGTERM)
        if result.recovered_s is not None:
            record(run_dir, supervision.restarts, "recovered", recovery_s=result.recovered_s)


def _restart(job: Job, run_dir: Path, supervision: Supervision, restart: Restart) -> None:
    record(run_dir, restart.restart, restart.reason, lost_steps=restart.lost_steps,
           resume_from=restart.resume_from)
    shrink = getattr(job, "shrink", None)
    if restart.shrink is not None and shrink is not None:
        change = shrink(restart.shrink)
        if change:
            record(run_dir, restart.restart, change)
            supervision.shrunk(time.monotonic())
    time.sleep(restart.backoff_s)


def _newest_checkpoint(run_dir: Path) -> int:
    return max(saved_steps(checkpoint_dir(run_dir)), default=0)
