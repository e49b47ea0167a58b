"""Train under a supervisor that restarts the job after a failure, with nobody watching.

    python -m jaxtron.launch --processes 2 --cpu-devices 4 --max-restarts 3 -- \\
        --config configs/tiny.yaml mesh.data=2 mesh.tensor=4

starts `--processes` training processes on this machine (`python -m jaxtron.train` with the
arguments after `--`, joined through JAX's distributed runtime on 127.0.0.1) and watches them.
The job fails when a process exits with an error or is killed, or when no step has been
logged for `--stall-timeout-s` (every process hung). A process that dies or stops (SIGSTOP, a
lost host) is noticed by the others' distributed heartbeats within `--heartbeat-timeout-s`:
they exit with an error, which the supervisor sees. It then kills what is left of the job,
waits a back-off (1, 2, 4, ... s, at most 30), and starts every process again; the processes
resume from the newest good checkpoint in `train.run_dir` (`train.resume: auto`), so the
steps after that checkpoint are computed again and give the same losses. A bad input (status
2: a config, data or checkpoint the run refuses) is not retried: it would fail the same way.

With `--launcher "srun --kill-on-bad-exit=1"` (inside a SLURM allocation) the supervisor
starts that command with the training command as its one child: srun places a process on every
node, SLURM's variables join them (`jaxtron.runtime.distributed`), a failed task ends the step, and
the supervisor restarts the step the same way. A node srun names for a failed task
(`srun: error: <node>: task <n>: ...`) `--drop-after` times in a row is left out of the next
step (`--exclude`, with `--nodes`/`--ntasks` for the processes left; `jaxtron.supervisor.slurm_step`),
under the same rules as a dropped local process below.

With `--min-processes K` a process that caused `--drop-after` failures in a row (a host that
keeps dying) is dropped: the job restarts on fewer processes, down to K (a divisor of the
starting count), with the same global batch: a smaller data-parallel degree and more
accumulated microbatches (`jaxtron.supervisor.elastic`), so the loss curve goes on as before.
`--grow-after-s` later the supervisor stops that job (SIGTERM: every process saves the same
step) and starts all the processes again from that checkpoint; if the lost one fails again, it
is dropped again.

Each restart is one line on stdout and in `<run_dir>/restarts.jsonl`: the reason (which
process, which exit status or signal), `lost_steps` (steps logged after the checkpoint it
resumes from, computed again) and `recovery_s` (from noticing the failure to the first step
logged after the restart). After `--max-restarts` restarts the next failure ends the launch
with one line naming it; the checkpoints stay as they are.

At the end the supervisor prints and writes to `<run_dir>/launch.json` the job's goodput: the
time its final steps took (each logged window's steps at its logged tokens/s) over the wall
time since the launch, so compiling, evaluating, saving, restarting and steps computed twice
all count against it (Google's definition of ML goodput).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from jaxtron.config.loading import load_config
from jaxtron.config.schema import Config
from jaxtron.errors import ConfigError
from jaxtron.checkpoint.manager import checkpoint_dir, saved_steps
from jaxtron.supervisor.elastic import Devices, shrink_within
from jaxtron.errors import JaxtronError, exits_on_user_error
from jaxtron.planner.hardware import HARDWARE
from jaxtron.planner.memory import memory_budget_bytes
from jaxtron.runtime.run_dir import last_logged_step, metric_rows
from jaxtron.supervisor.slurm_step import FailedNodes, step_options

USER_ERROR = 2  # the status a JaxtronError ends a command with: not worth retrying


class LaunchFailed(JaxtronError):
    """The job kept failing: restarts exhausted."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def productive_seconds(run_dir: Path, tokens_per_step: int, log_every: int) -> float:
    """Time the run's final steps took: each step's last logged window (a step logged again
    after a restart replaces the earlier record), `log_every` steps at its tokens/s."""
    windows = {row["step"]: row["tokens_per_s"] for row in metric_rows(run_dir)
               if row.get("tokens_per_s")}
    return sum(min(log_every, step) * tokens_per_step / rate for step, rate in windows.items())


def describe_exit(rank: int, status: int) -> str:
    if status < 0:
        return f"process {rank} was killed by {signal.Signals(-status).name}"
    return f"process {rank} exited with status {status}"


