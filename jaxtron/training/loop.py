"""The training loop: a config in, trained checkpoints and metrics out.

    summary = run_training(load_config("configs/tiny.yaml"))

`run_training` takes the run directory (one run per folder, `runtime/run_dir.py`), builds the
`Trainer`, resumes from the newest good checkpoint (or starts from `train.init_from`), and
runs the steps. Each step is dispatched before the previous one's metrics are read, so the host
never waits on the step it just started; what happens after a step (evaluate, log, save, stop)
is decided by `LoopPolicy` and carried out here, in that order, so no checkpoint is written
past a step whose metrics have not been checked (`NonFiniteWatch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtron.checkpoint.manager import Checkpointer, checkpoint_dir, saved_steps
from jaxtron.config.loading import dump_config
from jaxtron.config.schema import Config
from jaxtron.data.pipeline import eval_batches, open_sources, train_batches
from jaxtron.kernels import fp8
from jaxtron.runtime.library_logs import library_logs_in
from jaxtron.runtime.metrics import MetricsLog, Reporter
from jaxtron.runtime.preemption import PreemptionGuard
from jaxtron.runtime.profiling import StepProfiler, plot_loss_curve
from jaxtron.runtime.run_dir import RunDirError, clear_previous_run, locked, previous_run
from jaxtron.sharding.mesh import describe_mesh
from jaxtron.training.evaluation import evaluate
from jaxtron.training.fits import check_fits
from jaxtron.training.flops import peak_flops, training_flops_per_token
from jaxtron.training.loop_policy import LoopPolicy
from jaxtron.training.nonfinite import NonFiniteWatch
from jaxtron.training.trainer import Trainer


def run_training(config: Config) -> dict:
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
        held.enter_context(library_logs_in(run_dir, jax.process_index(), jax.process_count()))
        run = Run.start(config, run_dir)
        if run.start_step >= config.train.steps:
            return run.nothing_to_do()
        with PreemptionGuard() as guard, run.finishing():
            step = run.loop(guard)
        return run.summary(step)


@dataclasses.dataclass
class Run:
    """What one training run holds from its start to its summary."""
    config: Config
    run_dir: Path
    trainer: Trainer
    sources: list
    batches: object  # the training stream: a grain iterator with get_state / set_state
    held_out: list
    checkpoints: Checkpointer
    state: object
    start_step: int
    log: MetricsLog
    reporter: Reporter
    profiler: StepProfiler
    is_main: bool

    @classmethod
    def start(cls, c: Config, run_dir: Path) -> "Run":
        """Build the trainer and data, restore or initialise the state, open the log."""
        is_main = jax.process_index() == 0
        sources = open_sources(c)
        trainer = Trainer(c)
        check_fits(trainer)
        rows = trainer.local_rows()
        batches = train_batches(c, sources, rows)
        checkpoints = Checkpointer(checkpoint_dir(run_dir), c.checkpoint.keep)
        state, resumed_from, loaded = _initial_state(trainer, checkpoints, batches)
        if is_main:  # only once the checkpoints accepted this config
            (run_dir / "config.yaml").write_text(dump_config(c))
        start = int(jax.device_get(state.step))
        tokens_per_step = c.train.batch_size * c.data.seq_len
        flops = training_flops_per_token(c.model, c.data.seq_len, c.moe) * tokens_per_step
        peak, peak_source = peak_flops(jax.devices())
        log = MetricsLog(run_dir, c.train.steps, enabled=is_main, start=start,
                         tensorboard=c.train.tensorboard)
        run = cls(c, run_dir, trainer, sources, batches, eval_batches(c, sources, rows),
                  checkpoints, state, start, log,
                  Reporter(log, start, flops, tokens_per_step, peak),
                  StepProfiler(run_dir, c.train.profile_steps, enabled=is_main), is_main)
        run.say(f"jaxtron: {c.model.type} model, {_parameter_count(state):,} parameters, "
                f"{describe_mesh(trainer.mesh, c.mesh)}, "
                f"compute {trainer.config.model.dtype}, "
                f"{describe_sources(sources)}; peak {peak / 1e9:,.1f} GFLOP/s ({peak_source})")
        if loaded:
            run.say(loaded)
        if resumed_from is not None:
            run.say(f"resumed from {resumed_from} at step {start}")
        return run

    def say(self, line: str) -> None:
        if self.is_main:
            print(line, flush=True)

    def loop(self, guard: PreemptionGuard) -> int:
        """Run steps until the policy stops; -> the last step run."""
        c, trainer = self.config, self.trainer
        batch, compiled = self._compiled_step()
        policy = LoopPolicy.from_config(c, self.start_step)
        watch = NonFiniteWatch(c, self.checkpoints, self.state)
        step, state = self.start_step, self.state
        for step in range(self.start_step + 1, c.train.steps + 1):
            self.profiler.before(step)
            state, metrics = compiled(state, batch)
            self.profiler.after(step, metrics)
            self.log.advance()
            data_state = self.batches.get_state()  # the stream position after this batch
            if step < c.train.steps:
                batch = self._next_batch()  # overlaps with the running step
            watch.check(self.reporter.flush())  # the previous step's row
            self.checkpoints.check()  # a background save that failed stops the run now
            act = policy.after(step, guard.stop_requested(step))
            eval_losses = self._evaluate(state, metrics) if act.evaluate else None
            if act.log:
                self.reporter.hold(step, metrics, eval_losses)
            if act.save:  # never save past a bad step, logged or not
                watch.check(self.reporter.flush() or _unlogged(step, metrics))
                watch.check_params(step, state.params)
                save_start = time.perf_counter()
                self.checkpoints.save(step, trainer.canonical_state(state), data_state, c)
                if act.measure:
                    self.say(policy.save_took(step, time.perf_counter() - save_start))
            if act.stop:
                break
        watch.check(self.reporter.flush())
        watch.check_skips(step - self.start_step)
        return step

    def _compiled_step(self):
        """The first batch and the step compiled for it (the compile time reported)."""
        start = time.perf_counter()
        batch = self.trainer.put_batch(next(self.batches))
        compiled = self.trainer.compile_step(self.state, batch)
        library = " (matmuls on oneDNN)" if self.trainer.compiler_options else ""
        self.say(f"compiled the train step in {time.perf_counter() - start:.1f} s{library}; "
                 f"run dir {self.run_dir}")
        return batch, compiled

    def _next_batch(self):
        """The next batch, read ahead by data.workers (~0 s when keeping up), on the mesh; the
        wait is counted in this step's row."""
        wait_start = time.perf_counter()
        host_batch = next(self.batches)
        self.reporter.add_data_wait(time.perf_counter() - wait_start)
        return self.trainer.put_batch(host_batch)

    def _evaluate(self, state, metrics) -> dict:
        jax.block_until_ready(metrics)  # the step's own time stays in the throughput window
        start = time.perf_counter()
        losses = evaluate(self.trainer, state, self.held_out, self.sources)
        self.reporter.add_eval_time(time.perf_counter() - start)
        return losses

    @contextlib.contextmanager
    def finishing(self):
        """Let pending asynchronous saves complete and close an open trace and the log,
        whether the loop ends or raises."""
        try:
            yield
        finally:
            self.profiler.stop()
            self.log.close()
            try:
                self.checkpoints.wait()
            finally:  # a failed save raises here; Orbax's threads must still shut down
                self.checkpoints.close()
        self.checkpoints.check()

    def nothing_to_do(self) -> dict:
        self.say(f"nothing to do: the checkpoint is at step {self.start_step} >= train.steps")
        self.log.close()
        return {"steps": self.start_step, "run_dir": str(self.run_dir)}

    def summary(self, step: int) -> dict:
        """The run's end: the loss curve, and one line saying how it ended."""
        last, c = self.reporter.last, self.config
        if self.is_main:
            plot_loss_curve(self.run_dir)
        preempted = step < c.train.steps
        where = self.checkpoints.directory / str(step)
        summary = {"steps": step, "final_loss": last["loss"],
                   "eval_loss": last.get("eval_loss"), "tokens_per_s": last["tokens_per_s"],
                   "mfu": last["mfu"], "run_dir": str(self.run_dir), "preempted": preempted}
        if preempted:
            self.say(f"preempted: saved step {step} to {where}; run the same command again to "
                     "resume")
            return summary
        eval_text = f"{summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else "-"
        self.say(f"done: {step} steps | final loss {summary['final_loss']:.4f} | eval loss "
                 f"{eval_text} | {summary['tokens_per_s']:,.0f} tok/s | mfu "
                 f"{100 * summary['mfu']:.2f}% | checkpoint {where} | metrics in "
                 f"{self.run_dir / 'metrics.jsonl'}")
        return summary


