"""Bad values, files and misuse met as a new user meets them: each ends in one line naming the
field or file and the fix (status 2), or, where the input is valid, in one line saying what was
done; nothing is overwritten, nothing hangs, no checkpoint with non-finite parameters is called
intact."""

import numpy as np
import pytest

from jaxtron.config.loading import config_from_dict, load_config
from jaxtron.errors import ConfigError

from conftest import make_config


@pytest.mark.parametrize("override, fragment", [
    ({"moe.num_experts": -4}, "moe.num_experts=-4 must be >= 0"),
    ({"moe.expert_mlp_dim": 0}, "moe.expert_mlp_dim=0 must be a positive width"),
    ({"moe.expert_mlp_dim": -64}, "moe.expert_mlp_dim=-64 must be a positive width"),
    ({"moe.shared_experts": -1}, "moe.shared_experts=-1 must be >= 0"),
    ({"optim.muon_ns_steps": -3}, "optim.muon_ns_steps=-3 must be >= 1"),
    ({"optim.muon_momentum": 1.5}, "optim.muon_momentum=1.5 must be >= 0.0 and < 1.0"),
    ({"model.rope_theta": -1}, "model.rope_theta=-1.0 must be > 0.0"),
    ({"model.norm_eps": -1}, "model.norm_eps=-1.0 must be > 0.0"),
    ({"model.init_std": 0}, "model.init_std=0.0 must be > 0.0"),
    ({"data.builtin_max_bytes": 0}, "data.builtin_max_bytes=0 must be >= 1"),
    ({"optim.lr": "inf"}, "optim.lr=inf is not a finite number"),
    ({"optim.lr": ".nan"}, "optim.lr=nan is not a finite number"),
    ({"moe.capacity_factor": "inf"}, "moe.capacity_factor=inf is not a finite number"),
    ({"data.blend": "inf builtin:stdlib 1 other"},
     "data.blend[0].weight=inf (source builtin:stdlib) must be positive and finite"),
])
def test_every_value_is_checked_at_load(override, fragment):
    with pytest.raises(ConfigError) as err:
        make_config(override)
    assert fragment in str(err.value) and len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("text, key", [
    ("model:\n  d_model: 64\n  d_model: 128\n", "d_model"),
    ("model:\n  d_model: 64\ntrain:\n  steps: 5\nmodel:\n  num_layers: 2\n", "model"),
])
def test_a_key_set_twice_in_a_config_file_is_refused(tmp_path, text, key):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"sets '{key}' twice"):
        load_config(path)


def test_zbv_implies_its_two_chunks_per_rank():
    config = config_from_dict({"mesh": {"stage": 2}, "pipeline": {"schedule": "zbv"},
                               "model": {"num_layers": 4}})
    assert config.pipeline.virtual_stages == 2


def test_a_resume_with_another_batch_size_continues_at_the_row_it_stopped(capsys):
    from jaxtron.data.pipeline import open_dataset, train_batches

    eight, sixteen = make_config({"train.batch_size": 8}), make_config({"train.batch_size": 16})
    data = open_dataset(eight)
    before = train_batches(eight, data)
    next(before), next(before)  # rows 0..15 read
    resumed = train_batches(sixteen, data)
    resumed.set_state(before.get_state())
    assert "continues at row 16" in capsys.readouterr().err
    reference = train_batches(eight, data)
    for _ in range(2):
        next(reference)
    want = np.concatenate([next(reference)["tokens"], next(reference)["tokens"]])
    np.testing.assert_array_equal(next(resumed)["tokens"], want)  # rows 16..31
    again = train_batches(sixteen, data)  # a second resume at 16 from the resumed stream
    again.set_state(resumed.get_state())
    np.testing.assert_array_equal(next(again)["tokens"], next(resumed)["tokens"])


def test_muon_trains_on_a_pipeline_from_the_command_line(tmp_path):
    from jaxtron import train

    assert train.main(["--config", "configs/tiny.yaml", "optim.name=muon", "mesh.stage=2",
                       "mesh.data=4", "pipeline.microbatches=2", "train.steps=2",
                       "model.num_layers=2", "data.builtin_max_bytes=400000",
                       "checkpoint.every=1", f"train.run_dir={tmp_path}"]) == 0
    assert (tmp_path / "checkpoints" / "2").is_dir()


def one_line_error(capsys, status: int) -> str:
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("argv, fragment", [
    (["--max-restarts", "-1"], "--max-restarts -1 must be at least 0"),
    (["--processes", "0"], "--processes 0 must be at least 1"),
    (["--processes", "1", "--min-processes", "4"], "--min-processes 4 exceeds --processes 1"),
    (["--drop-after", "0"], "--drop-after 0 must be at least 1"),
    (["--stall-timeout-s", "0"], "--stall-timeout-s 0.0 must be more than 0"),
])
def test_launch_flags_are_checked(capsys, argv, fragment):
    from jaxtron import launch

    status = launch.main([*argv, "--", "--config", "configs/tiny.yaml"])
    assert fragment in one_line_error(capsys, status)


