"""Join a multi-process job through JAX's distributed runtime before any device is touched.

Where the settings come from, first match wins, field by field:
  1. the config (`distributed.coordinator_address`, `.num_processes`, `.process_id`);
  2. the environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID;
  3. a SLURM step (`srun`): SLURM_STEP_NODELIST (its first node hosts the coordinator on a port
     derived from SLURM_JOB_ID, or JAX_COORDINATOR_PORT), SLURM_NTASKS, SLURM_PROCID.
One process needs nothing. On CPU the processes exchange data through gloo, so a job of several
processes runs on one machine exactly as on a cluster.

A process that dies stops sending heartbeats; after `distributed.heartbeat_timeout_s` the
coordination service tells the others, which then exit with an error instead of waiting forever
in a collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import sys
import threading

import jax

from jaxtron.config.schema import Config, DistributedConfig
from jaxtron.errors import JaxtronError


class LaunchError(JaxtronError):
    """Settings of a multi-process launch that are missing or inconsistent."""


@dataclasses.dataclass(frozen=True)
class Launch:
    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None


def first_slurm_host(node_list: str) -> str:
    """'gpu[003-007,9],cpu1' -> 'gpu003': the node that runs SLURM's task 0."""
    match = re.match(r"([^,\[]+)(?:\[([^\],\-]+))?", node_list.strip())
    if not match:
        raise LaunchError(f"SLURM_STEP_NODELIST={node_list!r} names no host; launch with srun "
                          "inside an allocation, or set distributed.coordinator_address.")
    prefix, first_index = match.groups()
    return prefix + (first_index or "")


def _env_int(environ, name: str) -> int | None:
    value = environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"the environment variable {name}={value!r} must be an integer; fix "
                          "the launch script or unset it.") from None


