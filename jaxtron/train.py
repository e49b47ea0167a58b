"""Train a transformer from one YAML config.

    python -m jaxtron.train --config configs/tiny.yaml [section.key=value ...]

Writes <train.run_dir>/config.yaml (the resolved config) and metrics.jsonl (one JSON object per
logged step: step, loss, lr, grad_norm, tokens_per_s, mfu, eval_loss where evaluated, and for
mixture-of-experts models moe_balance, moe_z, moe_dropped, moe_max_load), shows
a progress line every `train.log_every` steps and ends with a one-line summary. Metrics are read
one step late, so the host never waits on the step it just dispatched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxtron import config as config_lib
from jaxtron import distributed
from jaxtron.dry_run import dry_run
from jaxtron.errors import ConfigError, JaxtronError, exits_on_user_error
from jaxtron.platforms import PLATFORMS, simulate_cpu_devices
from jaxtron.preemption import PreemptionGuard
from jaxtron.profiling import StepProfiler, plot_loss_curve
from jaxtron.flops import peak_flops, training_flops_per_token
from jaxtron.sharding.mesh import describe_mesh


class NonFiniteError(JaxtronError):
    """Training produced a NaN or Inf under train.on_nan=stop."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxtron.train", description="Train a transformer from a YAML config.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Config fields (key, type, default, meaning); set any in the YAML file or as an "
               "override\nsection.key=value, e.g. train.steps=50 model.num_layers=4:\n\n"
               + config_lib.format_field_reference())
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


class MetricsLog:
    """Appends one JSON object per logged step to metrics.jsonl (and TensorBoard scalars with
    `tensorboard=True`) and prints a progress line; on a terminal a tqdm bar also advances every
    step and shows the latest loss, tok/s and MFU."""

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool = True,
                 append: bool = False, start: int = 0, tensorboard: bool = False):
        self.path = run_dir / "metrics.jsonl"
        self.total = total_steps
        self.enabled = enabled
        if enabled and not append:
            self.path.write_text("")
        self.events = None
        if enabled and tensorboard:
            from tensorboardX import SummaryWriter
            self.events = SummaryWriter(str(run_dir / "tensorboard"))
        self.bar = tqdm(total=total_steps, initial=start, unit="step", dynamic_ncols=True,
                        disable=not (enabled and sys.stderr.isatty()), leave=False)

    def advance(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self.events is not None:
            self.events.close()

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.events is not None:
            for key, value in record.items():
                if key != "step":
                    tag = "eval/loss" if key == "eval_loss" else f"train/{key}"
                    self.events.add_scalar(tag, value, record["step"])
            self.events.flush()
        line = (f"step {record['step']:>{len(str(self.total))}}/{self.total} | "
                f"loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"grad_norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
                f"mfu {100 * record['mfu']:.2f}%")
        if "moe_dropped" in record:
            line += (f" | moe balance {record['moe_balance']:.3f} max_load "
                     f"{record['moe_max_load']:.2f} dropped {100 * record['moe_dropped']:.1f}%")
        if "eval_loss" in record:
            line += f" | eval_loss {record['eval_loss']:.4f}"
        if self.bar.disable:
            print(line, flush=True)
            return
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                             mfu=f"{100 * record['mfu']:.1f}%", refresh=False)
        self.bar.write(line)