class LocalJob:
    """The job's training processes (on this machine, or srun's step): `start(restart)`
    launches them on a fresh coordinator port (a restart resumes from the run dir's
    checkpoints whatever `train.resume` the job was given); `shrink(culprit)` drops a lost
    process (or srun node) for good, down to `min_processes`, with the overrides that keep the
    global batch (`jaxtron.supervisor.elastic`)."""

    def __init__(self, processes: int, train_args: list[str], config: Config,
                 cpu_devices: int | None, heartbeat_timeout_s: int, min_processes: int,
                 launcher: list[str] | None = None, devices: Devices | None = None):
        self.processes, self.train_args, self.config = processes, train_args, config
        self.devices = devices
        self.launcher = launcher
        self.started_with = processes
        self.cpu_devices, self.heartbeat_timeout_s = cpu_devices, heartbeat_timeout_s
        self.min_processes = min_processes
        self.overrides: list[str] = []
        self.excluded: list[str] = []  # nodes left out of the launcher's steps
        self._step_errors: FailedNodes | None = None

    def blame(self, rank: int) -> int | str | None:
        """Who caused a failure of child `rank`: that process, or under a launcher the node
        srun named (None when it named none)."""
        if not self.launcher:
            return rank
        return self._step_errors.wait() if self._step_errors else None

    def shrink(self, culprit: int | str) -> str | None:
        """Continue without process (or node) `culprit`; None when no fewer processes may
        run."""
        after = self.processes - 1
        while after >= self.min_processes and self.started_with % after:
            after -= 1  # the mesh splits evenly over a divisor of the starting count
        if after < self.min_processes:
            return None
        self.overrides = shrink_within(self.config, self.started_with, after, self.devices)
        self.processes = after
        if self.launcher:
            self.excluded.append(culprit)
        what = f"node {culprit}" if self.launcher else f"process {culprit}"
        return (f"continuing on {after} process(es) without {what}, same global batch: "
                f"{' '.join(self.overrides)}")

    def grow(self) -> str:
        """Back to the processes the job started with (their layout, no overrides)."""
        self.processes, self.overrides, self.excluded = self.started_with, [], []
        return f"growing back to {self.processes} process(es)"

    def start(self, restart: bool) -> list[subprocess.Popen]:
        if self.launcher:  # one child: the launcher starts every process and their settings
            options = step_options(self.excluded, self.processes)
            step = subprocess.Popen([*self.launcher, *options, *self._command(restart)],
                                    stderr=subprocess.PIPE, text=True)
            self._step_errors = FailedNodes(step.stderr)
            return [step]
        processes, cpu_devices = self.processes, self.cpu_devices
        port = free_port()
        children = []
        for rank in range(processes):
            env = dict(os.environ)
            if cpu_devices:
                env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""),
                                             f"--xla_force_host_platform_device_count="
                                             f"{cpu_devices}"]).strip()
            if processes > 1:
                env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                           JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(rank))
            children.append(subprocess.Popen(self._command(restart), env=env))
        return children

    def _command(self, restart: bool) -> list[str]:
        return [sys.executable, "-u", "-m", "jaxtron.train", *self.train_args,
                f"distributed.heartbeat_timeout_s={self.heartbeat_timeout_s}",
                *(["train.resume=auto"] if restart else []), *self.overrides]


def _stop(children: list[subprocess.Popen]) -> None:
    """Kill what is left of a failed job: its state is lost anyway, and a polite stop would
    wait on the dead peer (the checkpoint is the recovery point)."""
    for child in children:
        if child.poll() is None:
            child.kill()
    for child in children:
        child.wait()


