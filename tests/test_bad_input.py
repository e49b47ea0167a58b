"""Bad input of every kind, through each command line's main(argv): one line on stderr that
names the file or field and the fix, exit status 2, no traceback.

The data, checkpoint and model files are real ones, damaged the way they are in practice:
truncated, cut mid-record, not UTF-8, of the wrong kind.
"""

import json
import struct

import numpy as np
import pytest

from jaxtron import convert, export, generate, plan, train
from jaxtron.data import prepare
from jaxtron.data.indexed import write_indexed
from jaxtron.training.loop import run_training

from conftest import make_config

TINY = ["model.num_layers=2", "model.d_model=64", "model.mlp_dim=128", "data.seq_len=32",
        "data.builtin_max_bytes=400000", "train.batch_size=8", "train.steps=2",
        "optim.warmup_steps=1", "train.eval_every=0"]


def fails_with_one_line(capsys, main, argv, *fragments):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "Traceback" not in err and "<bound method" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def train_argv(tmp_path, *extra, config="configs/tiny.yaml"):
    return ["--config", str(config), *TINY, f"train.run_dir={tmp_path / 'run'}", *extra]


@pytest.mark.parametrize("text, fragment", [
    ("- model\n- train\n", "holds a YAML list, not a mapping"),
    ("42\n", "holds a YAML int, not a mapping"),
    ("", "is empty"),
    ("model: {num_layers: 2\n", "is not valid YAML at line"),
])
def test_config_files(tmp_path, capsys, text, fragment):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    fails_with_one_line(capsys, train.main, ["--config", str(path)], str(path), fragment)