def test_launch_help_prints_help(capsys):
    from jaxtron import launch

    with pytest.raises(SystemExit) as done:
        launch.main(["--help"])
    assert done.value.code == 0 and "--max-restarts" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["--devices", "7"], "--devices 7 admits no layout of this model"),
    (["--devices", "1048576"], "--devices 1048576 admits no layout of this model"),
    (["--devices", "8", "--top", "0"], "--top 0 must be at least 1"),
    (["--devices", "8", "--efficiency", "-1"], "--efficiency -1.0 must be more than 0"),
    (["--devices", "8", "--efficiency", "0"], "--efficiency 0.0 must be more than 0"),
    (["--devices", "8", "--efficiency", "2"], "--efficiency 2.0 is a share of the peak"),
    (["--devices", "8", "--peak-tflops", "0"], "--peak-tflops 0.0 must be more than 0"),
    (["--devices", "8", "--host-bw", "-5"], "--host-bw -5.0 must be more than 0"),
    (["--devices", "8", "--node-size", "0"], "--node-size 0 must be at least 1"),
])
def test_plan_flags_are_checked(capsys, argv, fragment):
    from jaxtron import plan

    status = plan.main(["--config", "configs/tiny.yaml", "--hardware", "cpu", *argv])
    assert fragment in one_line_error(capsys, status)


@pytest.mark.parametrize("argv, fragment", [
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--repeats", "-1"], "--repeats -1 must be at least 1"),
    (["--warmup", "-2"], "--warmup -2 must be at least 0"),
])
def test_bench_flags_are_checked(capsys, argv, fragment):
    from jaxtron import bench

    assert fragment in one_line_error(capsys, bench.main(["--config", "configs/tiny.yaml",
                                                          *argv]))


def test_dry_run_takes_devices_0_as_given(capsys):
    from jaxtron import train

    status = train.main(["--config", "configs/tiny.yaml", "--dry-run", "--devices", "0"])
    assert "--devices 0 must be at least 1" in one_line_error(capsys, status)


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_generation_refuses_a_temperature_that_is_no_number_of_degrees(tmp_path, capsys,
                                                                       value):
    from jaxtron import generate
    from jaxtron.training.loop import run_training

    run_training(make_config({"train.steps": 1, "train.run_dir": str(tmp_path),
                              "mesh.data": 8}))
    capsys.readouterr()
    status = generate.main(["--checkpoint", str(tmp_path), "--prompt-ids", "1,2",
                            "--temperature", value])
    assert "--temperature" in one_line_error(capsys, status)


def test_export_never_overwrites_another_folder_or_a_run(tmp_path, capsys):
    from jaxtron import export
    from jaxtron.training.loop import run_training

    run = tmp_path / "run"
    run_training(make_config({"train.steps": 1, "train.run_dir": str(run), "mesh.data": 8}))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine")
    capsys.readouterr()
    for out, fragment in ((victim, "holds other files"), (run, "is a training run's folder")):
        for fmt in ("orbax", "hf"):
            status = export.main(["--checkpoint", str(run), "--out", str(out), "--format", fmt,
                                  "--overwrite"])
            assert fragment in one_line_error(capsys, status)
    assert (victim / "notes.txt").read_text() == "mine" and not (run / "params").exists()
    first = tmp_path / "first"
    assert export.main(["--checkpoint", str(run), "--out", str(first)]) == 0
    capsys.readouterr()
    status = export.main(["--checkpoint", str(run), "--out", str(first), "--format", "hf"])
    assert "holds an earlier export; add --overwrite" in one_line_error(capsys, status)
    assert export.main(["--checkpoint", str(run), "--out", str(first), "--format", "hf",
                        "--overwrite"]) == 0
    assert not (first / "params").exists() and (first / "config.json").is_file()


