"""Orbax checkpoints that resume exactly and restore onto any mesh.

A checkpoint (one folder per step under `<train.run_dir>/checkpoints`) holds the train state
(parameters, optimizer state, step) in the model's own layout, the grain iterator state, and
the resolved config. Saves are asynchronous: the arrays are copied to host, then written by a
background thread while training continues. Orbax writes into a temporary folder and renames
it when complete, so a crash in the middle of a save leaves the previous checkpoint as the
newest readable one.

Restoring reads the arrays straight into the shardings of the current mesh (Orbax reshards on
load), so a checkpoint written under one layout continues under any other.

Integrity. Each checkpoint also holds the content fingerprints of its state
(`jaxtron.checkpoint.fingerprint`), recomputed and compared on restore: flipped bytes or a truncated file
are found, not trained on. A newest checkpoint that cannot be read or does not match falls back
to the previous good one with a note, and is renamed `<step>.damaged` (kept for inspection). A save is refused before it starts when the folder lacks
the space for it, and a background write that fails (a disk filling up meanwhile) is reported
at the next step, not at the next save; either way the earlier checkpoints stay as they were.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import struct
from jax.experimental import multihost_utils
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import type_handler_registry

from jaxtron.checkpoint.fingerprint import fingerprints
from jaxtron.config.loading import config_to_dict
from jaxtron.config.schema import Config
from jaxtron.errors import JaxtronError
from jaxtron.runtime.run_dir import cannot_write

# Fields that change the shape or meaning of the parameters: a mismatch cannot be restored.
MODEL_FIELDS = ("type", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
                "mlp_dim", "vocab_size", "max_seq_len", "param_dtype", "mtp_depth", "qkv_bias",
                "qk_norm", "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim")
MOE_FIELDS = ("num_experts", "expert_mlp_dim", "every", "shared_experts", "first_dense_layers")


def _tied(model: dict) -> bool:
    """`model.tie_embeddings` resolved as the model does (null: gpt2 ties, llama does not)."""
    tie = model.get("tie_embeddings")
    return model.get("type") == "gpt2" if tie is None else bool(tie)


# Settings that shape the rest of a train state (the optimizer's arrays and their dtypes, the
# routing biases): (section, field, how a value reads for the comparison).
STATE_FIELDS = (("optim", "name", str), ("optim", "moment_dtype", str),
                ("optim", "grad_clip", lambda v: "on" if v and v > 0 else "off (0)"),
                ("moe", "bias_update_rate", lambda v: "on" if v and v > 0 else "off (0)"))


@struct.dataclass
class SavedParams:
    """The part of a saved train state that export and generation read."""
    params: Any


class CheckpointError(JaxtronError):
    """A checkpoint that is missing, unreadable or written for another model."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read, or do not hold what was saved."""


