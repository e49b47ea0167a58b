"""Parameters-only checkpoints, and the parameters of any checkpoint: what export, generation
and fine-tuning read.

A parameters-only checkpoint (`python -m jaxtron.export --format orbax`, `jaxtron.convert`)
is a folder with `params/` (Orbax, the model's own layout) and the resolved `config.yaml`: it
restores on one device with no mesh (`orbax.checkpoint.StandardCheckpointer().restore(OUT /
"params")`). A training run's checkpoint holds the whole train state; reading its parameters
restores that part alone (no optimizer state is built or read), checked against the
fingerprints saved with it like any restore.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxtron.checkpoint.manager import (
    Checkpointer,
    CheckpointError,
    DamagedCheckpoint,
    check_compatible,
    checkpoint_dir,
)
from jaxtron.config.loading import (
    config_from_dict,
    config_to_dict,
    dump_config,
    single_device_config,
)
from jaxtron.config.schema import Config
from jaxtron.kernels import fp8
from jaxtron.models.transformer import Transformer
from jaxtron.runtime.run_dir import cannot_write


def abstract_params(config: Config, device=None) -> nnx.State:
    """The model's parameters as shapes and dtypes on one device (nothing allocated)."""
    model = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0), moe=config.moe))
    sharding = SingleDeviceSharding(device or jax.devices()[0])
    params = nnx.state(model, nnx.Param)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        params)


def read_model(path: str | Path, step: int | None = None) -> tuple[Config, Transformer]:
    """-> (config, the NNX model on one device) from any checkpoint (see `read_params`)."""
    config, pure = read_params(path, step)
    graphdef = nnx.graphdef(nnx.eval_shape(
        lambda: Transformer(config.model, rngs=nnx.Rngs(0), moe=config.moe)))
    params = abstract_params(config)
    nnx.replace_by_pure_dict(params, pure)
    return config, nnx.merge(graphdef, params)


def read_params(path: str | Path, step: int | None = None) -> tuple[Config, dict]:
    """-> (the model's config on one device, its parameters as a pure dict on one device) from
    a run directory (its newest checkpoint that reads back intact, or `step`) or an
    export/convert output."""
    path = Path(path)
    if (path / "params").is_dir():
        if step is not None:
            raise CheckpointError(f"{path} is a parameters-only checkpoint with one state; "
                                  "leave out --step, or pass a run directory.")
        config = single_device_config(exported_config(path))
        return config, nnx.to_pure_dict(load_exported_params(path, abstract_params(config),
                                                             config))
    if checkpoint_dir(path).is_dir():
        return _read_run_params(path, step)
    raise CheckpointError(f"{path} is not a jaxtron checkpoint: pass a training run directory "
                          "(it holds checkpoints/) or the output of python -m jaxtron.export or "
                          "python -m jaxtron.convert (it holds params/ and config.yaml).")


def _read_run_params(run_dir: Path, step: int | None) -> tuple[Config, dict]:
    directory = checkpoint_dir(run_dir)
    checkpoints = Checkpointer(directory, keep=1, read_only=True)
    steps = sorted(checkpoints.manager.all_steps(), reverse=True)
    if not steps:
        raise CheckpointError(f"{directory} holds no checkpoint; pass a run directory that "
                              "has trained (runs save a checkpoint at their last step).")
    if step is not None and step not in steps:
        raise CheckpointError(f"--step {step} was never saved in {directory}; choose one of "
                              f"{', '.join(map(str, sorted(steps)[-10:]))}.")
    problems = []
    for candidate in [step] if step is not None else steps:
        try:
            config = single_device_config(config_from_dict(checkpoints.saved_config(candidate)))
            params = checkpoints.restore_params(candidate, abstract_params(config), config)
            return config, nnx.to_pure_dict(params)
        except DamagedCheckpoint as err:
            if step is not None:
                raise
            problems.append(str(err))
            print(f"note: skipping a damaged checkpoint: {err}", flush=True)
    raise CheckpointError(f"none of the {len(steps)} checkpoints in {directory} reads back "
                          f"intact (newest: {problems[0][:300]}); pass another run directory "
                          "or an export of this model.")


def save_params(out: str | Path, config: Config, params_pure: dict,
                overwrite: bool = False) -> Path:
    out = output_dir(out, overwrite)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / "params", weights_only(params_pure), force=True)
    checkpointer.wait_until_finished()
    (out / "config.yaml").write_text(dump_config(config))
    return out


# What an export leaves in its folder: a parameters-only checkpoint, or a Hugging Face one.
EXPORT_FILES = ("params", "config.yaml", "config.json", "model.safetensors",
                "model.safetensors.index.json")


def output_dir(out: str | Path, overwrite: bool = False) -> Path:
    """`out`, empty and writable, for an export (`check_output_dir`); an earlier export in it
    is removed first with `overwrite`, so no shard of the old one stays beside the new."""
    out = Path(out).absolute()
    for name in check_output_dir(out, overwrite):
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    why = cannot_write(out)
    if why:
        raise CheckpointError(f"--out {out} cannot be written ({why}); choose a folder you "
                              "can write to.")
    return out


def check_output_dir(out: str | Path, overwrite: bool = False) -> list[str]:
    """CheckpointError unless an export may go into `out`: never a training run's folder,
    never one that holds other files, and one that holds an earlier export only with
    `overwrite`. -> what an overwrite replaces (nothing changes here)."""
    out = Path(out).absolute()
    if checkpoint_dir(out).is_dir():
        raise CheckpointError(f"--out {out} is a training run's folder (it holds "
                              "checkpoints/); export into a folder of its own, e.g. "
                              f"{out.parent / (out.name + '-export')}.")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        earlier = all(name in EXPORT_FILES or name.startswith("model-") for name in held)
        if not earlier:
            raise CheckpointError(f"--out {out} holds other files ({', '.join(held[:3])}); "
                                  "choose an empty or new folder.")
        if not overwrite:
            raise CheckpointError(f"--out {out} holds an earlier export; add --overwrite to "
                                  "replace it, or choose a new folder.")
    return held


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


def load_exported_params(path: str | Path, abstract: nnx.State, config: Config) -> nnx.State:
    """Parameters of an exported checkpoint for a model of `config`, placed as `abstract` (the
    model's parameters as shapes with shardings) says."""
    path = Path(path).absolute()
    check_compatible(config_to_dict(exported_config(path)), config, path)
    params = jax.tree.map(lambda a: a, abstract)  # a copy: `abstract` stays abstract
    target = nnx.to_pure_dict(params)
    try:
        restored = ocp.StandardCheckpointer().restore(path / "params", weights_only(target))
    except Exception as err:
        raise CheckpointError(f"the parameters in {path / 'params'} could not be read "
                              f"({type(err).__name__}: {str(err)[:300]}); export them again."
                              ) from None
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
