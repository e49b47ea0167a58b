"""Orbax checkpoints that resume exactly and restore onto any mesh.

A checkpoint (one folder per step under `<train.run_dir>/checkpoints`) holds the train state
(parameters, optimizer state, step) in the model's own layout, the grain iterator state, and
the resolved config. Saves are asynchronous: the arrays are copied to host, then written by a
background thread while training continues. Orbax writes into a temporary folder and renames
it when complete, so a crash in the middle of a save leaves the previous checkpoint as the
newest readable one.

Restoring reads the arrays straight into the shardings of the current mesh (Orbax reshards on
load), so a checkpoint written under one layout continues under any other.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import type_handler_registry

from jaxtron import config as config_lib
from jaxtron.errors import JaxtronError

# Fields that change the shape or meaning of the parameters: a mismatch cannot be restored.
MODEL_FIELDS = ("type", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
                "mlp_dim", "vocab_size", "max_seq_len", "param_dtype")
MOE_FIELDS = ("num_experts", "expert_mlp_dim", "every", "shared_experts")


class CheckpointError(JaxtronError):
    """A checkpoint that is missing, unreadable or written for another model."""


def write_each_array_from_one_replica() -> None:
    """Orbax's default on CPU splits a replicated array among its replicas, so that hosts share
    the writing. Simulated CPU devices live in one process and one memory, so the split only
    adds a device slicing program per array shape: about 4 s of compiles at a run's first save
    of a small model. (Orbax already makes this choice on GPU.)"""
    registry = type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY
    if getattr(registry.get(jax.Array), "_use_replica_parallel", False):
        handler = ocp.type_handlers.ArrayHandler(
            array_metadata_store=array_metadata_store.Store(), use_replica_parallel=False)
        registry.add(jax.Array, handler, override=True, ignore_warnings=True)


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int, *, read_only: bool = False):
        self.directory = Path(directory).absolute()
        if jax.process_count() == 1 and jax.default_backend() == "cpu":
            write_each_array_from_one_replica()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                               read_only=read_only,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict, config: config_lib.Config) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state),
                                  config=ocp.args.JsonSave(config_lib.to_dict(config)))
        self.manager.save(step, args=args, force=True)

    def saved_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore()))["config"]

    def restore(self, step: int, abstract_state, config: config_lib.Config):
        """-> (state, data_state), the state placed as `abstract_state`'s shardings say."""
        check_compatible(self.saved_config(step), config, self.directory / str(step))
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except Exception as err:  # Orbax raises many types for damaged files
            raise CheckpointError(
                f"the checkpoint at {self.directory / str(step)} could not be read ({type(err).__name__}: "
                f"{str(err)[:300]}); it is damaged or incomplete. Delete that folder to resume "
                "from the previous checkpoint, or set train.resume=never to start afresh.") from None
        return restored["state"], restored["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def check_compatible(saved: dict, config: config_lib.Config, where: Path) -> None:
    """Name every model field whose saved value differs from the current config."""
    current = config_lib.to_dict(config)
    diffs = [f"model.{k}: checkpoint {saved['model'].get(k)!r}, config "
             f"{current['model'][k]!r}" for k in MODEL_FIELDS
             if saved.get("model", {}).get(k) != current["model"][k]]
    diffs += [f"moe.{k}: checkpoint {saved.get('moe', {}).get(k)!r}, config "
              f"{current['moe'][k]!r}" for k in MOE_FIELDS
              if saved.get("moe", {}).get(k, current["moe"][k]) != current["moe"][k]]
    if diffs:
        raise CheckpointError(
            f"the checkpoint at {where} was written for a different model ({'; '.join(diffs)}). "
            "Use the same model settings as the checkpoint, or point train.run_dir at a new "
            "folder (or set train.resume=never) to start a new run.")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"