def supervise(start, run_dir: Path, max_restarts: int, stall_timeout_s: float,
              poll_s: float = 0.2, tokens_per_step: int = 0, log_every: int = 1,
              shrink=None, drop_after: int = 2, grow=None, grow_after_s: float = 600,
              target_steps: int | None = None, blame=None) -> int:
    """Run the job `start(restart)` starts until it succeeds (every process exits 0, and the
    run has logged `target_steps` when given); restart it after each failure. After
    `drop_after` failures in a row caused by the same process, `shrink(rank)` the job if it
    can, and `grow_after_s` later stop it with SIGTERM (every process saves the same step and
    exits) and `grow()` it back. `blame(rank)` names who caused a failure of child `rank`
    (default: that process). -> 0, or the user-error status; LaunchFailed when restarts
    are exhausted."""
    restarts, failed_at, lost_total, launched = 0, None, 0, time.monotonic()
    cause, in_a_row, shrunk_at = None, 0, None

    def finished() -> int:
        _summarise(run_dir, restarts, lost_total, time.monotonic() - launched,
                   productive_seconds(run_dir, tokens_per_step, log_every))
        return 0

    while True:
        children = start(restarts > 0)
        (run_dir / "processes.json").parent.mkdir(parents=True, exist_ok=True)
        (run_dir / "processes.json").write_text(json.dumps([c.pid for c in children]))
        resumed_from = max(saved_steps(checkpoint_dir(run_dir)), default=0)
        seen_step, seen_at = last_logged_step(run_dir), time.monotonic()
        reason, growing = None, False
        while reason is None:
            time.sleep(poll_s)
            statuses = [c.poll() for c in children]
            # A process killed by a signal is the likelier cause: the others then exit with an
            # error because a peer vanished.
            bad = sorted(((s > 0, rank, s) for rank, s in enumerate(statuses)
                          if s not in (None, 0)))
            if bad:
                _, rank, status = bad[0]
                reason = describe_exit(rank, status)
                who = blame(rank) if blame is not None else rank
                if who != rank and who is not None:
                    reason += f" (srun: a task failed on {who})"
                cause, in_a_row = who, in_a_row + 1 if who == cause else 1
            elif all(s == 0 for s in statuses):
                done = last_logged_step(run_dir)
                if target_steps is None or done >= target_steps:
                    return finished()
                reason, status = f"the job stopped at step {done} of {target_steps}", 0
            # Only a job that runs steps again has its preemption handler in place.
            if (grow is not None and shrunk_at is not None and failed_at is None
                    and not growing and time.monotonic() - shrunk_at >= grow_after_s):
                for child in children:  # each saves the step they agree on, and exits 0
                    child.send_signal(signal.SIGTERM)
                growing = True
            step = last_logged_step(run_dir)
            if step != seen_step:
                seen_step, seen_at = step, time.monotonic()
                if failed_at is not None and step > resumed_from:
                    _record(run_dir, restarts, "recovered", recovery_s=round(
                        time.monotonic() - failed_at, 1))
                    failed_at = None
                    if shrunk_at is not None:  # the wait to grow back starts now
                        shrunk_at = time.monotonic()
            elif reason is None and time.monotonic() - seen_at > stall_timeout_s:
                reason, status = f"no step logged for {stall_timeout_s:.0f} s", None
        _stop(children)
        newest = max(saved_steps(checkpoint_dir(run_dir)), default=0)
        if target_steps is not None and newest >= target_steps:  # ended as it finished
            return finished()
        if growing and status == 0:  # a planned stop: no failure, no back-off
            _record(run_dir, restarts, grow())
            shrunk_at = None
            continue
        if status == USER_ERROR:
            print(f"launch: {reason} (a bad input, not retried); see its error above",
                  flush=True)
            return USER_ERROR
        if restarts >= max_restarts:
            raise LaunchFailed(f"the job failed again ({reason}) after {restarts} restart(s), "
                               f"the most --max-restarts allows; the checkpoints in "
                               f"{checkpoint_dir(run_dir)} are kept: fix the cause and run the "
                               "same command to resume.")
        restarts += 1
        failed_at = time.monotonic()
        lost = max(last_logged_step(run_dir) - newest, 0)
        lost_total += lost
        _record(run_dir, restarts, reason, lost_steps=lost, resume_from=newest)
        if shrink is not None and cause is not None and in_a_row >= drop_after:
            change = shrink(cause)
            if change:
                _record(run_dir, restarts, change)
                cause, in_a_row, shrunk_at = None, 0, time.monotonic()
        time.sleep(min(2 ** (restarts - 1), 30))