def test_config_file_not_utf8(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_bytes("model: {type: llama}  # café\n".encode("latin-1"))
    fails_with_one_line(capsys, train.main, ["--config", str(path)], "is not UTF-8", "save it")


@pytest.mark.parametrize("override, fragment", [
    ("optim.b2=1.5", "optim.b2=1.5 must lie in [0, 1)"),
    ("optim.b1=-0.1", "optim.b1=-0.1 must lie in [0, 1)"),
    ("model.num_layers=100000", "the model does not fit"),
])
def test_values_that_cannot_train(tmp_path, capsys, override, fragment):
    fails_with_one_line(capsys, train.main, train_argv(tmp_path, override), fragment)


def dataset(tmp_path, ids=None, vocab=256):
    prefix = tmp_path / "data" / "d"
    documents = ids or [list(np.random.default_rng(i).integers(1, 200, 300)) for i in range(20)]
    write_indexed(prefix, documents, vocab_size=vocab, tokenizer="byte", eos_id=0)
    return prefix


def damage(prefix, suffix, change):
    path = prefix.parent / f"{prefix.name}{suffix}"
    path.write_bytes(change(path.read_bytes()))


@pytest.mark.parametrize("suffix, change, fragments", [
    (".idx", lambda b: b[:20], ("shorter than an index header", "truncated")),
    (".idx", lambda b: b[:60], ("describes 20 sequences but holds 60 bytes", "truncated")),
    (".idx", lambda b: b"XXXXXXXXX" + b[9:], ("bad magic",)),
    (".bin", lambda b: b[:-1], ("not a whole number of 2-byte tokens",)),
    (".bin", lambda b: b[:-200], ("holds 5920 tokens but", "describes 6020")),
    (".json", lambda b: b[:10], (".json is not valid JSON", "delete it")),
])
def test_damaged_datasets(tmp_path, capsys, suffix, change, fragments):
    prefix = dataset(tmp_path)
    damage(prefix, suffix, change)
    fails_with_one_line(capsys, train.main, train_argv(tmp_path, f"data.path={prefix}"),
                        "rebuild" if suffix != ".json" else "", *fragments)


def test_empty_dataset(tmp_path, capsys):
    prefix = dataset(tmp_path)
    idx = prefix.parent / "d.idx"
    # A valid index of zero sequences and an empty token file.
    idx.write_bytes(idx.read_bytes()[:9] + struct.pack("<QBQQ", 1, 8, 0, 1) + b"\0" * 8)
    (prefix.parent / "d.bin").write_bytes(b"")
    fails_with_one_line(capsys, train.main, train_argv(tmp_path, f"data.path={prefix}"),
                        "holds no tokens")


def test_token_ids_beyond_the_vocabulary_whatever_the_sidecar_says(tmp_path, capsys):
    ids = [list(range(1, 250))] * 20
    ids[7] = ids[7][:100] + [300] + ids[7][100:]
    prefix = dataset(tmp_path, ids)
    meta = json.loads((prefix.parent / "d.json").read_text())
    meta.pop("max_token_id")  # a sidecar from another tool: says vocab 256, nothing more
    (prefix.parent / "d.json").write_text(json.dumps(meta))
    fails_with_one_line(capsys, train.main, train_argv(tmp_path, f"data.path={prefix}"),
                        "holds token id 300, outside model.vocab_size=256",
                        "model.vocab_size=301")


def test_prepare_inputs(tmp_path, capsys):
    lines = tmp_path / "docs.jsonl"
    lines.write_bytes(b'{"text": "ok"}\n' + '{"text": "caf\xe9"}\n'.encode("latin-1"))
    out = str(tmp_path / "out" / "d")
    fails_with_one_line(capsys, prepare.main, ["--input", str(lines), "--out", out],
                        "line 2 is not utf-8 text", "--encoding")
    bad_tokenizer = tmp_path / "tokenizer.json"
    bad_tokenizer.write_text('{"model": ')
    text = tmp_path / "a.txt"
    text.write_text("hello")
    fails_with_one_line(capsys, prepare.main, ["--input", str(text), "--out", out,
                                               "--tokenizer", str(bad_tokenizer)],
                        "tokenizer file", "could not be read")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    fails_with_one_line(capsys, prepare.main, ["--input", str(text), "--out",
                                               str(blocker / "d")], "cannot write", "--out")
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\x7fELF\0\0\1\2")
    fails_with_one_line(capsys, prepare.main, ["--input", str(binary), "--out", out],
                        "is a binary file")
    fails_with_one_line(capsys, prepare.main, ["--input", str(text), "--out", out,
                                               "--encoding", "klingon"], "--encoding klingon")


def test_checkpoints_and_exports(tmp_path, capsys):
    trained_run = tmp_path / "trained"
    run_training(make_config({"train.steps": 2, "train.run_dir": str(trained_run),
                              "mesh.data": 8}))
    fails_with_one_line(capsys, export.main, ["--checkpoint", str(trained_run), "--out",
                                              str(tmp_path / "e"), "--step", "7"],
                        "--step 7 was never saved", "choose one of 2")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    fails_with_one_line(capsys, export.main, ["--checkpoint", str(trained_run), "--out",
                                              str(blocker / "e")], "cannot be written")
    fails_with_one_line(capsys, export.main, ["--checkpoint", str(tmp_path), "--out",
                                              str(tmp_path / "e")], "is not a jaxtron checkpoint")
    fails_with_one_line(capsys, generate.main, ["--checkpoint", str(tmp_path), "--prompt-ids",
                                                "1,2"], "is not a jaxtron checkpoint")
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(trained_run, copy)
    shutil.rmtree(copy / "checkpoints" / "2" / "config")
    fails_with_one_line(capsys, export.main, ["--checkpoint", str(copy), "--out",
                                              str(tmp_path / "e")], "has no readable config")


def test_unwritable_run_dir(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ["--config", "configs/tiny.yaml", *TINY, f"train.run_dir={blocker / 'run'}"]
    fails_with_one_line(capsys, train.main, argv, "train.run_dir=", "cannot be written")


def test_hugging_face_directories(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"architectures": ')
    fails_with_one_line(capsys, convert.main, ["--from-hf", str(tmp_path), "--out",
                                               str(tmp_path / "o")], "config.json is not valid")


def test_plan_memory_budget(capsys):
    fails_with_one_line(capsys, plan.main, ["--config", "configs/tiny.yaml", "--devices", "8",
                                            "--device-memory", "lots"],
                        "--device-memory 'lots' is not an amount of memory")