def _everywhere(ok: bool) -> bool:
    """Whether `ok` holds in every process (the same answer everywhere)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


def _check_same_arrays(saved: dict, abstract_state, where: Path, subset: bool = False) -> None:
    """The checkpoint's arrays (named by its fingerprints) against this run's state: a
    different set means different settings, not damage. `subset`: the state asked for is part
    of what was saved (the parameters alone)."""
    if not isinstance(saved, dict):
        raise DamagedCheckpoint(f"the fingerprints in {where / 'checksums'} are not a JSON "
                                "object: the checkpoint is damaged; delete that folder, or set "
                                "train.resume=archive to start afresh.")
    paths = {jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_leaves_with_path(abstract_state)}
    if (paths - set(saved)) if subset else (set(saved) != paths):
        extra, missing = sorted(set(saved) - paths), sorted(paths - set(saved))
        raise CheckpointError(
            f"the checkpoint at {where} holds a different train state ({len(extra)} arrays "
            f"this run lacks, e.g. {extra[:1]}; {len(missing)} it lacks, e.g. {missing[:1]}): "
            "it was saved by another version or with other settings; use the settings it was "
            "saved with, or point train.run_dir at a new folder.")


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
        self.read_only = read_only
        if not read_only:
            why = ("it is a file, not a folder" if self.directory.exists()
                   and not self.directory.is_dir() else cannot_write(self.directory))
            if why:
                raise CheckpointError(f"checkpoints cannot be written to {self.directory} "
                                      f"({why}); move what is there away, or point "
                                      "train.run_dir at another folder.")
        if jax.process_count() == 1 and jax.default_backend() == "cpu":
            write_each_array_from_one_replica()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                               read_only=read_only,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._in_flight = None  # the step of the newest save started

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict, config: Config) -> None:
        self.check()
        self._check_space(step, state)
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state),
                                  config=ocp.args.JsonSave(config_to_dict(config)),
                                  checksums=ocp.args.JsonSave(fingerprints(state)))
        try:
            self.manager.save(step, args=args, force=True)
        except Exception as err:  # the previous save's background failure, or this one's start
            raise self._save_failed(err) from None
        self._in_flight = step

    def check(self) -> None:
        """Raise CheckpointError if a background save has failed since the last call."""
        try:
            self.manager.check_for_errors()
        except Exception as err:
            raise self._save_failed(err) from None

    def _check_space(self, step: int, state) -> None:
        needed = sum(x.nbytes for x in jax.tree.leaves(state)) // jax.process_count()
        free = shutil.disk_usage(self.directory).free
        if free < needed * 1.05 + 2**20:
            raise CheckpointError(
                f"checkpoint step {step} needs about {needed / 2**20:,.1f} MiB in "
                f"{self.directory}, but only {free / 2**20:,.1f} MiB are free; free space there "
                f"or point train.run_dir at a larger disk. {self._intact()}")

    def _intact(self, failed: int | None = None) -> str:
        """The sentence naming the newest checkpoint a resume would use. The manager lists a
        step from the moment its save starts, so a `failed` one is left out."""
        latest = max((s for s in self.manager.all_steps() if s != failed), default=None)
        return (f"The previous checkpoint, step {latest}, is intact." if latest is not None
                else "No checkpoint had been written.")

    def _save_failed(self, err) -> CheckpointError:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        try:
            free = f"{shutil.disk_usage(self.directory).free / 2**20:,.1f} MiB are"
        except OSError:
            free = "no space is"  # the folder itself is gone
        step = self._in_flight
        which = f"checkpoint step {step}" if step is not None else "a checkpoint"
        error = CheckpointError(
            f"writing {which} to {self.directory} failed ({type(err).__name__}: {first}); "
            f"{free} free there. Free space or fix the folder, then run "
            f"the same command to resume. {self._intact(failed=step)}")
        error.from_background = True  # the write's threads report too: let them finish first
        return error

    def saved_config(self, step: int) -> dict:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(
                config=ocp.args.JsonRestore()))["config"]
        except Exception as err:
            raise DamagedCheckpoint(
                f"the checkpoint at {self.directory / str(step)} has no readable config "
                f"({type(err).__name__}); it is damaged or was not written by jaxtron: use "
                "another step or run directory.") from None

    def restore(self, step: int, abstract_state, config: Config):
        """-> (state, data_state), the state placed as `abstract_state`'s shardings say, after
        checking its fingerprints against those saved with it."""
        restored = self._verified(step, config, abstract_state, {
            "state": ocp.args.StandardRestore(abstract_state), "data": ocp.args.JsonRestore()})
        return restored["state"], restored["data"]

    def restore_params(self, step: int, abstract_params, config: Config):
        """The parameters alone (no optimizer state), placed as `abstract_params` says and
        checked against their fingerprints: what export and generation read."""
        target = SavedParams(params=abstract_params)
        placement = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), target)
        return self._verified(step, config, target, {"state": ocp.args.PyTreeRestore(
            target, restore_args=placement, partial_restore=True)}, subset=True)["state"].params

    def _verified(self, step: int, config: Config, target, items: dict, subset: bool = False):
        """Read `items` of `step` after checking the checkpoint fits `config`, and check the
        state read back against the fingerprints saved with it."""
        where = self.directory / str(step)
        saved_config = self.saved_config(step)
        check_compatible(saved_config, config, where)
        if not subset:  # the whole state: its optimizer's arrays must be this config's too
            check_same_state(saved_config, config, where)
            _check_same_fp8_state(saved_config, config, where)
        verified = (where / "checksums").exists()  # checkpoints of earlier versions have none
        saved = self._read(step, where, checksums=ocp.args.JsonRestore())["checksums"] \
            if verified else None
        if verified:
            _check_same_arrays(saved, target, where, subset)
        restored = self._read(step, where, **items)
        now = fingerprints(restored["state"]) if verified else {}
        bad = sorted(k for k in now if saved.get(k) != now[k])
        if bad:
            raise DamagedCheckpoint(
                f"the checkpoint at {where} does not hold what was saved: {len(bad)} arrays "
                f"differ from their fingerprints ({', '.join(bad[:3])}); the files are "
                "damaged: delete that folder, or set train.resume=archive to start afresh.")
        return restored

    def _read(self, step: int, where: Path, **items):
        try:
            return self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as err:  # Orbax raises many types for damaged files
            raise DamagedCheckpoint(
                f"the checkpoint at {where} could not be read ({type(err).__name__}: "
                f"{str(err)[:200]}); it is damaged or incomplete: delete that folder, or set "
                "train.resume=archive to start afresh.") from None

    def restore_newest_good(self, abstract_state, config: Config):
        """-> (step, state, data_state) of the newest checkpoint that reads back intact in
        every process, or None when there is none. A damaged one is skipped with a note and
        set aside; one written for another model or optimizer stops the run instead."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        problems = []
        for step in steps:
            try:
                state, data = self.restore(step, abstract_state, config)
                problem = None
            except DamagedCheckpoint as err:
                problem = str(err)
            if not _everywhere(problem is None):  # one host's bad read counts for all
                problems.append(problem or f"another process could not read step {step}")
                print(f"note: skipping a damaged checkpoint: {problems[-1]}", flush=True)
                continue
            self._set_aside(steps[:len(problems)])
            return step, state, data
        if problems:
            raise CheckpointError(
                f"none of the {len(steps)} checkpoints in {self.directory} reads back intact "
                f"(newest: {problems[0][:300]}); set train.resume=archive to keep them aside "
                "and start afresh.")
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Rename damaged step folders to `<step>.damaged`: kept for inspection, out of the
        way of the steps the resumed run will save again. Every process gets the same `steps`
        (the damage is agreed), so all of them reach the barrier."""
        if not steps or self.read_only:  # a reader (export, generate) changes nothing
            return
        if jax.process_index() == 0:
            for step in steps:
                target = self.directory / f"{step}.damaged"
                suffix = 1
                while target.exists():
                    target, suffix = self.directory / f"{step}.damaged-{suffix}", suffix + 1
                (self.directory / str(step)).rename(target)
                print(f"note: moved the damaged checkpoint to {target}", flush=True)
        if jax.process_count() > 1:
                    multihost_utils.sync_global_devices("jaxtron: damaged checkpoints set aside")
        self.manager.reload()

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as err:
            raise self._save_failed(err) from None

    def close(self) -> None:
        self.manager.close()


def check_compatible(saved: dict, config: Config, where: Path) -> None:
    """Name every model field whose saved value differs from the current config."""
    current = config_to_dict(config)
    saved = saved if isinstance(saved, dict) else {}
    diffs = [f"model.{k}: checkpoint {saved.get('model', {}).get(k)!r}, config "
             f"{current['model'][k]!r}" for k in MODEL_FIELDS
             if saved.get("model", {}).get(k) != current["model"][k]]
    diffs += [f"moe.{k}: checkpoint {saved.get('moe', {}).get(k)!r}, config "
              f"{current['moe'][k]!r}" for k in MOE_FIELDS
              if saved.get("moe", {}).get(k, current["moe"][k]) != current["moe"][k]]
    if _tied(saved.get("model", {})) != _tied(current["model"]):
        diffs.append(f"model.tie_embeddings: checkpoint {_tied(saved.get('model', {}))}, "
                     f"config {_tied(current['model'])}")
    if diffs:
        raise CheckpointError(
            f"the checkpoint at {where} was written for a different model ({'; '.join(diffs)}). "
            "Use the same model settings as the checkpoint, or point train.run_dir at a new "
            "folder (or set train.resume=never) to start a new run.")


def check_same_state(saved: dict, config: Config, where: Path) -> None:
    """Name every setting whose saved value gives the train state other arrays than the
    current config does (the checkpoint reads back under its own settings)."""
    current = config_to_dict(config)
    saved = saved if isinstance(saved, dict) else {}
    diffs = []
    for section, name, shown in STATE_FIELDS:
        before = shown(saved.get(section, {}).get(name, current[section][name]))
        now = shown(current[section][name])
        if before != now:
            diffs.append(f"{section}.{name}: checkpoint {before}, config {now}")
    if diffs:
        raise CheckpointError(
            f"the checkpoint at {where} holds the state of other settings ({'; '.join(diffs)}); "
            "resume with the checkpoint's settings, or start from its weights with python -m "
            "jaxtron.export and train.init_from, or point train.run_dir at a new folder.")


def _check_same_fp8_state(saved: dict, config: Config, where: Path) -> None:
    """Delayed fp8 scaling keeps amax histories in the training state; a run can switch
    between the other modes freely, but not into or out of `delayed`."""
    before = (saved.get("model", {}) if isinstance(saved, dict) else {}).get("fp8", "none")
    if (before == "delayed") != (config.model.fp8 == "delayed"):
        raise CheckpointError(
            f"the checkpoint at {where} was written with model.fp8={before} and the config "
            f"says model.fp8={config.model.fp8}; delayed scaling's amax histories are part of "
            "the training state, so resume with the checkpoint's model.fp8, or start from its "
            "weights with python -m jaxtron.export and train.init_from.")


def saved_steps(directory: Path) -> list[int]:
    """The finished checkpoint steps in `directory`, read from the folder names alone."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"

