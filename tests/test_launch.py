"""The training supervisor (`python -m jaxtron.launch`): a killed process makes it restart the
job, which resumes from the newest checkpoint and reproduces an uninterrupted run's losses;
bad input is not retried; restarts run out with one line; a stalled job counts as failed."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxtron.checkpoint.manager import saved_steps
from jaxtron.runtime.run_dir import last_logged_step
from jaxtron.supervisor.machine import Supervision
from jaxtron.supervisor.records import productive_seconds
from jaxtron.supervisor.supervise import LaunchFailed, supervise

from conftest import FAST_COMPILE_FLAGS, losses_by_step, metric_records
from test_multihost import BASE, one_process_losses


class Exiting:
    """A job for `supervise`: one process per start exiting with the next status (negative:
    killed by that signal; None: sleeps until killed)."""

    def __init__(self, *statuses):
        self.calls = iter(statuses)

    def start(self, restart):
        status = next(self.calls)
        code = ("import time; time.sleep(60)" if status is None else
                f"import os; os.kill(os.getpid(), {-status})" if status < 0 else
                f"raise SystemExit({status})")
        return [subprocess.Popen([sys.executable, "-c", code])]


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]


def test_a_failure_is_restarted_and_a_bad_input_is_not(tmp_path):
    assert supervise(Exiting(1, 0), tmp_path / "a", Supervision(2, stall_timeout_s=60)) == 0
    (restart,) = records(tmp_path / "a")
    assert restart["event"] == "process 0 exited with status 1" and restart["lost_steps"] == 0
    # status 2 is a refused config, data or checkpoint: the same failure again, not retried
    assert supervise(Exiting(2), tmp_path / "b", Supervision(2, stall_timeout_s=60)) == 2
    assert not (tmp_path / "b" / "restarts.jsonl").exists()


def test_restarts_run_out_with_one_line_naming_the_last_failure(tmp_path):
    with pytest.raises(LaunchFailed, match=r"failed again \(process 0 was killed by SIGKILL\) "
                                           r"after 1 restart"):
        supervise(Exiting(3, -signal.SIGKILL), tmp_path, Supervision(1, stall_timeout_s=60))
    assert [r["event"] for r in records(tmp_path)] == ["process 0 exited with status 3"]


def test_goodput_counts_each_final_step_once_at_its_logged_rate(tmp_path):
    lines = [{"step": 2, "tokens_per_s": 100.0}, {"step": 4, "tokens_per_s": 50.0},
             {"step": 4, "tokens_per_s": 200.0},  # step 4 again after a restart: this counts
             {"step": 4, "eval_loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    # two windows of 2 steps of 100 tokens: 2 * 100 / 100 + 2 * 100 / 200 seconds
    assert productive_seconds(tmp_path, tokens_per_step=100, log_every=2) == 3.0


def test_a_job_that_logs_no_step_is_stopped_as_stalled(tmp_path):
    with pytest.raises(LaunchFailed, match="no step logged for 1 s"):
        supervise(Exiting(None), tmp_path, Supervision(0, stall_timeout_s=1))


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_lost_process_is_restarted_and_the_losses_are_an_uninterrupted_runs(tmp_path, how):
    """kill -9, or SIGSTOP (a hung host: the other process's heartbeat check fails it within
    the timeout), one of two processes after a checkpoint: the job restarts from it and every
    step's loss equals a one-process run's."""
    reference, run_dir, launcher = start_supervised(tmp_path, 16, "--max-restarts", "2")
    launched = time.monotonic()
    _kill_after_a_checkpoint(run_dir, launcher, how)
    out, _ = launcher.communicate(timeout=600)
    seen_s = time.monotonic() - launched
    assert launcher.returncode == 0, out[-3000:]
    failure, recovered = records(run_dir)
    if how == signal.SIGKILL:
        assert failure["event"] == "process 1 was killed by SIGKILL", failure
    else:  # process 0's heartbeat check notices its silent peer and aborts it
        assert failure["event"].startswith("process 0 "), failure
    assert failure["resume_from"] >= 2 and failure["lost_steps"] >= 0
    assert recovered["event"] == "recovered" and recovered["recovery_s"] > 0
    assert "launch: done after 1 restart(s)" in out
    summary = json.loads((run_dir / "launch.json").read_text())
    assert summary["restarts"] == 1, summary
    # goodput: the final steps' own time over the launch's wall time. With train.log_every=1
    # each step's last row times that step alone: its 8 x 32 tokens at the logged tokens/s.
    rate = {r["step"]: r["tokens_per_s"] for r in metric_records(run_dir) if "tokens_per_s" in r}
    steps_s = sum(8 * 32 / rate[step] for step in range(1, 17))
    assert summary["productive_s"] == pytest.approx(steps_s, abs=0.05 + 1e-9), summary
    assert summary["wall_s"] <= seen_s + 0.05, (summary, seen_s)  # it ran inside our window
    assert summary["goodput"] == pytest.approx(steps_s / summary["wall_s"], rel=5e-3, abs=1e-4)
    expected, got = reference, losses_by_step(run_dir)
    assert sorted(got) == list(range(1, 17))
    np.testing.assert_allclose([got[s] for s in range(1, 17)],
                               [expected[s] for s in range(1, 17)], rtol=2e-5)


def start_supervised(tmp_path, steps, *launch_args, every=2):
    """The losses of a one-process run of `steps` steps, and the supervisor started on 2
    processes x 4 devices for the same run, saving every `every` steps. -> (reference losses,
    run dir, supervisor)."""
    reference = one_process_losses(steps)
    run_dir = tmp_path / "supervised"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE_FLAGS)
    command = [sys.executable, "-u", "-m", "jaxtron.launch", "--processes", "2",
               "--cpu-devices", "4", "--heartbeat-timeout-s", "10", *launch_args, "--", *BASE,
               f"train.steps={steps}", f"checkpoint.every={every}", "mesh.dcn_data=2",
               f"train.run_dir={run_dir}"]
    return reference, run_dir, subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True)


def _kill_after_a_checkpoint(run_dir, launcher, how=signal.SIGKILL, pids_before=None,
                             saved_before=0):
    """Wait until the job (a new one, if `pids_before`) has a checkpoint newer than
    `saved_before` and has logged a step after it; send its process 1 `how`. -> (pids, saved)."""
    deadline = time.monotonic() + 300
    while True:
        assert time.monotonic() < deadline and launcher.poll() is None, "no step after a save"
        pids = json.loads((run_dir / "processes.json").read_text()) if (
            run_dir / "processes.json").exists() else None
        saved = max(saved_steps(run_dir / "checkpoints"), default=0)
        logged = last_logged_step(run_dir)
        if pids and pids != pids_before and saved > saved_before and logged > saved:
            os.kill(pids[1], how)
            return pids, saved
        time.sleep(0.05)


def test_a_process_that_keeps_failing_is_dropped_then_grown_back_at_the_same_batch(
        tmp_path):
    """Process 1 killed twice in a row: the job continues on process 0 alone (data 2 -> 1,
    grad_accum 1 -> 2, same global batch and data stream), grows back to both 1 s later, and
    every step's loss is a one-process run's up to the order of the sums."""
    # A save every 5 steps, not 2: the kills, the drop and the growth need a few saves, and
    # each of 30 saves would slow the next step of both processes.
    reference, run_dir, launcher = start_supervised(
        tmp_path, 60, "--max-restarts", "3", "--min-processes", "1", "--drop-after", "2",
        "--grow-after-s", "1", every=5)
    pids, saved = _kill_after_a_checkpoint(run_dir, launcher)
    _kill_after_a_checkpoint(run_dir, launcher, signal.SIGKILL, pids, saved)
    out, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, out[-3000:]
    events = [r["event"] for r in records(run_dir)]
    assert events[0] == events[2] == "process 1 was killed by SIGKILL", events
    assert events[3] == ("continuing on 1 process(es) without process 1, same global batch: "
                         "mesh.data=1 mesh.dcn_data=1 optim.grad_accum=2"), events
    # 1 s later both processes run again, from a checkpoint the single one saved on SIGTERM
    assert "growing back to 2 process(es)" in events, events
    assert len(json.loads((run_dir / "processes.json").read_text())) == 2
    expected, got = reference, losses_by_step(run_dir)
    assert sorted(got) == list(range(1, 61))
    np.testing.assert_allclose([got[s] for s in range(1, 61)],
                               [expected[s] for s in range(1, 61)], rtol=1e-4)


def test_shrinking_keeps_the_global_batch_or_names_what_cannot_shrink():
    from jaxtron.config.loading import load_config
    from jaxtron.supervisor.elastic import CannotShrink, fewer_processes

    def config(*overrides):
        return load_config("configs/tiny.yaml", ["train.batch_size=24", *overrides])

    assert fewer_processes(config("mesh.data=-1"), 4, 2) == ["optim.grad_accum=2"]
    assert fewer_processes(config("mesh.data=4", "optim.grad_accum=3"), 4, 1) == [
        "mesh.data=1", "optim.grad_accum=12"]
    with pytest.raises(CannotShrink, match="mesh.data=3 cannot shrink by 2"):
        fewer_processes(config("mesh.data=3"), 2, 1)
    with pytest.raises(CannotShrink, match="4 processes cannot shrink evenly to 3"):
        fewer_processes(config(), 4, 3)


def test_a_shrunk_job_that_would_not_fit_takes_the_planners_fitting_layout():
    """ZeRO-1 on 2 x 4 devices shrunk to 1 x 4: the smallest change (data 8 -> 4) doubles each
    device's optimizer and gradient shards past a 23 MB budget, so the planner's fastest layout
    that fits is taken; same global batch, accumulated to the same rows per device."""
    from jaxtron.config.loading import config_from_dict, config_to_dict, load_config
    from jaxtron.planner.hardware import HARDWARE
    from jaxtron.planner.layout import layout_of
    from jaxtron.planner.memory import predict
    from jaxtron.sharding.mesh import resolve_degrees
    from jaxtron.supervisor.elastic import CannotShrink, Devices, fewer_processes, shrink_within

    config = load_config("configs/tiny.yaml", ["mesh.data=8", "train.batch_size=16",
                                               "optim.zero_stage=1"])

    def memory(overrides):
        shrunk = config_from_dict(config_to_dict(config), overrides)
        return predict(shrunk, layout_of(shrunk, resolve_degrees(shrunk.mesh, 4))).total, shrunk

    budget = 23_000_000
    smallest, _ = memory(fewer_processes(config, 2, 1))
    assert smallest > budget
    assert shrink_within(config, 2, 1, Devices(4, smallest, HARDWARE["cpu"])) == \
        fewer_processes(config, 2, 1)  # it fits: the smallest change
    chosen = shrink_within(config, 2, 1, Devices(4, budget, HARDWARE["cpu"]))
    used, shrunk = memory(chosen)
    assert used <= budget, chosen
    assert shrunk.train.batch_size == 16 and shrunk.mesh.stage == 1
    degrees = resolve_degrees(shrunk.mesh, 4)
    per_device_rows = 16 // (degrees["data"] * degrees["fsdp"] * degrees["expert"])
    assert per_device_rows // shrunk.optim.grad_accum <= 16 // 8, chosen
    with pytest.raises(CannotShrink, match="no layout of this model fits 4 devices of 5 MiB"):
        shrink_within(config, 2, 1, Devices(4, 5 * 2**20, HARDWARE["cpu"]))


def test_a_launcher_command_starts_the_job_as_one_child(tmp_path):
    """`--launcher` (srun in a SLURM allocation) runs the training command itself; `env`
    stands in for it here, setting what srun would (one task)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE_FLAGS)
    out = subprocess.run(
        [sys.executable, "-m", "jaxtron.launch", "--launcher",
         "env SLURM_NTASKS=1 SLURM_PROCID=0", "--", *BASE, "mesh.data=1", "mesh.tensor=1",
         "train.steps=2", f"train.run_dir={tmp_path}"],
        capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "launch: done after 0 restart(s)" in out.stdout
    assert len(json.loads((tmp_path / "processes.json").read_text())) == 1
    assert sorted(losses_by_step(tmp_path)) == [1, 2]


def test_a_node_srun_reports_failing_twice_is_excluded_from_the_next_step(tmp_path):
    """Under `--launcher`, srun's `error: node1: task 1: ...` lines name the node: after two
    failures on it the next step runs `--exclude=node1 --nodes=1 --ntasks=1`, on one process
    at the same global batch, and trains to the end (tests/fake_srun.py stands in for srun)."""
    steps_log = tmp_path / "srun.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu", FAKE_SRUN_NODES="node0,node1",
               FAKE_SRUN_BROKEN="node1", FAKE_SRUN_LOG=str(steps_log),
               XLA_FLAGS=f"{FAST_COMPILE_FLAGS} --xla_force_host_platform_device_count=4")
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "jaxtron.launch", "--launcher",
         f"{sys.executable} tests/fake_srun.py --kill-on-bad-exit=1", "--processes", "2",
         "--min-processes", "1", "--drop-after", "2", "--max-restarts", "3", "--",
         *BASE, "mesh.dcn_data=2", "train.steps=4", f"train.run_dir={run_dir}"],
        capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    events = [r["event"] for r in records(run_dir)]
    assert events[:2] == ["process 0 exited with status 1 (srun: a task failed on node1)"] * 2
    assert events[2] == ("continuing on 1 process(es) without node node1, same global batch: "
                         "mesh.data=1 mesh.dcn_data=1 optim.grad_accum=2"), events
    steps = [json.loads(line) for line in steps_log.read_text().splitlines()]
    assert [s.get("exclude") for s in steps] == [None, None, "node1"]
    assert steps[-1]["nodes"] == steps[-1]["ntasks"] == "1"
    assert sorted(losses_by_step(run_dir)) == [1, 2, 3, 4]