def _slurm_tasks_per_node(environ) -> int | None:
    """SLURM_NTASKS_PER_NODE, else the first count of SLURM_STEP_TASKS_PER_NODE ('8(x2)')."""
    count = _env_int(environ, "SLURM_NTASKS_PER_NODE")
    if count is None:
        match = re.match(r"\d+", environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
        count = int(match.group()) if match else None
    return count


def resolve_launch(settings: DistributedConfig, environ=os.environ) -> Launch | None:
    """The settings of this process's multi-process job, or None for a single process."""
    slurm = "SLURM_JOB_ID" in environ and "SLURM_STEP_NODELIST" in environ
    num = settings.num_processes
    if num is None:
        num = _env_int(environ, "JAX_NUM_PROCESSES")
    if num is None and slurm:
        num = _env_int(environ, "SLURM_NTASKS")
    if num is None or num == 1:
        return None
    pid = settings.process_id
    if pid is None:
        pid = _env_int(environ, "JAX_PROCESS_ID")
    if pid is None and slurm:
        pid = _env_int(environ, "SLURM_PROCID")
    address = settings.coordinator_address or environ.get("JAX_COORDINATOR_ADDRESS")
    if not address and slurm:
        port = environ.get("JAX_COORDINATOR_PORT") or str(
            61440 + int(environ["SLURM_JOB_ID"]) % 4096)
        address = f"{first_slurm_host(environ['SLURM_STEP_NODELIST'])}:{port}"
    missing = [name for name, value in (("distributed.process_id (or JAX_PROCESS_ID)", pid),
                                        ("distributed.coordinator_address (or "
                                         "JAX_COORDINATOR_ADDRESS)", address)) if value is None]
    if missing:
        raise LaunchError(f"this process belongs to a {num}-process job, but {' and '.join(missing)} "
                          "is not set and no SLURM step was found; set it for every process "
                          "(process ids 0..num_processes-1, the same host:port everywhere), or "
                          "launch with srun.")
    if not 0 <= pid < num:
        raise LaunchError(f"process id {pid} is outside 0..{num - 1} for a {num}-process job; "
                          "give each process a distinct id below distributed.num_processes.")
    if ":" not in address:
        raise LaunchError(f"distributed.coordinator_address={address!r} needs a port, e.g. "
                          f"{address}:61000.")
    local = settings.local_device_ids
    tasks_here = _slurm_tasks_per_node(environ) if slurm else None
    if local is None and slurm and tasks_here and tasks_here > 1:
        local = (_env_int(environ, "SLURM_LOCALID") or 0,)  # one process per accelerator
    return Launch(address, num, pid, tuple(local) if local is not None else None)


def initialize(config: Config, environ=os.environ) -> Launch | None:
    """Join the job described by `config` and the environment; a no-op for one process."""
    launch = resolve_launch(config.distributed, environ)
    if launch is None or jax.distributed.is_initialized():
        return launch
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only
    settings = config.distributed
    timeout = settings.init_timeout_s
    print(f"process {launch.process_id} of {launch.num_processes}: joining through the "
          f"coordinator at {launch.coordinator_address} (hosted by process 0), waiting up to "
          f"{timeout} s (distributed.init_timeout_s)", file=sys.stderr, flush=True)
    joined = threading.Event()
    threading.Thread(target=_give_up_after, args=(launch, timeout, joined), daemon=True).start()
    # JAX's own deadline comes later: when it passes, the runtime aborts the process with a
    # C++ stack trace, so the watchdog above ends it first with one line.
    try:
        jax.distributed.initialize(
            coordinator_address=launch.coordinator_address, num_processes=launch.num_processes,
            process_id=launch.process_id,
            local_device_ids=list(launch.local_device_ids) if launch.local_device_ids else None,
            cluster_detection_method="deactivate",
            initialization_timeout=timeout + JAX_DEADLINE_MARGIN_S,
            heartbeat_timeout_seconds=settings.heartbeat_timeout_s)
    finally:
        joined.set()  # joined, or failed with an error of its own: the watchdog stands down
    return launch


JAX_DEADLINE_MARGIN_S = 30


def _coordinator_listens(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def _give_up_after(launch: Launch, timeout: int, joined: threading.Event) -> None:
    if joined.wait(timeout):
        return
    if launch.process_id == 0:
        why = (f"the other {launch.num_processes - 1} processes did not all join within "
               f"{timeout} s; start every process with the same coordinator address and "
               f"process ids 1..{launch.num_processes - 1}, or raise distributed.init_timeout_s")
    elif not _coordinator_listens(launch.coordinator_address):
        why = (f"nothing answers at {launch.coordinator_address} after {timeout} s; start "
               "process 0 (it hosts the coordinator), or fix distributed.coordinator_address "
               "(JAX_COORDINATOR_ADDRESS) to name its host and a free port")
    else:
        why = (f"the coordinator at {launch.coordinator_address} answers but the job of "
               f"{launch.num_processes} processes did not assemble within {timeout} s; check "
               "that every process has a distinct distributed.process_id and the same "
               "distributed.num_processes, or raise distributed.init_timeout_s")
    print(f"error: process {launch.process_id} could not join the job: {why}.",
          file=sys.stderr, flush=True)
    os._exit(2)



@contextlib.contextmanager
def exits_when_a_peer_fails(launch: Launch | None):
    """In a multi-process job, turn a failed collective into one readable line and exit 3 at
    once (a dead peer cannot join the orderly shutdown, so waiting for it would only hang)."""
    try:
        yield
    except jax.errors.JaxRuntimeError as err:
        if launch is None:
            raise
        first_line = str(err).strip().splitlines()[0][:300]
        print(f"error: process {launch.process_id} of {launch.num_processes} stopped because a "
              f"step could not exchange data with the other processes ({first_line}). Another "
              "process most likely died: its log has the cause. Fix it and relaunch the same "
              "command; training resumes from the newest checkpoint.", file=sys.stderr,
              flush=True)
        os._exit(3)