def _summarise(run_dir: Path, restarts: int, lost: int, wall_s: float,
               productive_s: float) -> None:
    goodput = productive_s / wall_s if wall_s > 0 else 0.0
    summary = {"restarts": restarts, "lost_steps": lost, "wall_s": round(wall_s, 1),
               "productive_s": round(productive_s, 1), "goodput": round(goodput, 4)}
    (run_dir / "launch.json").write_text(json.dumps(summary, indent=1))
    print(f"launch: done after {restarts} restart(s), {lost} step(s) computed again; goodput "
          f"{goodput:.1%} ({productive_s:.1f} s of steps in {wall_s:.1f} s)", flush=True)


def _record(run_dir: Path, restart: int, event: str, **fields) -> None:
    entry = {"restart": restart, "event": event, **fields}
    with open(run_dir / "restarts.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    details = ", ".join(f"{k} {v}" for k, v in fields.items())
    print(f"launch: restart {restart}: {event}" + (f" ({details})" if details else ""),
          flush=True)


def devices_for_shrinking(args) -> Devices | None:
    """What the planner needs to re-plan a shrunk job; None when no memory was given."""
    if not (args.device_memory or args.hardware):
        return None
    per_process = args.devices_per_process or args.cpu_devices
    if not per_process:
        raise ConfigError("--device-memory/--hardware need the devices each "
                                     "training process drives: add --devices-per-process, "
                                     "e.g. 8.")
    hardware = HARDWARE[args.hardware or ("cpu" if args.cpu_devices else "h100")]
    memory = (memory_budget_bytes(args.device_memory) if args.device_memory
              else hardware.memory_bytes)
    return Devices(per_process, memory, hardware)


@exits_on_user_error
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise ConfigError("put the training arguments after `--`: python -m "
                                     "jaxtron.launch --processes 2 -- --config configs/tiny.yaml")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m jaxtron.launch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=1,
                        help="training processes to run (under --launcher: the step's tasks, "
                             "one per node)")
    parser.add_argument("--launcher",
                        help="a command that starts the processes itself, e.g. \"srun "
                             "--kill-on-bad-exit=1\" inside a SLURM allocation: the supervisor "
                             "runs it (with the training command) as one child and restarts it")
    parser.add_argument("--cpu-devices", type=int,
                        help="simulated CPU devices per process (XLA_FLAGS)")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--min-processes", type=int,
                        help="continue on fewer processes, down to this many, when one keeps "
                             "failing (default: --processes, never fewer)")
    parser.add_argument("--drop-after", type=int, default=2,
                        help="failures in a row of the same process before it is dropped")
    parser.add_argument("--grow-after-s", type=float, default=600,
                        help="after dropping processes, try all of them again this much later")
    parser.add_argument("--device-memory",
                        help="each device's memory, e.g. 80GiB: a job shrunk to fewer processes "
                             "takes the planner's fastest layout that fits it when the smallest "
                             "change does not (default: --hardware's memory)")
    parser.add_argument("--hardware", choices=sorted(HARDWARE),
                        help="the accelerator the planner ranks layouts for when shrinking")
    parser.add_argument("--devices-per-process", type=int,
                        help="devices each process drives (default: --cpu-devices)")
    parser.add_argument("--heartbeat-timeout-s", type=int, default=60,
                        help="a silent process is declared dead after this long")
    parser.add_argument("--stall-timeout-s", type=float, default=1800,
                        help="no new step logged for this long (compile included) is a "
                             "failure")
    args = parser.parse_args(argv[:split])
    train_args = argv[split + 1:]
    train_parser = argparse.ArgumentParser(add_help=False)
    train_parser.add_argument("--config")
    train_parser.add_argument("overrides", nargs="*")
    known, _ = train_parser.parse_known_args(train_args)
    config = load_config(known.config, known.overrides)  # a bad config: one line, now
    job = LocalJob(args.processes, train_args, config, args.cpu_devices,
                   args.heartbeat_timeout_s, args.min_processes or args.processes,
                   shlex.split(args.launcher) if args.launcher else None,
                   devices_for_shrinking(args))
    return supervise(job.start, Path(config.train.run_dir), args.max_restarts,
                     args.stall_timeout_s,
                     tokens_per_step=config.train.batch_size * config.data.seq_len,
                     log_every=config.train.log_every, shrink=job.shrink,
                     drop_after=args.drop_after, grow=job.grow, grow_after_s=args.grow_after_s,
                     target_steps=config.train.steps, blame=job.blame)


if __name__ == "__main__":
    sys.exit(main())
