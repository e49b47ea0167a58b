"""The train loop's policies: random cadences and resume points never crash, log each step once,
save where asked, and resume to the uninterrupted run's losses."""

import dataclasses
import random

import jax
import numpy as np
import pytest

from jaxtron.checkpoint.manager import Checkpointer, checkpoint_dir
from jaxtron.training.loop import run_training
from jaxtron.training.loop_policy import LoopPolicy
from jaxtron.training.nonfinite import NonFiniteError, NonFiniteWatch

from conftest import make_config, metric_records


def expected_steps(steps, log_every, eval_every, every, stop_at=None):
    """Which steps of a run evaluate, log, save and stop, listed from the cadences alone: the
    multiples of each cadence up to the end, plus the end itself (the last step or the stop)."""
    end = stop_at or steps

    def multiples(n):
        return set(range(n, end + 1, n)) if n else set()

    evaluate = multiples(eval_every) | ({steps} if end == steps else set())
    return {"evaluate": evaluate, "log": multiples(log_every) | evaluate | {end},
            "save": multiples(every) | {end}, "stop": {end}, "ran": set(range(1, end + 1))}


def steps_acted_on(policy, stop_at=None):
    """Run `policy` step by step until it says stop: the steps at which it chose each action."""
    done = {"evaluate": set(), "log": set(), "save": set(), "stop": set(), "ran": set()}
    for step in range(1, policy.steps + 1):
        actions = policy.after(step, stop_requested=step == stop_at)
        done["ran"].add(step)
        for name in ("evaluate", "log", "save", "stop"):
            if getattr(actions, name):
                done[name].add(step)
        if actions.stop:
            break
    return done


def test_policy_over_random_cadences():
    rng = random.Random(0)
    for _ in range(2000):
        steps = rng.randint(1, 40)
        cadences = rng.randint(1, 12), rng.randint(0, 12), rng.randint(0, 12)
        stop_at = rng.choice([None, rng.randint(1, steps)])
        got = steps_acted_on(LoopPolicy(steps, *cadences), stop_at)
        assert got == expected_steps(steps, *cadences, stop_at), (steps, cadences, stop_at)


class SavesOneStepEarly(LoopPolicy):
    """A wrong policy: its periodic saves come one step before each multiple."""

    def after(self, step, stop_requested=False):
        actions = super().after(step, stop_requested)
        early = bool(self.checkpoint_every and (step + 1) % self.checkpoint_every == 0)
        return dataclasses.replace(actions, save=actions.stop or early)


def test_the_listed_steps_notice_a_policy_that_saves_one_step_early():
    wrong = steps_acted_on(SavesOneStepEarly(20, 4, 10, 5))
    assert wrong["save"] == {4, 9, 14, 19, 20}
    assert wrong != expected_steps(20, 4, 10, 5)
    assert steps_acted_on(LoopPolicy(20, 4, 10, 5)) == expected_steps(20, 4, 10, 5)


# Constant learning rate (warm-up 1, no decay), so a run stopped early and resumed with more
# steps follows the schedule of one uninterrupted run.
def config_for(run_dir, steps, log_every, eval_every, every):
    return make_config({"train.steps": steps, "train.log_every": log_every,
                        "train.eval_every": eval_every, "checkpoint.every": every,
                        "checkpoint.keep": 100, "train.run_dir": str(run_dir),
                        "optim.warmup_steps": 1, "optim.min_lr_ratio": 1.0, "mesh.data": 8})


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_cadences_and_resume_points_train_like_one_run(tmp_path, seed):
    rng = random.Random(seed)
    steps = rng.randint(4, 9)
    log_every, eval_every, every = rng.randint(1, 5), rng.randint(0, 5), rng.randint(0, 5)
    stop = rng.randint(1, steps - 1)
    whole = tmp_path / "whole"
    run_training(config_for(whole, steps, log_every, eval_every, every))
    split = tmp_path / "split"
    run_training(config_for(split, stop, log_every, eval_every, every))  # ends (and saves) at stop
    run_training(config_for(split, steps, log_every, eval_every, every))  # resumes at stop
    expected = expected_steps(steps, log_every, eval_every, every)
    logged = sorted(expected["log"])
    whole_rows, split_rows = metric_records(whole), metric_records(split)
    assert [r["step"] for r in whole_rows] == logged
    assert [r["step"] for r in split_rows] == sorted(set(logged) | {stop})  # one row per step
    losses = {r["step"]: r["loss"] for r in split_rows}
    assert all(losses[r["step"]] == r["loss"] for r in whole_rows), (whole_rows, split_rows)
    saved = sorted(Checkpointer(checkpoint_dir(whole), 100, read_only=True).manager.all_steps())
    assert saved == sorted(expected["save"])


def test_checkpoint_steps_that_are_not_log_steps(tmp_path):
    """log_every=10 with checkpoint.every=5 once crashed at the first save."""
    summary = run_training(config_for(tmp_path, 12, 10, 0, 5))
    assert summary["steps"] == 12
    assert [r["step"] for r in metric_records(tmp_path)] == [10, 12]
    saved = Checkpointer(checkpoint_dir(tmp_path), 100, read_only=True).manager.all_steps()
    assert sorted(saved) == [5, 10, 12]


def test_a_bad_step_is_never_saved_even_when_it_is_not_logged(tmp_path):
    """Save at every step, log every tenth: the step whose update went non-finite must stop
    the run before its checkpoint, though it writes no metrics row."""
    config = make_config({"train.steps": 8, "train.log_every": 10, "checkpoint.every": 1,
                          "checkpoint.keep": 100, "train.run_dir": str(tmp_path),
                          "optim.lr": 1e8, "optim.warmup_steps": 0, "optim.grad_clip": 0})
    with pytest.raises(NonFiniteError):
        run_training(config)
    saved = Checkpointer(checkpoint_dir(tmp_path), 100, read_only=True).manager.all_steps()
    assert saved and max(saved) < 8  # stopped early, at the first bad step
    # Every saved step restores finite parameters.
    from jaxtron.training.trainer import Trainer
    trainer = Trainer(config)
    for step in saved:
        state, _ = Checkpointer(checkpoint_dir(tmp_path), 100, read_only=True).restore(
            step, trainer.abstract_canonical_state(), trainer.config)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def test_skips_recorded_in_a_checkpoint_do_not_stop_a_resumed_run():
    class Saved:
        directory = "runs/x/checkpoints"

        def latest_step(self):
            return 4

    watch = NonFiniteWatch.__new__(NonFiniteWatch)
    watch.config, watch.checkpoints, watch.skipped = make_config(), Saved(), 3
    watch.check({"step": 5, "loss": 2.0, "grad_norm": 1.0, "skipped_updates": 3})
    with pytest.raises(NonFiniteError, match="step 6 in|at or before step 6"):
        watch.check({"step": 6, "loss": 2.0, "grad_norm": 1.0, "skipped_updates": 4})
