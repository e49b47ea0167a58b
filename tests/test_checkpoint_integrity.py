"""Checkpoints that are damaged, or cannot be written, never cost a run silently.

Fingerprints against a numpy reference; a flipped byte in the newest checkpoint makes the run
resume from the previous one; a disk too small refuses the save up front; a write that fails in
the background stops the run at the next step; both keep the earlier checkpoints.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxtron import train
from jaxtron.checkpoint.fingerprint import fingerprints
from jaxtron.checkpoint.manager import Checkpointer, checkpoint_dir
from jaxtron.config.loading import dump_config
from jaxtron.data.pipeline import open_dataset
from jaxtron.training.loop import run_training

from conftest import make_config, metric_records


def numpy_fingerprint(x: np.ndarray) -> int:
    """sum_i bits(x_i) * (2 i + 1) mod 2^32 over the row-major elements (the reference)."""
    if x.dtype == np.bool_:
        bits = x.astype(np.uint64)
    elif x.dtype.itemsize == 8:
        bits = x.view(np.uint32).astype(np.uint64)
    else:
        bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(
            np.uint64)
    flat = bits.reshape(-1)
    weights = 2 * np.arange(flat.size, dtype=np.uint64) + 1
    return int(np.sum((flat * weights) % 2**32) % 2**32)


def test_fingerprints_match_numpy_and_ignore_sharding():
    rng = np.random.default_rng(0)
    tree = {"w": rng.standard_normal((16, 24)).astype(np.float32),
            "b": rng.standard_normal((24,)).astype(jnp.bfloat16),
            "n": np.arange(7, dtype=np.int32), "flag": np.array(True)}
    want = {f"['{k}']": numpy_fingerprint(np.asarray(v)) for k, v in tree.items()}
    assert fingerprints(tree) == want
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharded = dict(tree, w=jax.device_put(tree["w"], NamedSharding(mesh, PartitionSpec("a", "b"))))
    assert fingerprints(sharded) == want
    flipped = tree["w"].copy()
    flipped.view(np.uint32)[3, 5] ^= 1 << 17  # one bit of one element
    assert fingerprints(dict(tree, w=flipped))["['w']"] != want["['w']"]


def config_for(run_dir, steps):
    return make_config({"train.steps": steps, "train.log_every": 1, "train.eval_every": 0,
                        "checkpoint.every": 2, "checkpoint.keep": 5,
                        "train.run_dir": str(run_dir), "optim.warmup_steps": 1,
                        "optim.min_lr_ratio": 1.0, "mesh.data": 8})


def flip_a_byte(step_dir):
    """Flip one byte in the middle of the checkpoint's largest array data file."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    largest.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    run_training(config_for(tmp_path, 4))  # saves steps 2 and 4
    flip_a_byte(tmp_path / "checkpoints" / "4")
    capsys.readouterr()
    run_training(config_for(tmp_path, 6))
    out = capsys.readouterr().out
    assert "note: skipping a damaged checkpoint" in out and "/checkpoints/4" in out
    assert "resumed from" in out and "at step 2" in out
    assert (tmp_path / "checkpoints" / "4.damaged").is_dir()  # set aside, not deleted
    # Steps 3-6 ran again from step 2: one row per step, and the losses of the run that was
    # interrupted by nothing but the damage.
    rows = metric_records(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    reference = tmp_path.parent / "reference"
    run_training(config_for(reference, 6))
    assert [r["loss"] for r in rows] == [r["loss"] for r in metric_records(reference)]


def test_when_no_checkpoint_reads_back_the_run_stops_with_one_line(tmp_path, capsys):
    config = config_for(tmp_path, 2)
    run_training(config)
    flip_a_byte(tmp_path / "checkpoints" / "2")
    capsys.readouterr()
    (tmp_path / "config.yaml").write_text(dump_config(config))
    assert train.main(["--config", str(tmp_path / "config.yaml"), "train.steps=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: none of the 1 checkpoints") and "train.resume=archive" \
        in err[-1]


TINY_CLI = ["--config", "configs/tiny.yaml", "model.num_layers=2", "model.d_model=64",
            "model.mlp_dim=128", "data.seq_len=32", "data.builtin_max_bytes=400000",
            "train.log_every=1", "train.eval_every=0", "train.batch_size=8",
            "optim.warmup_steps=1", "checkpoint.every=2"]


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: room for the run's files, not for a checkpoint of the tiny model."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_disk_without_room_refuses_the_save_before_it_starts(small_disk):
    result = subprocess.run([sys.executable, "-m", "jaxtron.train", *TINY_CLI, "train.steps=4",
                             f"train.run_dir={small_disk / 'run'}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: checkpoint step 2 needs about")
    assert f"in {small_disk / 'run' / 'checkpoints'}, but only" in line and "MiB are free" in line
    assert "Traceback" not in result.stderr
    assert [r["step"] for r in metric_records(small_disk / "run")] == [1, 2]


# Limit the file size, then exec the command: writes past the limit fail with EFBIG (SIGXFSZ
# ignored), in the exec'd process too. (A trampoline, since forking a JAX process is unsafe.)
LIMITED = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
           "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000)); "
           "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def test_a_write_failing_in_the_background_stops_the_run_at_the_next_step(tmp_path):
    """Files may not grow past 200 kB in this process, so Orbax's background write of the
    first checkpoint fails; the run stops at the next step instead of training on unsaved."""
    open_dataset(make_config())  # the built-in corpus, written to the cache before the limit
    result = subprocess.run([sys.executable, "-c", LIMITED, "-m", "jaxtron.train", *TINY_CLI,
                             "train.steps=40", f"train.run_dir={tmp_path}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: writing checkpoint step 2 to ") and "MiB are free" in last
    assert "No checkpoint had been written" in last
    assert metric_records(tmp_path)[-1]["step"] < 40
    assert Checkpointer(checkpoint_dir(tmp_path), 3, read_only=True).latest_step() is None


@pytest.mark.parametrize("override, named", [
    ("optim.grad_clip=0", "optim.grad_clip: checkpoint on, config off (0)"),
    ("optim.name=muon", "optim.name: checkpoint adamw, config muon"),
    ("optim.moment_dtype=bfloat16", "optim.moment_dtype: checkpoint float32, config bfloat16"),
    ("model.tie_embeddings=true", "model.tie_embeddings: checkpoint False, config True"),
])
def test_other_settings_are_named_not_taken_for_damage(tmp_path, capsys, override, named):
    """A resume under settings that make another train state names the setting, and never
    calls the checkpoint damaged or advises deleting it: it reads back under its own."""
    config = config_for(tmp_path, 2)
    run_training(config)
    (tmp_path / "config.yaml").write_text(dump_config(config))
    capsys.readouterr()
    assert train.main(["--config", str(tmp_path / "config.yaml"), "train.steps=4",
                       override]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert named in err and "damaged" not in err and "delete" not in err, err
    assert (tmp_path / "config.yaml").read_text() == dump_config(config)  # not the refused one
    assert (tmp_path / "checkpoints" / "2").is_dir()  # left where it was
