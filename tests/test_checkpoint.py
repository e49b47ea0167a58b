"""Checkpoints: exact resume after kill -9, preemption, any-mesh restore, damaged files, NaNs."""

import signal
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxtron.checkpoint.fingerprint import fingerprints
from jaxtron.checkpoint.manager import Checkpointer, CheckpointError, checkpoint_dir
from jaxtron.checkpoint.params import save_params
from jaxtron.config.loading import config_from_dict
from jaxtron.training.trainer import Trainer

from conftest import losses_by_step, make_config, metric_records, run_in_process

BASE = ["--config", "configs/tiny.yaml", "model.num_layers=2", "model.d_model=64",
        "model.mlp_dim=128", "data.seq_len=32", "data.builtin_max_bytes=400000",
        "train.log_every=1", "train.eval_every=0", "train.batch_size=8"]


def train_args(run_dir, *extra):
    return [*BASE, f"train.run_dir={run_dir}", *extra]


def train_cmd(run_dir, *extra):
    return [sys.executable, "-u", "-m", "jaxtron.train", *train_args(run_dir, *extra)]


def run_until(cmd, marker, sig):
    """Start `cmd`, send `sig` once a line containing `marker` is printed, return the process."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            proc.send_signal(sig)
            break
    rest, _ = proc.communicate(timeout=300)
    return proc.returncode, "".join(lines) + rest


def whole_and_killed_runs(tmp_path, args, kill_at: str):
    """Train `args` once whole (tmp_path/whole) and once killed with SIGKILL when `kill_at` is
    printed, then resumed by the same command (tmp_path/killed)."""
    whole = subprocess.run(train_cmd(tmp_path / "whole", *args), capture_output=True,
                           text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]
    code, out = run_until(train_cmd(tmp_path / "killed", *args), kill_at, signal.SIGKILL)
    assert code == -signal.SIGKILL, out[-2000:]
    resumed = subprocess.run(train_cmd(tmp_path / "killed", *args), capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    return tmp_path / "whole", tmp_path / "killed"


def test_kill_9_then_resume_reproduces_the_uninterrupted_losses_bitwise(tmp_path):
    whole, killed = whole_and_killed_runs(tmp_path, ["train.steps=12", "checkpoint.every=3"],
                                          "step  8/12")
    expected, got = losses_by_step(whole), losses_by_step(killed)
    # One row per step: the rows of steps 7-8, logged before the kill and run again after the
    # resume from step 6, were replaced, not repeated.
    assert [r["step"] for r in metric_records(tmp_path / "killed")] == list(range(1, 13))
    assert got == expected  # bitwise: same batches, same order, same arithmetic


def test_sigterm_saves_and_exits_zero(tmp_path):
    # Steps take milliseconds: far more than can run before the signal lands.
    code, out = run_until(train_cmd(tmp_path, "train.steps=1000000"), " 3/1000000 |",
                          signal.SIGTERM)
    assert code == 0, out[-2000:]
    assert "preempted: saved step" in out
    saved = Checkpointer(checkpoint_dir(tmp_path), keep=3).latest_step()
    assert saved is not None and 3 <= saved < 1000000


def trained_state(layout, tmp_path, steps=2, devices=None):
    config = make_config(layout, model={"num_layers": 4}, train={"batch_size": 8})
    trainer = Trainer(config, devices=devices)
    from jaxtron.data.pipeline import open_dataset, train_batches
    batches = train_batches(config, open_dataset(config))
    state = trainer.init_state()
    for _ in range(steps):
        state, _ = trainer.step(state, trainer.put_batch(next(batches)))
    checkpoints = Checkpointer(tmp_path, keep=2)
    checkpoints.save(steps, trainer.canonical_state(state), batches.get_state(), config)
    checkpoints.wait()
    return config, trainer, state, checkpoints


def pure(trainer, state):
    return jax.device_get(nnx.to_pure_dict(trainer.canonical_state(state).params))


@pytest.mark.parametrize("target", [{"mesh.data": 8}, {"mesh.data": 1}])
def test_restore_onto_a_different_mesh(tmp_path, target):
    source = {"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "pipeline.microbatches": 2}
    config, trainer, state, checkpoints = trained_state(source, tmp_path)
    devices = jax.devices() if target["mesh.data"] == 8 else jax.devices()[:1]
    other = Trainer(make_config(target, model={"num_layers": 4}, train={"batch_size": 8}),
                    devices=devices)
    restored, data_state = checkpoints.restore(2, other.abstract_canonical_state(),
                                               other.config)
    for a, b in zip(jax.tree.leaves(pure(other, restored)), jax.tree.leaves(pure(trainer, state)),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert data_state["stream"] == {"next_index": 2}
    restored, _ = other.step(restored, other.put_batch(
        {"tokens": np.zeros((8, 33), np.int32)}))  # and training continues
    assert int(restored.step) == 3


def test_other_model_shape_is_named(tmp_path):
    _, _, _, checkpoints = trained_state({"mesh.data": 8}, tmp_path)
    other = Trainer(make_config({"mesh.data": 8, "model.vocab_size": 512},
                                model={"num_layers": 4}, train={"batch_size": 8}))
    with pytest.raises(CheckpointError, match="model.vocab_size: checkpoint 256, config 512"):
        checkpoints.restore(2, other.abstract_canonical_state(), other.config)


def test_saving_a_replicated_state_on_cpu_compiles_nothing(tmp_path):
    # Orbax's default would split each replicated array among its replicas with a device
    # slicing program per shape: seconds of compiles at a run's first save, for nothing when
    # the replicas share one process's memory.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = {f"w{i}": jax.device_put(np.arange(24 * (40 + i), dtype=np.float32)
                                     .reshape(24, 40 + i), replicated) for i in range(3)}
    compiles = []

    def listener(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    config = make_config()
    fingerprints(state)  # the one program a save needs, compiled once per state structure
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        checkpoints = Checkpointer(tmp_path, keep=1)
        checkpoints.save(1, state, {}, config)
        checkpoints.wait()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    restored, _ = checkpoints.restore(1, jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state), config)
    for name, array in state.items():
        np.testing.assert_array_equal(restored[name], array)


def test_damaged_or_unfinished_checkpoints(tmp_path):
    config, trainer, _, checkpoints = trained_state({"mesh.data": 8}, tmp_path)
    # A save killed midway leaves only Orbax's temporary folder, which is never "latest".
    (tmp_path / "4.orbax-checkpoint-tmp-123").mkdir()
    (tmp_path / "4.orbax-checkpoint-tmp-123" / "junk").write_text("partial")
    fresh = Checkpointer(tmp_path, keep=2)
    assert fresh.latest_step() == 2
    fresh.restore(2, trainer.abstract_canonical_state(), config)
    # A truncated array file is reported with the folder and the way out.
    for path in sorted((tmp_path / "2" / "state").rglob("*")):
        if path.is_file() and path.stat().st_size > 1000:
            path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="could not be read .* delete that folder"):
        Checkpointer(tmp_path, keep=2).restore(2, trainer.abstract_canonical_state(), config)


def test_exported_parameters_restore_on_one_device_without_a_mesh(tmp_path):
    config, trainer, state, _ = trained_state({"mesh.data": 8}, tmp_path / "ckpt")
    params = pure(trainer, state)
    save_params(tmp_path / "export", config, params)
    plain = ocp.StandardCheckpointer().restore(tmp_path / "export" / "params")
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    single = Trainer(make_config({"mesh.data": 1}, model={"num_layers": 4},
                                 train={"batch_size": 8}), devices=jax.devices()[:1])
    loaded = single.params_from(tmp_path / "export")
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(loaded)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_export_cli_and_init_from(tmp_path):
    run = run_in_process("jaxtron.train", *train_args(tmp_path / "run", "train.steps=3",
                                                      "optim.warmup_steps=1"))
    assert run.returncode == 0, run.stderr[-2000:]
    export = run_in_process("jaxtron.export", "--checkpoint", str(tmp_path / "run"), "--out",
                            str(tmp_path / "exp"))
    assert export.returncode == 0, export.stderr[-2000:]
    tuned = run_in_process("jaxtron.train", *train_args(tmp_path / "tune", "train.steps=2",
                                                        f"train.init_from={tmp_path / 'exp'}"))
    assert tuned.returncode == 0, tuned.stderr[-2000:]
    first = losses_by_step(tmp_path / "tune")[1]
    assert first < losses_by_step(tmp_path / "run")[1] - 0.3  # starts from trained weights


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_loss_policy(tmp_path, policy):
    cmd = train_cmd(tmp_path, "train.steps=8", "checkpoint.every=1", "optim.lr=1e8",
                    "optim.warmup_steps=0", "optim.grad_clip=0", f"train.on_nan={policy}")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # what a user sees
    records = metric_records(tmp_path)
    if policy == "stop":
        assert result.returncode == 2, result.stderr[-2000:]
        assert "non-finite loss or gradient" in result.stderr and "is intact" in result.stderr
        assert "Traceback" not in result.stderr
    else:  # skipped updates are counted; a run that skipped most of them did not train
        skipped = records[-1]["skipped_updates"]
        assert skipped > 0
        assert result.returncode == (2 if skipped > 4 else 0), result.stderr[-2000:]
        if skipped > 4:
            assert f"{skipped} of this run's 8 updates were skipped" in result.stderr
            assert "done:" not in result.stdout
    checkpoints = Checkpointer(checkpoint_dir(tmp_path), keep=3)
    latest = checkpoints.latest_step()
    if latest is not None:  # every checkpoint that exists holds finite parameters
        config = config_from_dict(checkpoints.saved_config(latest))
        trainer = Trainer(config)
        state, _ = checkpoints.restore(latest, trainer.abstract_canonical_state(), config)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
