"""Train a transformer from one YAML config.

    python -m jaxtron.train --config configs/tiny.yaml [section.key=value ...]

Writes <train.run_dir>/config.yaml (the resolved config) and metrics.jsonl (one JSON object per
logged step: step, loss, lr, grad_norm, tokens_per_s, mfu, data_wait_s (seconds per step spent
waiting for the input pipeline), eval_loss where evaluated (and eval_loss/<source> for a blend),
and for mixture-of-experts models moe_balance, moe_z, moe_dropped, moe_max_load), shows
a progress line every `train.log_every` steps and ends with a one-line summary. Metrics are read
one step late, so the host never waits on the step it just dispatched.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtron.config.checks import config_warnings
from jaxtron.config.loading import dump_config, format_field_reference, load_config
from jaxtron.config.schema import Config
from jaxtron.runtime.host_memory import keep_freed_host_memory
from jaxtron.runtime import distributed
from jaxtron.training.dry_run import dry_run
from jaxtron.checkpoint.cadence import AutoCadence
from jaxtron.training.fits import check_fits
from jaxtron.kernels import fp8
from jaxtron.training.loop_policy import LoopPolicy
from jaxtron.runtime.metrics import MetricsLog, Reporter
from jaxtron.errors import ConfigError, JaxtronError, exit_command, exits_on_user_error
from jaxtron.config.platforms import PLATFORMS, simulate_cpu_devices
from jaxtron.runtime.preemption import PreemptionGuard
from jaxtron.runtime.profiling import StepProfiler, plot_loss_curve
from jaxtron.runtime.run_dir import RunDirError, clear_previous_run, locked, previous_run
from jaxtron.training.flops import peak_flops, training_flops_per_token
from jaxtron.sharding.mesh import describe_mesh


class NonFiniteError(JaxtronError):
    """Training produced a NaN or Inf under train.on_nan=stop."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxtron.train", description="Train a transformer from a YAML config.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Config fields (key, type, default, meaning); set any in the YAML file or as an "
               "override\nsection.key=value, e.g. train.steps=50 model.num_layers=4:\n\n"
               + format_field_reference())
    parser.add_argument("--config", help="YAML config file, e.g. configs/tiny.yaml")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="build one step from abstract shapes, print the mesh, attention "
                             "kernel, parameter shardings and per-device memory, and exit "
                             "without training")
    parser.add_argument("--target", choices=PLATFORMS,
                        help="with --dry-run: the platform to check for (default: this "
                             "machine's); another one is lowered, not compiled, so a GPU or "
                             "TPU config is checked on a CPU machine")
    parser.add_argument("--devices", type=int,
                        help="with --dry-run: build the mesh from this many simulated CPU "
                             "devices (must be the first use of JAX in the process)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser


def run(config: Config) -> dict:
    """Train `config` to the end (or to a preemption signal); return the final summary."""
    run_dir = Path(config.train.run_dir)
    with contextlib.ExitStack() as held:
        problem = None
        if jax.process_index() == 0:
            try:
                held.enter_context(locked(run_dir))
                _settle_previous_run(config, run_dir)
            except Exception as err:  # any failure: the other processes must hear of it
                problem = err
        if jax.process_count() > 1:
            # Every process learns whether process 0 could take the folder: none is left
            # waiting in a collective for a process that stopped.
            ready = multihost_utils.broadcast_one_to_all(np.int32(problem is None))
            if not ready and problem is None:
                raise RunDirError(f"process 0 could not start the run in train.run_dir="
                                  f"{run_dir}; its log names the reason: fix that and relaunch "
                                  "every process.")
        if problem is not None:
            raise problem
        return _run(config, run_dir)


def _run(c: Config, run_dir: Path) -> dict:
    from jaxtron.checkpoint.manager import Checkpointer, checkpoint_dir
    from jaxtron.data.pipeline import eval_batches, open_sources, train_batches
    from jaxtron.training.trainer import Trainer

    is_main = jax.process_index() == 0
    sources = open_sources(c)
    trainer = Trainer(c)
    check_fits(trainer)
    rows = trainer.local_rows()
    batches = train_batches(c, sources, rows)
    held_out = eval_batches(c, sources, rows)
    if is_main:
        (run_dir / "config.yaml").write_text(dump_config(c))
    checkpoints = Checkpointer(checkpoint_dir(run_dir), c.checkpoint.keep)
    state, resumed_from = _initial_state(trainer, checkpoints, batches)
    start = int(jax.device_get(state.step))

    tokens_per_step = c.train.batch_size * c.data.seq_len
    flops_per_step = training_flops_per_token(c.model, c.data.seq_len, c.moe) * tokens_per_step
    peak, peak_source = peak_flops(jax.devices())
    log = MetricsLog(run_dir, c.train.steps, enabled=is_main, start=start,
                     tensorboard=c.train.tensorboard)
    if is_main:
        n_params = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(state.params)
                       if not fp8.is_history(path))  # delayed fp8's amax histories aren't weights
        print(f"jaxtron: {c.model.type} model, {n_params:,} parameters, "
              f"{describe_mesh(trainer.mesh)}, compute {trainer.config.model.dtype}, "
              f"{describe_sources(sources)}; peak {peak / 1e9:,.1f} "
              f"GFLOP/s ({peak_source})", flush=True)
        if resumed_from is not None:
            print(f"resumed from {resumed_from} at step {start}", flush=True)
    if start >= c.train.steps:
        if is_main:
            print(f"nothing to do: the checkpoint is at step {start} >= train.steps",
                  flush=True)
        log.close()
        return {"steps": start, "run_dir": str(run_dir)}

    compile_start = time.perf_counter()
    batch = trainer.put_batch(next(batches))
    compiled = trainer.compile_step(state, batch)
    if is_main:
        library = " (matmuls on oneDNN)" if trainer.compiler_options else ""
        print(f"compiled the train step in {time.perf_counter() - compile_start:.1f} s"
              f"{library}; run dir {run_dir}", flush=True)

    policy = LoopPolicy.from_config(c)
    cadence = AutoCadence(start, c.checkpoint.mtbf_hours) if c.checkpoint.every == "auto" else None
    watch = NonFiniteWatch(c, checkpoints, state)
    reporter = Reporter(log, start, flops_per_step, tokens_per_step, peak)
    profiler = StepProfiler(run_dir, c.train.profile_steps, enabled=is_main)
    step = start
    with PreemptionGuard() as guard, _finishing(checkpoints, profiler, log):
        for step in range(start + 1, c.train.steps + 1):
            profiler.before(step)
            state, metrics = compiled(state, batch)
            profiler.after(step, metrics)
            log.advance()
            data_state = batches.get_state()  # the stream position after this step's batch
            wait = 0.0
            if step < c.train.steps:
                wait_start = time.perf_counter()
                host_batch = next(batches)  # read ahead by data.workers: ~0 s when keeping up
                wait = time.perf_counter() - wait_start
                batch = trainer.put_batch(host_batch)  # overlaps with the running step
            watch.check(reporter.flush())  # the previous step's row
            reporter.add_data_wait(wait)  # counted in this step's row
            checkpoints.check()  # a background save that failed stops the run now
            act = policy.after(step, guard.stop_requested(step))
            eval_losses = None
            if act.evaluate:
                jax.block_until_ready(metrics)  # the step's own time stays in the window
                eval_start = time.perf_counter()
                eval_losses = evaluate(trainer, state, held_out, sources)
                reporter.add_eval_time(time.perf_counter() - eval_start)
            if act.log:
                reporter.hold(step, metrics, eval_losses)
            if cadence:
                cadence.step_ended(step)
            measure = cadence is not None and cadence.measure_now(step)
            if act.save or measure:  # never save past a bad step, logged or not
                watch.check(reporter.flush() or _unlogged(step, metrics))
                save_start = time.perf_counter()
                checkpoints.save(step, trainer.canonical_state(state), data_state, c)
                if measure:
                    note = cadence.decide(step, time.perf_counter() - save_start)
                    policy = dataclasses.replace(policy, checkpoint_every=cadence.interval)
                    if is_main:
                        print(note, flush=True)
            if act.stop:
                break
        watch.check(reporter.flush())
    last = reporter.last
    if is_main:
        plot_loss_curve(run_dir)
    preempted = step < c.train.steps
    if preempted and is_main:
        print(f"preempted: saved step {step} to {checkpoints.directory / str(step)}; run the "
              "same command again to resume", flush=True)
    summary = {"steps": step, "final_loss": last["loss"],
               "eval_loss": last.get("eval_loss"), "tokens_per_s": last["tokens_per_s"],
               "mfu": last["mfu"], "run_dir": str(run_dir), "preempted": preempted}
    if is_main and not preempted:
        eval_text = f"{summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else "-"
        print(f"done: {summary['steps']} steps | final loss {summary['final_loss']:.4f} | "
              f"eval loss {eval_text} | {summary['tokens_per_s']:,.0f} tok/s | "
              f"mfu {100 * summary['mfu']:.2f}% | checkpoint "
              f"{checkpoints.directory / str(step)} | metrics in {run_dir / 'metrics.jsonl'}",
              flush=True)
    return summary