def run(config: config_lib.Config) -> dict:
    """Train `config` to the end (or to a preemption signal); return the final summary."""
    from jaxtron.checkpoint import Checkpointer, checkpoint_dir
    from jaxtron.data.pipeline import eval_batches, open_dataset, train_batches
    from jaxtron.trainer import Trainer

    c = config
    is_main = jax.process_index() == 0
    run_dir = Path(c.train.run_dir)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_lib.dump(c))

    dataset = open_dataset(c)
    trainer = Trainer(c)
    rows = trainer.local_rows()
    batches = train_batches(c, dataset, rows)
    held_out = eval_batches(c, dataset, rows)
    checkpoints = Checkpointer(checkpoint_dir(run_dir), c.checkpoint.keep)
    state, resumed_from = _initial_state(trainer, checkpoints, batches)
    start = int(jax.device_get(state.step))

    tokens_per_step = c.train.batch_size * c.data.seq_len
    flops_per_step = training_flops_per_token(c.model, c.data.seq_len, c.moe) * tokens_per_step
    peak, peak_source = peak_flops(jax.devices())
    log = MetricsLog(run_dir, c.train.steps, enabled=is_main, append=resumed_from is not None,
                     start=start, tensorboard=c.train.tensorboard)
    if is_main:
        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        print(f"jaxtron: {c.model.type} model, {n_params:,} parameters, "
              f"{describe_mesh(trainer.mesh)}, {dataset.tokens.size:,} tokens in "
              f"{c.data.path}; peak {peak / 1e9:,.1f} GFLOP/s ({peak_source})", flush=True)
        if resumed_from is not None:
            print(f"resumed from {resumed_from} at step {start}", flush=True)
    if start >= c.train.steps:
        if is_main:
            print(f"nothing to do: the checkpoint is at step {start} >= train.steps",
                  flush=True)
        return {"steps": start, "run_dir": str(run_dir)}

    compile_start = time.perf_counter()
    batch = trainer.put_batch(next(batches))
    compiled = trainer.compile_step(state, batch)
    if is_main:
        library = " (matmuls on oneDNN)" if trainer.compiler_options else ""
        print(f"compiled the train step in {time.perf_counter() - compile_start:.1f} s"
              f"{library}; run dir {run_dir}", flush=True)

    def evaluate(params_state) -> float:
        losses = [trainer.eval_loss(params_state, trainer.put_batch(b)) for b in held_out]
        return float(np.mean(jax.device_get(losses)))

    def save(step, data_state):
        checkpoints.save(step, trainer.canonical_state(state), data_state, c)

    # Throughput is taken between completions of logged steps, minus evaluation time.
    clock = {"time": time.perf_counter(), "step": start, "eval_s": 0.0}
    pending, last, step = None, {}, start

    def flush() -> dict:
        """Report the pending step (waiting for it) and stop on a bad one before any save."""
        record = _report(*pending, log, clock, flops_per_step, tokens_per_step, peak)
        _check_finite(record, c, checkpoints)
        return record
    profiler = StepProfiler(run_dir, c.train.profile_steps, enabled=is_main)
    with PreemptionGuard() as guard, _finishing(checkpoints, profiler):
        for step in range(start + 1, c.train.steps + 1):
            profiler.before(step)
            state, metrics = compiled(state, batch)
            profiler.after(step, metrics)
            log.advance()
            data_state = batches.get_state()  # the stream position after this step's batch
            if step < c.train.steps:
                batch = trainer.put_batch(next(batches))  # overlaps with the running step
            if pending is not None:
                last, pending = flush(), None
            eval_loss = None
            if (c.train.eval_every and step % c.train.eval_every == 0) or step == c.train.steps:
                jax.block_until_ready(metrics)  # the step's own time stays in the window
                eval_start = time.perf_counter()
                eval_loss = evaluate(state)
                clock["eval_s"] += time.perf_counter() - eval_start
            if (step % c.train.log_every == 0 or step == c.train.steps or eval_loss is not None
                    or guard.requested):
                pending = (step, metrics, eval_loss)
            if guard.requested or (c.checkpoint.every and step % c.checkpoint.every == 0):
                last, pending = flush(), None  # never save past a bad step
                save(step, data_state)
            if guard.requested:
                break
        if pending is not None:
            last = flush()
        if step == c.train.steps and c.checkpoint.every and step % c.checkpoint.every:
            save(step, data_state)
    log.close()
    if is_main:
        plot_loss_curve(run_dir)
    if guard.requested and is_main:
        print(f"preempted: saved step {step} to {checkpoints.directory / str(step)}; run the "
              "same command again to resume", flush=True)
    summary = {"steps": step, "final_loss": last["loss"],
               "eval_loss": last.get("eval_loss"), "tokens_per_s": last["tokens_per_s"],
               "mfu": last["mfu"], "run_dir": str(run_dir), "preempted": bool(guard.requested)}
    if is_main and not guard.requested:
        eval_text = f"{summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else "-"
        print(f"done: {summary['steps']} steps | final loss {summary['final_loss']:.4f} | "
              f"eval loss {eval_text} | {summary['tokens_per_s']:,.0f} tok/s | "
              f"mfu {100 * summary['mfu']:.2f}% | metrics in {run_dir / 'metrics.jsonl'}",
              flush=True)
    return summary