def test_a_save_of_non_finite_parameters_stops_the_run_and_keeps_the_last_good_one(tmp_path):
    """An update that overflows the parameters while its step's loss and gradients were finite
    (a huge learning rate, no clipping): nothing non-finite is saved or called intact."""
    import jax

    from jaxtron.checkpoint.manager import Checkpointer, checkpoint_dir
    from jaxtron.training.loop import run_training
    from jaxtron.training.nonfinite import NonFiniteError
    from jaxtron.training.trainer import Trainer

    config = make_config({"train.steps": 6, "checkpoint.every": 1, "checkpoint.keep": 10,
                          "optim.lr": 1e30, "optim.warmup_steps": 0, "optim.grad_clip": 0,
                          "train.run_dir": str(tmp_path), "mesh.data": 8})
    with pytest.raises(NonFiniteError) as err:
        run_training(config)
    checkpoints = Checkpointer(checkpoint_dir(tmp_path), 10, read_only=True)
    saved = sorted(checkpoints.manager.all_steps())
    assert (f"step {saved[-1]}" if saved else "no checkpoint") in str(err.value)
    trainer = Trainer(config)
    for step in saved:
        state, _ = checkpoints.restore(step, trainer.abstract_canonical_state(), trainer.config)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def test_a_second_launch_leaves_a_busy_folder_alone(tmp_path):
    import json
    import subprocess
    import sys

    from jaxtron.supervisor.machine import Supervision
    from jaxtron.supervisor.supervise import LaunchBusy, supervise

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); "
                                "time.sleep(60)", "jaxtron"], stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline() == "up\n"  # running its own command line by now
        (tmp_path / "processes.json").write_text(json.dumps([sleeper.pid]))
        with pytest.raises(LaunchBusy, match="is in use by another launch"):
            supervise(object(), tmp_path, Supervision(0, 60))
        assert json.loads((tmp_path / "processes.json").read_text()) == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_file_where_the_checkpoints_go_is_refused_before_the_first_step(tmp_path, capsys):
    from jaxtron import train

    (tmp_path / "checkpoints").write_text("x")
    status = train.main(["--config", "configs/tiny.yaml", "train.steps=10", "checkpoint.every=5",
                         "optim.warmup_steps=2", "model.num_layers=1", "data.builtin_max_bytes=400000",
                         f"train.run_dir={tmp_path}"])
    line = one_line_error(capsys, status)
    assert "it is a file, not a folder" in line and "train.run_dir" in line
    assert (tmp_path / "checkpoints").read_text() == "x"


def test_a_failed_background_save_ends_the_run_with_one_line(tmp_path):
    """A write past the file-size limit fails in Orbax's writer threads: the command still ends,
    in bounded time, with status 2 and one line on the console; the libraries' tracebacks go to
    the run's library.log."""
    import subprocess
    import sys

    run = tmp_path / "run"
    done = subprocess.run(  # files of at most 2 MiB (2,048 blocks of 1 KiB), as `ulimit -f 2048`
        ["bash", "-c", 'ulimit -f 2048 && exec "$@"', "bash",
         sys.executable, "-m", "jaxtron.train", "--config", "configs/tiny.yaml",
         "train.steps=30", "checkpoint.every=2", "optim.warmup_steps=2",
         "data.builtin_max_bytes=400000",
         f"train.run_dir={run}"],
        capture_output=True, text=True, timeout=300)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(err) == 1 and err[0].startswith("error: writing checkpoint step 2"), err[:5]
    assert "Traceback" not in done.stdout and "No checkpoint had been written" in err[0]
    assert "Traceback" in (run / "library.log").read_text()


@pytest.mark.parametrize("flag, line, fragment", [
    ("--input", {"text": None}, "field 'text' is a JSON null, not a string"),
    ("--input", {"text": ["a", "b"]}, "field 'text' is a JSON array, not a string"),
    ("--jsonl", {"prompt": "a", "completion": 3}, "field 'completion' is a JSON number"),
    ("--jsonl", {"messages": [{"role": "user", "content": "hi"},
                              {"role": "asistant", "content": "yo"}]},
     "role 'asistant', which no chat template knows; did you mean 'assistant'?"),
    ("--jsonl", {"messages": [{"role": "usr", "content": "hi"},
                              {"role": "assistant", "content": "yo"}]}, "did you mean 'user'?"),
    ("--jsonl", {"messages": [{"role": "robot", "content": "hi"},
                              {"role": "assistant", "content": "yo"}]},
     "use one of system, developer, user, assistant, tool"),
])
def test_prepare_refuses_lines_it_would_misread(tmp_path, capsys, flag, line, fragment):
    import json

    from jaxtron.data import prepare

    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "fine", "prompt": "a",
                                                   "completion": "b"}) + "\n" + json.dumps(line))
    argv = [flag, str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out")]
    if "messages" in line:
        (tmp_path / "in.jsonl").write_text(json.dumps(line))
        argv += ["--messages-key", "messages"]
    line = one_line_error(capsys, prepare.main(argv))
    assert fragment in line and "in.jsonl line" in line
    assert not list(tmp_path.glob("out*"))


def test_prepare_refuses_a_tokenizer_that_does_not_cover_the_text(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jaxtron.data import prepare

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "the": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "text.txt").write_text("der die das the")
    line = one_line_error(capsys, prepare.main([
        "--input", str(tmp_path / "text.txt"), "--out", str(tmp_path / "out"),
        "--tokenizer", str(tmp_path / "tokenizer.json")]))
    assert "maps 3 of the 4 tokens" in line and "does not cover this text" in line
    assert not list(tmp_path.glob("out*"))
    (tmp_path / "text.txt").write_text("the the das")  # mostly covered: written
    assert prepare.main(["--input", str(tmp_path / "text.txt"), "--out", str(tmp_path / "out"),
                         "--tokenizer", str(tmp_path / "tokenizer.json")]) == 0
