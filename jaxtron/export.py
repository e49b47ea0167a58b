"""Export a training checkpoint: consolidated parameters (Orbax) or a Hugging Face directory.

    python -m jaxtron.export --checkpoint runs/tiny --out exports/tiny --format orbax
    python -m jaxtron.export --checkpoint runs/llama --out exports/llama-hf --format hf

`--checkpoint` is any jaxtron checkpoint: a run directory (its newest good checkpoint, or
`--step N`) or a parameters-only checkpoint from `export` or `convert` (to turn it into a
Hugging Face directory, say). The orbax format is a parameters-only checkpoint in the model's layout plus the resolved `config.yaml`: it restores on
one device with no mesh (`orbax.checkpoint.StandardCheckpointer().restore(OUT / "params")`), is
what `train.init_from` and `jaxtron.generate` read, and is what `jaxtron.convert` writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml
from flax import nnx

from jaxtron.config.loading import config_from_dict, config_to_dict, dump_config
from jaxtron.config.schema import Config
from jaxtron.checkpoint.manager import (CheckpointError, Checkpointer, DamagedCheckpoint,
                                check_compatible, checkpoint_dir)
from jaxtron.errors import exits_on_user_error
from jaxtron.kernels import fp8
from jaxtron.runtime.run_dir import cannot_write


def single_device_config(config: Config) -> Config:
    """The same model on one device: every parallel degree 1."""
    raw = config_to_dict(config)
    raw["mesh"] = {}
    raw["pipeline"] = {}
    raw["optim"]["zero_stage"] = 0
    return config_from_dict(raw)


def load_training_params(run_dir: str | Path, step: int | None = None):
    """-> (config, params pure dict on one device) from a run directory's checkpoint: the
    newest one that reads back intact, or `step`."""
    from jaxtron.training.trainer import Trainer

    directory = checkpoint_dir(run_dir)
    checkpoints = Checkpointer(directory, keep=1, read_only=True)
    steps = sorted(checkpoints.manager.all_steps())
    if not steps:
        raise CheckpointError(f"{directory} holds no checkpoint; pass a run directory that "
                              "has trained (runs save a checkpoint at their last step).")
    if step is not None and step not in steps:
        raise CheckpointError(f"--step {step} was never saved in {directory}; choose one of "
                              f"{', '.join(map(str, steps[-10:]))}.")
    config = single_device_config(config_from_dict(_readable_config(checkpoints, steps,
                                                                        step)))
    trainer = Trainer(config, devices=jax.devices()[:1])
    abstract = trainer.abstract_canonical_state()
    if step is not None:
        state, _ = checkpoints.restore(step, abstract, config)
    else:
        _, state, _ = checkpoints.restore_newest_good(abstract, config)
    return config, nnx.to_pure_dict(state.params)


def _readable_config(checkpoints, steps: list[int], step: int | None) -> dict:
    """The saved config of `step`, or of the newest step whose config reads back."""
    if step is not None:
        return checkpoints.saved_config(step)
    for candidate in reversed(steps):
        try:
            return checkpoints.saved_config(candidate)
        except DamagedCheckpoint as err:
            print(f"note: skipping a damaged checkpoint: {err}", flush=True)
    return checkpoints.saved_config(steps[-1])  # raises the newest one's error


def load_any(path: str | Path, step: int | None = None):
    """-> (config, params pure dict) from a run directory or an export/convert output."""
    path = Path(path)
    if (path / "params").is_dir():
        if step is not None:
            raise CheckpointError(f"{path} is a parameters-only checkpoint with one state; "
                                  "leave out --step, or pass a run directory.")
        from jaxtron.training.trainer import Trainer

        config = single_device_config(exported_config(path))
        params = load_params(path, Trainer(config, devices=jax.devices()[:1]))
        return config, nnx.to_pure_dict(params)
    if checkpoint_dir(path).is_dir():
        return load_training_params(path, step)
    raise CheckpointError(f"{path} is not a jaxtron checkpoint: pass a training run directory "
                          "(it holds checkpoints/) or the output of python -m jaxtron.export or "
                          "python -m jaxtron.convert (it holds params/ and config.yaml).")


def save_params(out: str | Path, config: Config, params_pure: dict) -> Path:
    out = writable_dir(out)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / "params", weights_only(params_pure), force=True)
    checkpointer.wait_until_finished()
    (out / "config.yaml").write_text(dump_config(config))
    return out


def writable_dir(out: str | Path) -> Path:
    """`out`, created, or CheckpointError naming it when it cannot be written."""
    out = Path(out).absolute()
    why = cannot_write(out)
    if why:
        raise CheckpointError(f"--out {out} cannot be written ({why}); choose a folder you "
                              "can write to.")
    return out


def exported_config(path: str | Path) -> Config:
    path = Path(path)
    if not (path / "config.yaml").is_file() or not (path / "params").is_dir():
        raise CheckpointError(f"{path} is not an exported checkpoint (it needs config.yaml and "
                              "params/); create one with python -m jaxtron.export or "
                              "python -m jaxtron.convert.")
    try:
        raw = yaml.safe_load((path / "config.yaml").read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path / 'config.yaml'} is not valid YAML "
                              f"({type(err).__name__}); export the checkpoint again.") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path / 'config.yaml'} holds no config; export the checkpoint "
                              "again.")
    return config_from_dict(raw)


def load_params(path: str | Path, trainer) -> nnx.State:
    """Parameters of an exported checkpoint, placed with `trainer`'s shardings (model layout)."""
    path = Path(path).absolute()
    check_compatible(config_to_dict(exported_config(path)), trainer.config, path)
    params = trainer.abstract_canonical_state().params
    target = nnx.to_pure_dict(params)
    try:
        restored = ocp.StandardCheckpointer().restore(path / "params", weights_only(target))
    except Exception as err:
        raise CheckpointError(f"the parameters in {path / 'params'} could not be read "
                              f"({type(err).__name__}: {str(err)[:300]}); re-export them.") from None
    nnx.replace_by_pure_dict(params, with_empty_fp8_histories(restored, target))
    return params


def weights_only(tree: dict) -> dict:
    """A pure-dict parameter tree without delayed fp8 scaling's amax histories: exports hold
    weights, and a model fine-tuned with `model.fp8: delayed` starts its histories afresh."""
    return {k: weights_only(v) if isinstance(v, dict) else v for k, v in tree.items()
            if k != fp8.HISTORY}


def with_empty_fp8_histories(weights: dict, target: dict) -> dict:
    """`weights` plus zero amax histories wherever `target` (the model's tree) has one."""
    out = {}
    for key, want in target.items():
        if key == fp8.HISTORY:
            out[key] = np.zeros(want.shape, want.dtype)
        elif isinstance(want, dict):
            out[key] = with_empty_fp8_histories(weights[key], want)
        else:
            out[key] = weights[key]
    return out


@exits_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.export",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a training run directory, or an export/convert output")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--format", choices=("orbax", "hf"), default="orbax")
    parser.add_argument("--step", type=int, help="checkpoint step (default: newest)")
    args = parser.parse_args(argv)
    config, params = load_any(args.checkpoint, args.step)
    if args.format == "orbax":
        out = save_params(args.out, config, params)
    else:
        from jaxtron.hf import translate as hf
        hf_config, tensors = hf.to_hf(config, params)
        out = writable_dir(args.out)
        hf.save_hf_dir(out, hf_config, tensors)
    print(f"exported {args.format} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
