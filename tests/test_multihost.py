"""Multi-process training with real OS processes on 127.0.0.1: JAX's distributed runtime, gloo
collectives between processes, per-host data, checkpoints across process counts, dead peers."""

import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from jaxtron.config.loading import load_config
from jaxtron.config.schema import DistributedConfig
from jaxtron.runtime.distributed import LaunchError, first_slurm_host, resolve_launch
from jaxtron.supervisor.local_job import free_port
from jaxtron.training.loop import run_training

from conftest import FAST_COMPILE_FLAGS, losses_by_step

# Constant learning rate after warm-up, so a run stopped early and resumed with more steps follows
# the same schedule as one uninterrupted run.
BASE = ["--config", "configs/tiny.yaml", "model.num_layers=2", "model.d_model=64",
        "model.mlp_dim=128", "data.seq_len=32", "data.builtin_max_bytes=400000",
        "train.log_every=1", "train.eval_every=0", "train.batch_size=8",
        "optim.warmup_steps=1", "optim.min_lr_ratio=1.0", "checkpoint.every=2", "mesh.data=2", "mesh.tensor=4"]


def launch(run_dir, processes, *extra, env_for=None):
    """Start `processes` training processes (4 CPU devices each when several, else 8)."""
    devices = 8 // processes
    port = free_port()
    procs = []
    for rank in range(processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                             f"{FAST_COMPILE_FLAGS}")
        if processes > 1:
            env.update(env_for(rank, port))
        cmd = [sys.executable, "-u", "-m", "jaxtron.train", *BASE, f"train.run_dir={run_dir}",
               *extra]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def slurm_env(rank, port):
    """What `srun --nodes=2 --ntasks-per-node=1` sets, with both 'nodes' on this machine."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1",
            "JAX_COORDINATOR_PORT": str(port)}


def train(run_dir, processes, *extra):
    outputs = []
    for proc in launch(run_dir, processes, *extra, env_for=slurm_env):
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
        outputs.append(out)
    return outputs


@functools.cache
def _one_process_run() -> dict:
    """The run the multi-process and supervised runs are compared with: 60 steps of BASE on
    this process's 8 devices (what one training process has), once per test process, without
    BASE's periodic saves (a save changes no loss: the resumed runs compared with it show
    that). A run of fewer steps is its prefix: the learning rate is constant after warm-up."""
    run_dir = Path(tempfile.mkdtemp(prefix="one-process-"))
    run_training(load_config(BASE[1], [*BASE[2:], "train.steps=60", "checkpoint.every=0",
                                       f"train.run_dir={run_dir}"]))
    return losses_by_step(run_dir)


def one_process_losses(steps: int) -> dict:
    return {step: loss for step, loss in _one_process_run().items() if step <= steps}


def test_two_processes_train_like_one_and_checkpoints_cross_process_counts(tmp_path):
    chained = tmp_path / "chained"
    train(chained, 1, "train.steps=2")
    # Two processes restore the one-process checkpoint, train steps 3-4 and save.
    first, second = train(chained, 2, "train.steps=4", "mesh.dcn_data=2")
    assert "resumed from" in first and "step 3/4" in first
    assert "step 3/4" not in second  # only process 0 reports
    # One process restores the two-process checkpoint and finishes.
    (last,) = train(chained, 1, "train.steps=6")
    assert "resumed from" in last and "at step 4" in last
    expected, got = one_process_losses(6), losses_by_step(chained)
    assert sorted(got) == list(range(1, 7))
    np.testing.assert_allclose([got[s] for s in range(1, 7)],
                               [expected[s] for s in range(1, 7)], rtol=2e-5)


def test_a_dead_process_makes_the_survivor_exit_with_a_message(tmp_path):
    timeout = 10

    def env_for(rank, port):
        return {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(rank)}

    procs = launch(tmp_path, 2, "train.steps=1000000", "checkpoint.every=0",
                   f"distributed.heartbeat_timeout_s={timeout}", env_for=env_for)
    for line in procs[0].stdout:
        if " 3/1000000 |" in line:
            break
    procs[1].kill()
    out, _ = procs[0].communicate(timeout=120)  # ends on its own: a hang fails here
    assert procs[0].returncode not in (0, None), out[-2000:]
    assert "died" in out, out[-2000:]


def jax_env(rank, port):
    return {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(rank)}


def test_sigterm_to_one_process_makes_both_save_the_same_step_and_exit_zero(tmp_path):
    """SLURM may signal one process first: JAX's preemption sync point makes every process
    stop at the same step, so none waits in a save or a collective for the other."""
    procs = launch(tmp_path, 2, "train.steps=1000000", "checkpoint.every=0", "mesh.dcn_data=2",
                   env_for=jax_env)
    for line in procs[0].stdout:
        if " 3/1000000 |" in line:
            break
    procs[1].send_signal(signal.SIGTERM)  # process 1 only
    outs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [out[-2000:] for out in outs]
    saved = re.search(r"preempted: saved step (\d+)", outs[0])
    assert saved, outs[0][-2000:]
    step = int(saved.group(1))
    assert (tmp_path / "checkpoints" / str(step)).is_dir()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [str(step)]


def test_a_refused_run_dir_stops_every_process_at_once(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    procs = launch(tmp_path, 2, "train.resume=never", env_for=jax_env)
    outs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [2, 2], outs
    assert "holds a previous run (metrics.jsonl) and train.resume=never" in outs[0]
    assert "process 0 could not start the run" in outs[1]


def test_a_missing_coordinator_is_one_line_within_the_timeout(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1",
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}")
    result = subprocess.run([sys.executable, "-m", "jaxtron.train", *BASE,
                             f"train.run_dir={tmp_path}", "distributed.init_timeout_s=5"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("process 1 of 2: joining through the coordinator")  # at once
    assert lines[-1].startswith("error: process 1 could not join the job: nothing answers at")
    assert "distributed.coordinator_address" in lines[-1] and "Traceback" not in result.stderr


def test_launch_settings_come_from_config_then_environment_then_slurm():
    assert resolve_launch(DistributedConfig(), {}) is None  # one process needs nothing
    slurm = {"SLURM_JOB_ID": "1000", "SLURM_STEP_NODELIST": "gpu[007-009,12],cpu1",
             "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
             "SLURM_NTASKS_PER_NODE": "4"}
    launch = resolve_launch(DistributedConfig(), slurm)
    assert launch.coordinator_address == f"gpu007:{61440 + 1000 % 4096}"
    assert (launch.num_processes, launch.process_id) == (8, 5)
    assert launch.local_device_ids == (1,)  # one process per GPU
    per_node = resolve_launch(DistributedConfig(), {**slurm, "SLURM_NTASKS_PER_NODE": "1"})
    assert per_node.local_device_ids is None  # one process drives every GPU of its node
    env = {**slurm, "JAX_COORDINATOR_ADDRESS": "head:1234", "JAX_PROCESS_ID": "2"}
    assert resolve_launch(DistributedConfig(), env).coordinator_address == "head:1234"
    assert resolve_launch(DistributedConfig(), env).process_id == 2
    explicit = DistributedConfig(coordinator_address="10.0.0.1:9000", num_processes=2,
                                 process_id=1)
    from_config = resolve_launch(explicit, slurm)
    assert (from_config.coordinator_address, from_config.num_processes,
            from_config.process_id) == ("10.0.0.1:9000", 2, 1)
    assert first_slurm_host("node001") == "node001"
    assert first_slurm_host("a1,b2") == "a1"


@pytest.mark.parametrize("settings, message", [
    (DistributedConfig(num_processes=2), "distributed.process_id"),
    (DistributedConfig(num_processes=2, process_id=2, coordinator_address="h:1"), "outside 0..1"),
    (DistributedConfig(num_processes=2, process_id=0, coordinator_address="h"), "needs a port"),
])
def test_incomplete_launch_settings_name_the_field(settings, message):
    with pytest.raises(LaunchError, match=message):
        resolve_launch(settings, {})