@contextlib.contextmanager
def _finishing(checkpoints, profiler):
    """Let pending asynchronous saves complete and close an open trace, whether the loop ends
    or raises."""
    try:
        yield
    finally:
        profiler.stop()
        checkpoints.wait()
        checkpoints.close()


def _initial_state(trainer, checkpoints, batches):
    """Resume from the newest checkpoint, start from `train.init_from`, or initialise."""
    c = trainer.config
    latest = checkpoints.latest_step() if c.train.resume == "auto" else None
    if latest is not None:
        canonical, data_state = checkpoints.restore(latest, trainer.abstract_canonical_state(),
                                                    c)
        batches.set_state(data_state)
        return trainer.from_canonical_state(canonical), checkpoints.directory / str(latest)
    state = trainer.init_state()
    if c.train.init_from:
        from jaxtron.export import load_params
        state = trainer.with_params(state, load_params(c.train.init_from, trainer))
    return state, None


def _check_finite(record: dict, c: config_lib.Config, checkpoints) -> None:
    bad = not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]))
    if c.train.on_nan == "stop" and (bad or record.get("skipped_updates", 0) > 0):
        latest = checkpoints.latest_step()
        where = (f"the last checkpoint, step {latest} in {checkpoints.directory}, is intact"
                 if latest is not None else "no checkpoint had been written")
        raise NonFiniteError(
            f"a non-finite loss or gradient appeared at or before step {record['step']} "
            f"(loss {record['loss']}, grad_norm {record['grad_norm']}); the update was not "
            f"applied and {where}. Lower optim.lr, raise optim.warmup_steps, or set "
            "train.on_nan=skip to skip such updates.")


def _report(step, metrics, eval_loss, log: MetricsLog, clock: dict, flops_per_step,
            tokens_per_step, peak) -> dict:
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for `step`
    now = time.perf_counter()
    seconds = max(now - clock["time"] - clock["eval_s"], 1e-9)
    steps_per_s = (step - clock["step"]) / seconds
    clock.update(time=now, step=step, eval_s=0.0)
    record = {"step": step, "loss": values["loss"], "lr": values["lr"],
              "grad_norm": values["grad_norm"], "tokens_per_s": tokens_per_step * steps_per_s,
              "mfu": flops_per_step * steps_per_s / peak}
    record.update({k: v for k, v in values.items() if k.startswith("moe_")})
    record["skipped_updates"] = int(values.get("skipped_updates", 0))
    if eval_loss is not None:
        record["eval_loss"] = eval_loss
    log.write(record)
    return record


@exits_on_user_error
def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    config = config_lib.load(args.config, args.overrides)
    if args.print_config:
        print(config_lib.dump(config), end="")
        return 0
    if (args.target or args.devices) and not args.dry_run:
        raise ConfigError("--target and --devices only apply to a check; add --dry-run.")
    if args.devices:
        simulate_cpu_devices(args.devices)
    launch = distributed.initialize(config)
    with distributed.exits_when_a_peer_fails(launch):
        if args.dry_run:
            dry_run(config, args.target)
        else:
            run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
