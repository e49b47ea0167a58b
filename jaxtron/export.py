"""Export a training checkpoint: consolidated parameters (Orbax) or a Hugging Face directory.

    python -m jaxtron.export --checkpoint runs/tiny --out exports/tiny --format orbax
    python -m jaxtron.export --checkpoint runs/llama --out exports/llama-hf --format hf

`--checkpoint` is a run directory (its newest checkpoint, or `--step N`). The orbax format is a
parameters-only checkpoint in the model's layout plus the resolved `config.yaml`: it restores on
one device with no mesh (`orbax.checkpoint.StandardCheckpointer().restore(OUT / "params")`), is
what `train.init_from` and `jaxtron.generate` read, and is what `jaxtron.convert` writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp
import yaml
from flax import nnx

from jaxtron import config as config_lib
from jaxtron.checkpoint import CheckpointError, Checkpointer, check_compatible, checkpoint_dir
from jaxtron.errors import exits_on_user_error


def single_device_config(config: config_lib.Config) -> config_lib.Config:
    """The same model on one device: every parallel degree 1."""
    raw = config_lib.to_dict(config)
    raw["mesh"] = {}
    raw["pipeline"] = {}
    raw["optim"]["zero_stage"] = 0
    return config_lib.from_dict(raw)


def load_training_params(run_dir: str | Path, step: int | None = None):
    """-> (config, params pure dict on one device) from a run directory's checkpoint."""
    from jaxtron.trainer import Trainer

    checkpoints = Checkpointer(checkpoint_dir(run_dir), keep=1, read_only=True)
    step = checkpoints.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"{checkpoint_dir(run_dir)} holds no checkpoint; pass a run "
                              "directory that was trained with checkpoint.every > 0.")
    config = single_device_config(config_lib.from_dict(checkpoints.saved_config(step)))
    trainer = Trainer(config, devices=jax.devices()[:1])
    state, _ = checkpoints.restore(step, trainer.abstract_canonical_state(), config)
    return config, nnx.to_pure_dict(state.params)


def save_params(out: str | Path, config: config_lib.Config, params_pure: dict) -> Path:
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / "params", params_pure, force=True)
    checkpointer.wait_until_finished()
    (out / "config.yaml").write_text(config_lib.dump(config))
    return out


def exported_config(path: str | Path) -> config_lib.Config:
    path = Path(path)
    if not (path / "config.yaml").is_file() or not (path / "params").is_dir():
        raise CheckpointError(f"{path} is not an exported checkpoint (it needs config.yaml and "
                              "params/); create one with python -m jaxtron.export or "
                              "python -m jaxtron.convert.")
    return config_lib.from_dict(yaml.safe_load((path / "config.yaml").read_text()))


def load_params(path: str | Path, trainer) -> nnx.State:
    """Parameters of an exported checkpoint, placed with `trainer`'s shardings (model layout)."""
    path = Path(path).absolute()
    check_compatible(config_lib.to_dict(exported_config(path)), trainer.config, path)
    params = trainer.abstract_canonical_state().params
    target = nnx.to_pure_dict(params)
    try:
        restored = ocp.StandardCheckpointer().restore(path / "params", target)
    except Exception as err:
        raise CheckpointError(f"the parameters in {path / 'params'} could not be read "
                              f"({type(err).__name__}: {str(err)[:300]}); re-export them.") from None
    nnx.replace_by_pure_dict(params, restored)
    return params


@exits_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtron.export",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="run directory of a training run")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--format", choices=("orbax", "hf"), default="orbax")
    parser.add_argument("--step", type=int, help="checkpoint step (default: newest)")
    args = parser.parse_args(argv)
    config, params = load_training_params(args.checkpoint, args.step)
    if args.format == "orbax":
        out = save_params(args.out, config, params)
    else:
        from jaxtron import hf
        hf_config, tensors = hf.to_hf(config, params)
        hf.save_hf_dir(args.out, hf_config, tensors)
        out = Path(args.out)
    print(f"exported {args.format} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