def describe_sources(sources) -> str:
    if len(sources) == 1:
        dataset = sources[0].dataset
        return f"{dataset.tokens.size:,} tokens in {dataset.prefix}"
    total = sum(s.weight for s in sources)
    return "blend of " + ", ".join(f"{s.label} {s.weight / total:.0%} "
                                   f"({s.dataset.tokens.size:,} tokens)" for s in sources)


def evaluate(trainer, state, held_out, sources) -> dict:
    """{"eval_loss": ...} and, for a blend, each source's `eval_loss/<label>`; the blend's
    loss is the weighted mean of its sources' (what the training mixture is expected to see)."""
    per_source = {}
    for label, batches in held_out:
        losses, counted = [], []
        for host_batch in batches:
            batch = trainer.put_batch(host_batch)
            losses.append(trainer.eval_loss(state, batch))
            # Each batch's loss is its mean over counted targets (over every host's rows):
            # weight it by their number, so the source's loss is the mean over its tokens.
            counted.append(jax.numpy.sum(batch["loss_mask"]) if "loss_mask" in batch else 1.0)
        losses, counted = np.asarray(jax.device_get(losses)), np.asarray(jax.device_get(counted))
        per_source[label] = float(np.dot(losses, counted) / max(counted.sum(), 1.0))
    if len(sources) == 1:
        return {"eval_loss": per_source[sources[0].label]}
    total = sum(s.weight for s in sources)
    result = {"eval_loss": sum(s.weight * per_source[s.label] for s in sources) / total}
    result.update({f"eval_loss/{label}": loss for label, loss in per_source.items()})
    return result


