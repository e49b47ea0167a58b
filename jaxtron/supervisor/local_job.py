"""The training processes a supervised job runs: on this machine, or as one srun step.

`start(restart)` launches them (`python -m jaxtron.train` with the job's arguments) on a fresh
coordinator port; a restart resumes from the run folder's checkpoints whatever `train.resume`
the job was given. `shrink(culprit)` drops a lost process (or srun node) for good, down to
`min_processes`, with the overrides that keep the global batch (`elastic.py`); `grow()` goes
back to every process; `blame(rank)` names who caused a failure of child `rank`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from jaxtron.config.schema import Config
from jaxtron.supervisor.elastic import Devices, shrink_within
from jaxtron.supervisor.slurm_step import FailedNodes, step_options
from jaxtron.training.flops import CPU_PEAK_ENV, measure_cpu_peak_for_children


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self._cpu_peak: float | None = None

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
        port = free_port()
        return [subprocess.Popen(self._command(restart), env=self.environment(rank, port))
                for rank in range(self.processes)]

    def environment(self, rank: int, port: int) -> dict[str, str]:
        """Process `rank`'s environment: its simulated CPU devices, this machine's CPU peak
        (measured once, here, for every process and restart: `training.flops.cpu_peak`) and
        its place in the job."""
        env = dict(os.environ)
        if self.cpu_devices:
            env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""),
                                         f"--xla_force_host_platform_device_count="
                                         f"{self.cpu_devices}"]).strip()
        on_cpu = self.cpu_devices or env.get("JAX_PLATFORMS") == "cpu"
        if on_cpu and CPU_PEAK_ENV not in env:
            if self._cpu_peak is None:
                self._cpu_peak = measure_cpu_peak_for_children()
            env[CPU_PEAK_ENV] = repr(self._cpu_peak)
        if self.processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                       JAX_NUM_PROCESSES=str(self.processes), JAX_PROCESS_ID=str(rank))
        return env

    def _command(self, restart: bool) -> list[str]:
        return [sys.executable, "-u", "-m", "jaxtron.train", *self.train_args,
                f"distributed.heartbeat_timeout_s={self.heartbeat_timeout_s}",
                *(["train.resume=auto"] if restart else []), *self.overrides]


def stop(children: list[subprocess.Popen]) -> None:
    """Kill what is left of a failed job: its state is lost anyway, and a polite stop would
    wait on the dead peer (the checkpoint is the recovery point)."""
    for child in children:
        if child.poll() is None:
            child.kill()
    for child in children:
        child.wait()