def test_the_newest_step_is_read_from_the_end_and_a_cut_row_is_skipped(tmp_path):
    rows = "".join(json.dumps({"step": s, "loss": 1.0, "pad": "x" * 100}) + "\n"
                   for s in range(1, 2001))
    (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 2001, "lo')  # killed mid-row
    assert last_logged_step(tmp_path) == 2000
    assert last_logged_step(tmp_path, tail_bytes=300) == 2000


def test_memory_for_shrinking_needs_the_devices_per_process(capsys):
    from jaxtron.launch import main

    assert main(["--device-memory", "80GiB", "--", "--config", "configs/tiny.yaml"]) == 2
    assert "add --devices-per-process" in capsys.readouterr().err.strip().splitlines()[-1]


def test_srun_error_lines_name_the_failed_node():
    from jaxtron.supervisor.slurm_step import failed_node, step_options

    assert failed_node("srun: error: node12: task 3: Killed") == "node12"
    assert failed_node("srun: error: gpu-a-01: tasks 0-3: Exited with exit code 1") == "gpu-a-01"
    assert failed_node("srun: error: Timed out waiting for job step to complete") is None
    assert failed_node("step 10 | loss 2.3") is None
    assert step_options([], 4) == []
    assert step_options(["a", "b"], 2) == ["--exclude=a,b", "--nodes=2", "--ntasks=2"]