@contextlib.contextmanager
def _finishing(checkpoints, profiler, log):
    """Let pending asynchronous saves complete and close an open trace and the log, whether
    the loop ends or raises."""
    try:
        yield
    finally:
        profiler.stop()
        log.close()
        try:
            checkpoints.wait()
        finally:  # a failed save raises here; Orbax's threads must still shut down cleanly
            checkpoints.close()
    checkpoints.check()


def _settle_previous_run(c: Config, run_dir: Path) -> None:
    """train.resume=never/archive/overwrite against what a previous run left here. Process 0
    alone runs this, so it reads the folder without Orbax (whose manager synchronises every
    process when created)."""
    from jaxtron.checkpoint.manager import checkpoint_dir, saved_steps

    if c.train.resume == "auto":
        return
    steps = saved_steps(checkpoint_dir(run_dir))
    found = previous_run(run_dir, steps[-1] if steps else None)
    if found:
        clear_previous_run(run_dir, c.train.resume, found)


def _initial_state(trainer, checkpoints, batches):
    """Resume from the newest good checkpoint, start from `train.init_from`, or initialise."""
    c = trainer.config
    found = checkpoints.restore_newest_good(trainer.abstract_canonical_state(), c)
    if found is not None:
        step, canonical, data_state = found
        batches.set_state(data_state)
        return trainer.from_canonical_state(canonical), checkpoints.directory / str(step)
    state = trainer.init_state()
    if c.train.init_from:
        from jaxtron.export import load_params
        state = trainer.with_params(state, load_params(c.train.init_from, trainer))
    return state, None


def _unlogged(step: int, metrics) -> dict:
    """The values a finiteness check needs from a step that writes no metrics row."""
    values = jax.device_get(metrics)
    return {"step": step, "loss": float(values["loss"]), "grad_norm": float(values["grad_norm"]),
            "skipped_updates": int(values.get("skipped_updates", 0))}


class NonFiniteWatch:
    """train.on_nan=stop: end the run at a non-finite loss or gradient, or at an update the
    optimizer skipped since the previous check. The optimizer's skip count is cumulative and
    lives in the checkpoint, so it is compared with the last value seen, not with zero: a run
    resumed from a checkpoint with earlier skips (under on_nan=skip) is not stopped for them."""

    def __init__(self, config: Config, checkpoints, state):
        import optax

        self.config, self.checkpoints = config, checkpoints
        self.skipped = int(jax.device_get(optax.tree_utils.tree_get(state.opt_state,
                                                                    "total_notfinite")))

    def check(self, record: dict | None) -> None:
        if record is None:
            return
        skipped, self.skipped = record.get("skipped_updates", 0) > self.skipped, max(
            self.skipped, record.get("skipped_updates", 0))
        bad = not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]))
        if self.config.train.on_nan != "stop" or not (bad or skipped):
            return
        latest = self.checkpoints.latest_step()
        where = (f"the last checkpoint, step {latest} in {self.checkpoints.directory}, is intact"
                 if latest is not None else "no checkpoint had been written")
        raise NonFiniteError(
            f"a non-finite loss or gradient appeared at or before step {record['step']} "
            f"(loss {record['loss']}, grad_norm {record['grad_norm']}); the update was not "
            f"applied and {where}. Lower optim.lr, raise optim.warmup_steps, or set "
            "train.on_nan=skip to skip such updates.")


@exits_on_user_error
def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    keep_freed_host_memory()  # before JAX starts its threads
    config = load_config(args.config, args.overrides)
    if args.print_config:
        print(dump_config(config), end="")
        return 0
    if (args.target or args.devices) and not args.dry_run:
        raise ConfigError("--target and --devices only apply to a check; add --dry-run.")
    if args.devices:
        simulate_cpu_devices(args.devices)
    for warning in config_warnings(config):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    launch = distributed.initialize(config)
    with distributed.exits_when_a_peer_fails(launch):
        if args.dry_run:
            dry_run(config, args.target)
        else:
            run(config)
    return 0


if __name__ == "__main__":
    exit_command(main())
