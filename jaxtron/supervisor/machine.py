"""The supervisor's decisions as a state machine: what a poll of a running job means, and what
to do once the job has ended. Nothing here starts, signals or waits for a process
(`supervise.py` does), so every transition is tested with plain values.

    RUNNING ──poll: a process failed / every process exited / no step for stall_timeout_s──▶ ENDED
    RUNNING ──poll: shrunk, running steps again for grow_after_s──▶ STOPPING_TO_GROW
    STOPPING_TO_GROW ──poll: the processes exited (they saved a step)──▶ ENDED
    ENDED ──after_job──▶ Finish | UserError | GiveUp | Grow | Restart (maybe Shrink first)
    (Grow and Restart start the job again: RUNNING)

A failure is blamed on one process (a process killed by a signal before one that exited with an
error: the others usually exit because a peer vanished), or on the node srun names for it
(`blame`). The same culprit `drop_after` times in a row is dropped (`Restart.shrink`); a job
shrunk that way is stopped `grow_after_s` after it runs steps again, and started whole.
"""

from __future__ import annotations

import dataclasses
import enum
import signal
from typing import Callable

USER_ERROR = 2  # the status a JaxtronError ends a command with: not worth retrying


class Phase(enum.Enum):
    RUNNING = "running"
    STOPPING_TO_GROW = "stopping to grow"
    ENDED = "ended"  # the processes are gone: `after_job` decides what follows
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class Poll:
    """What one look at the job shows: each process's exit status (None: running), the newest
    step in metrics.jsonl, and the clock (seconds)."""
    statuses: tuple[int | None, ...]
    logged_step: int
    now: float


@dataclasses.dataclass(frozen=True)
class PollResult:
    stop_to_grow: bool = False  # send every process SIGTERM: each saves one step and exits
    recovered_s: float | None = None  # a restarted job ran its first new step this long after


@dataclasses.dataclass(frozen=True)
class Finish:
    """The job is done: every process exited 0 with the target step logged or saved."""


@dataclasses.dataclass(frozen=True)
class UserError:
    """A bad input (status 2): it would fail the same way again."""
    reason: str


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """Restarts are exhausted."""
    reason: str
    restarts: int


@dataclasses.dataclass(frozen=True)
class Grow:
    """A planned stop of a shrunk job is done: start it again on every process."""


@dataclasses.dataclass(frozen=True)
class Restart:
    """Start the job again after `backoff_s`, resuming from `resume_from`; with `shrink` set,
    without that process (or node) first, if the job can shrink."""
    restart: int
    reason: str
    lost_steps: int
    resume_from: int
    backoff_s: float
    shrink: int | str | None = None


def describe_exit(rank: int, status: int) -> str:
    if status < 0:
        return f"process {rank} was killed by {signal.Signals(-status).name}"
    return f"process {rank} exited with status {status}"


def backoff_s(restart: int) -> float:
    """1, 2, 4, ... seconds before restart n, at most 30."""
    return min(2 ** (restart - 1), 30)


class Supervision:
    """The state of a supervised job across its restarts (see the module docstring)."""

    def __init__(self, max_restarts: int, stall_timeout_s: float, *,
                 target_steps: int | None = None, drop_after: int = 2,
                 grow_after_s: float | None = None,
                 blame: Callable[[int], int | str | None] = lambda rank: rank):
        self.max_restarts, self.stall_timeout_s = max_restarts, stall_timeout_s
        self.target_steps, self.drop_after = target_steps, drop_after
        self.grow_after_s, self.blame = grow_after_s, blame
        self.phase = Phase.ENDED
        self.restarts = self.lost_total = 0
        self.failed_at: float | None = None  # when the newest failure was noticed
        self.cause: int | str | None = None  # who caused the failures in a row
        self.in_a_row = 0
        self.shrunk_at: float | None = None  # when the job last went on without a culprit
        self.reason: str | None = None  # why the current job ended
        self.status: int | None = None  # its deciding exit status (None: a stall)
        self.growing = False  # the current job was asked to stop so that it can grow

    def job_started(self, now: float, resume_from: int, logged_step: int) -> None:
        self.phase, self.reason, self.status, self.growing = Phase.RUNNING, None, None, False
        self.resume_from = resume_from
        self.seen_step, self.seen_at = logged_step, now

    def poll(self, p: Poll) -> PollResult:
        """One look at the running job: it may end (`phase`), be asked to stop and grow, or
        show its first step after a restart."""
        self._read_exits(p)
        stop_to_grow = (self.phase is Phase.RUNNING and self.grow_after_s is not None
                        and self.shrunk_at is not None and self.failed_at is None
                        and p.now - self.shrunk_at >= self.grow_after_s)
        if stop_to_grow:
            self.phase, self.growing = Phase.STOPPING_TO_GROW, True
        recovered = None
        if p.logged_step != self.seen_step:
            self.seen_step, self.seen_at = p.logged_step, p.now
            if self.failed_at is not None and p.logged_step > self.resume_from:
                recovered, self.failed_at = round(p.now - self.failed_at, 1), None
                if self.shrunk_at is not None:  # the wait to grow back starts now
                    self.shrunk_at = p.now
        elif self.live and p.now - self.seen_at > self.stall_timeout_s:
            self._end(f"no step logged for {self.stall_timeout_s:.0f} s", None)
        return PollResult(stop_to_grow, recovered)

    @property
    def live(self) -> bool:
        return self.phase in (Phase.RUNNING, Phase.STOPPING_TO_GROW)

    def _read_exits(self, p: Poll) -> None:
        failed = sorted((s > 0, rank, s) for rank, s in enumerate(p.statuses)
                        if s not in (None, 0))
        if failed:  # a process killed by a signal first: the likelier cause
            _, rank, status = failed[0]
            who = self.blame(rank)
            reason = describe_exit(rank, status)
            if who != rank and who is not None:
                reason += f" (srun: a task failed on {who})"
            self.cause, self.in_a_row = who, self.in_a_row + 1 if who == self.cause else 1
            self._end(reason, status)
        elif all(s == 0 for s in p.statuses):
            if self.target_steps is None or p.logged_step >= self.target_steps:
                self.phase = Phase.FINISHED
            else:
                self._end(f"the job stopped at step {p.logged_step} of {self.target_steps}", 0)

    def _end(self, reason: str, status: int | None) -> None:
        self.phase, self.reason, self.status = Phase.ENDED, reason, status

    def after_job(self, newest_checkpoint: int, logged_step: int, now: float):
        """What follows a job that ended: Finish, Grow, UserError, GiveUp or Restart."""
        if self.target_steps is not None and newest_checkpoint >= self.target_steps:
            return Finish()  # it ended as it finished
        if self.growing and self.status == 0:  # a planned stop: no failure, no back-off
            self.shrunk_at = None
            return Grow()
        if self.status == USER_ERROR:
            return UserError(self.reason)
        if self.restarts >= self.max_restarts:
            return GiveUp(self.reason, self.restarts)
        self.restarts += 1
        self.failed_at = now
        lost = max(logged_step - newest_checkpoint, 0)
        self.lost_total += lost
        drop = self.cause if self.cause is not None and self.in_a_row >= self.drop_after else None
        return Restart(self.restarts, self.reason, lost, newest_checkpoint,
                       backoff_s(self.restarts), drop)

    def shrunk(self, now: float) -> None:
        """The job dropped its culprit: count failures afresh, and wait to grow back."""
        self.cause, self.in_a_row, self.shrunk_at = None, 0, now
