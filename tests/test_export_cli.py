"""Export to Hugging Face, import back, and generate from the command line."""

import jax
import numpy as np
from flax import nnx
from test_checkpoint import BASE

from jaxtron.checkpoint.params import exported_config, read_params
from jaxtron.training.trainer import Trainer

from conftest import run_in_process


def cli(module, *args):
    result = run_in_process(module, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def logits_of(config, params, tokens):
    trainer = Trainer(config, devices=jax.devices()[:1])
    return np.asarray(nnx.merge(trainer.graphdef, params)(tokens))


def test_hf_export_then_import_gives_the_same_logits(tmp_path):
    cli("jaxtron.train", *BASE, f"train.run_dir={tmp_path / 'run'}", "train.steps=3",
        "checkpoint.every=3")
    cli("jaxtron.export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf"),
        "--format", "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    cli("jaxtron.convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back"))

    config, pure = read_params(tmp_path / "run")
    trainer = Trainer(config, devices=jax.devices()[:1])
    original = trainer.abstract_canonical_state().params
    nnx.replace_by_pure_dict(original, pure)
    back_config = exported_config(tmp_path / "back")
    back_trainer = Trainer(back_config, devices=jax.devices()[:1])
    imported = back_trainer.params_from(tmp_path / "back")
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12) * 7 % 256
    np.testing.assert_allclose(logits_of(back_config, imported, tokens),
                               logits_of(config, original, tokens), rtol=1e-5, atol=1e-5)

    out = cli("jaxtron.generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "def ",
              "--max-new-tokens", "8")
    assert out.startswith("ids: ") and "text: def " in out
    ids = out.splitlines()[0][5:]
    again = cli("jaxtron.generate", "--checkpoint", str(tmp_path / "back"), "--prompt-ids",
                "100,101,102,32", "--max-new-tokens", "8")  # "def " as byte ids
    assert again.splitlines()[0][5:] == ids  # imported weights generate the same greedy text