def describe_sources(sources) -> str:
    if len(sources) == 1:
        dataset = sources[0].dataset
        return f"{dataset.tokens.size:,} tokens in {dataset.prefix}"
    total = sum(s.weight for s in sources)
    return "blend of " + ", ".join(f"{s.label} {s.weight / total:.0%} "
                                   f"({s.dataset.tokens.size:,} tokens)" for s in sources)


def _parameter_count(state) -> int:
    """Weights only: delayed fp8's amax histories live among the parameters but are not."""
    return sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(state.params)
               if not fp8.is_history(path))


def _settle_previous_run(c: Config, run_dir: Path) -> None:
    """train.resume=never/archive/overwrite against what a previous run left here. Process 0
    alone runs this, so it reads the folder without Orbax (whose manager synchronises every
    process when created)."""
    if c.train.resume == "auto":
        return
    steps = saved_steps(checkpoint_dir(run_dir))
    found = previous_run(run_dir, steps[-1] if steps else None)
    if found:
        clear_previous_run(run_dir, c.train.resume, found)


def _initial_state(trainer: Trainer, checkpoints: Checkpointer, batches):
    """-> (state, the checkpoint resumed from or None, a line naming what was loaded or None):
    resume from the newest good checkpoint, start from `train.init_from`, or initialise."""
    c = trainer.config
    found = checkpoints.restore_newest_good(trainer.abstract_canonical_state(), c)
    if found is not None:
        step, canonical, data_state = found
        batches.set_state(data_state)
        return trainer.from_canonical_state(canonical), checkpoints.directory / str(step), None
    state = trainer.init_state()
    if not c.train.init_from:
        return state, None, None
    state = trainer.with_params(state, trainer.params_from(c.train.init_from))
    return state, None, (f"started from the {_parameter_count(state):,} parameters in "
                         f"{Path(c.train.init_from).absolute()} (train.init_from)")


def _unlogged(step: int, metrics) -> dict:
    """The values a finiteness check needs from a step that writes no metrics row."""
    values = jax.device_get(metrics)
    return {"step": step, "loss": float(values["loss"]), "grad_norm": float(values["grad_norm"]),
            "skipped_updates": int(values.get("skipped_updates", 0))}
