"""One run per run directory: previous runs are refused, archived or deleted as asked, and a
second writer stops at once while a dead one's lock is taken over."""

import json
import signal
import subprocess
import sys

import pytest

from jaxtron import train
from jaxtron.checkpoint.manager import Checkpointer, checkpoint_dir

from conftest import metric_records

TINY = ["--config", "configs/tiny.yaml", "model.num_layers=2", "model.d_model=64",
        "model.mlp_dim=128", "data.seq_len=32", "data.builtin_max_bytes=400000",
        "train.log_every=1", "train.eval_every=0", "train.batch_size=8", "train.steps=3",
        "optim.warmup_steps=1"]


def cli(capsys, run_dir, *extra):
    code = train.main([*TINY, f"train.run_dir={run_dir}", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_resume_never_refuses_a_folder_with_a_previous_run(tmp_path, capsys):
    assert cli(capsys, tmp_path)[0] == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    code, _, err = cli(capsys, tmp_path, "train.resume=never")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "holds a previous run (checkpoints up to step 3 and metrics.jsonl)" in err
    assert "train.resume=archive" in err and "train.resume=overwrite" in err
    assert (tmp_path / "metrics.jsonl").read_text() == before  # nothing touched


def test_archive_moves_the_previous_run_and_overwrite_deletes_it(tmp_path, capsys):
    assert cli(capsys, tmp_path, "train.steps=2")[0] == 0
    code, out, _ = cli(capsys, tmp_path, "train.resume=archive")
    assert code == 0 and "moved the previous run" in out
    (archived,) = (tmp_path / "archive").iterdir()
    assert [r["step"] for r in metric_records(archived)] == [1, 2]
    assert Checkpointer(checkpoint_dir(archived), 3, read_only=True).latest_step() == 2
    assert [r["step"] for r in metric_records(tmp_path)] == [1, 2, 3]  # a fresh run
    code, out, _ = cli(capsys, tmp_path, "train.resume=overwrite", "train.steps=1")
    assert code == 0 and "deleted the previous run" in out
    assert [r["step"] for r in metric_records(tmp_path)] == [1]
    assert Checkpointer(checkpoint_dir(tmp_path), 3, read_only=True).manager.all_steps() == [1]


def command(run_dir, *extra):
    return [sys.executable, "-u", "-m", "jaxtron.train", *TINY, f"train.run_dir={run_dir}",
            *extra]


def start_and_wait(cmd, marker):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if marker in line:
            return proc
    pytest.fail(f"{marker!r} never appeared: {proc.communicate()[0][-2000:]}")


def test_a_second_run_in_a_busy_folder_stops_and_a_dead_runs_lock_is_taken_over(tmp_path):
    first = start_and_wait(command(tmp_path, "train.steps=100000"), "step      2/100000")
    holder = json.loads((tmp_path / ".lock").read_text())
    assert holder["pid"] == first.pid
    second = subprocess.run(command(tmp_path), capture_output=True, text=True, timeout=300)
    assert second.returncode == 2
    assert f"is in use by another run (pid {first.pid} on host {holder['host']}" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    first.send_signal(signal.SIGKILL)
    first.communicate()
    assert (tmp_path / ".lock").exists()  # kill -9 leaves it behind
    third = subprocess.run(command(tmp_path, "train.steps=4"), capture_output=True, text=True,
                           timeout=300)
    assert third.returncode == 0, third.stderr[-2000:]
    assert f"taking over {tmp_path / '.lock'} from pid {first.pid}" in third.stdout
    assert not (tmp_path / ".lock").exists()  # released at the end
