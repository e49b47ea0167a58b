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
step (`--exclude`, with `--nodes`/`--ntasks` for the processes left;
`jaxtron.supervisor.slurm_step`),
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
import shlex
import sys
from pathlib import Path

from jaxtron.config.flags import above, at_least
from jaxtron.config.loading import load_config
from jaxtron.errors import ConfigError, exit_command, exits_on_user_error
from jaxtron.planner.hardware import HARDWARE
from jaxtron.planner.memory import memory_budget_bytes
from jaxtron.supervisor.elastic import Devices
from jaxtron.supervisor.local_job import LocalJob
from jaxtron.supervisor.machine import Supervision
from jaxtron.supervisor.supervise import supervise
from jaxtron.training.flops import given_cpu_peak


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


def _check_flags(args) -> None:
    at_least("--processes", args.processes, 1, "run at least one training process")
    at_least("--max-restarts", args.max_restarts, 0, "give 0 for no restart")
    at_least("--drop-after", args.drop_after, 1, "give the failures in a row before a process "
             "is dropped, e.g. 2")
    at_least("--min-processes", args.min_processes, 1, "keep at least one process")
    if args.min_processes is not None and args.min_processes > args.processes:
        raise ConfigError(f"--min-processes {args.min_processes} exceeds --processes "
                          f"{args.processes}; give at most {args.processes}.")
    for flag in ("cpu_devices", "devices_per_process"):
        at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1, "give a device count")
    for flag in ("grow_after_s", "heartbeat_timeout_s", "stall_timeout_s"):
        above(f"--{flag.replace('_', '-')}", getattr(args, flag), 0, "give a number of seconds")


@exits_on_user_error
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        prog="python -m jaxtron.launch", description=__doc__.split("\n\n")[0],
        usage="python -m jaxtron.launch [options] -- --config CONFIG [section.key=value ...]",
        epilog="The training arguments follow `--`: what python -m jaxtron.train takes.")
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
    if split == len(argv):
        raise ConfigError("put the training arguments after `--`: python -m "
                          "jaxtron.launch --processes 2 -- --config configs/tiny.yaml")
    _check_flags(args)
    train_args = argv[split + 1:]
    train_parser = argparse.ArgumentParser(add_help=False)
    train_parser.add_argument("--config")
    train_parser.add_argument("overrides", nargs="*")
    known, _ = train_parser.parse_known_args(train_args)
    config = load_config(known.config, known.overrides)  # a bad config: one line, now
    given_cpu_peak()  # and a bad peak for the processes
    job = LocalJob(args.processes, train_args, config, args.cpu_devices,
                   args.heartbeat_timeout_s, args.min_processes or args.processes,
                   shlex.split(args.launcher) if args.launcher else None,
                   devices_for_shrinking(args))
    supervision = Supervision(args.max_restarts, args.stall_timeout_s,
                              target_steps=config.train.steps, drop_after=args.drop_after,
                              grow_after_s=args.grow_after_s, blame=job.blame)
    return supervise(job, Path(config.train.run_dir), supervision,
                     tokens_per_step=config.train.batch_size * config.data.seq_len,
                     log_every=config.train.log_every)


if __name__ == "__main__":
    exit_command(main())
