"""The train loop's policies: random cadences and resume points never crash, log each step once,
save where asked, and resume to the uninterrupted run's losses."""

import random

import jax
import numpy as np
import pytest

from jaxtron.checkpoint.manager import Checkpointer, checkpoint_dir
from jaxtron.training.loop import run_training
from jaxtron.training.loop_policy import LoopPolicy
from jaxtron.training.nonfinite import NonFiniteError, NonFiniteWatch

from conftest import make_config, metric_records


def test_policy_over_random_cadences():
    rng = random.Random(0)
    for _ in range(2000):
        steps = rng.randint(1, 40)
        policy = LoopPolicy(steps, rng.randint(1, 12), rng.randint(0, 12), rng.randint(0, 12))
        stop_at = rng.choice([None, rng.randint(1, steps)])
        done = []
        for step in range(1, steps + 1):
            act = policy.after(step, stop_requested=step == stop_at)
            done.append((step, act))
            if act.stop:
                break
        last, final = done[-1]
        assert final.stop and final.save and final.log  # the end is always saved and logged
        assert last == (stop_at or steps)
        for step, act in done:
            assert act.log == (act.stop or act.evaluate or step % policy.log_every == 0)
            every = policy.checkpoint_every
            assert act.save == (act.stop or bool(every and step % every == 0))
            assert act.evaluate == (step == steps or bool(policy.eval_every
                                                          and step % policy.eval_every == 0))


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
    policy = LoopPolicy(steps, log_every, eval_every, every)
    logged = [s for s in range(1, steps + 1) if policy.after(s).log]
    whole_rows, split_rows = metric_records(whole), metric_records(split)
    assert [r["step"] for r in whole_rows] == logged
    assert [r["step"] for r in split_rows] == sorted(set(logged) | {stop})  # one row per step
    losses = {r["step"]: r["loss"] for r in split_rows}
    assert all(losses[r["step"]] == r["loss"] for r in whole_rows), (whole_rows, split_rows)
    saved = sorted(Checkpointer(checkpoint_dir(whole), 100, read_only=True).manager.all_steps())
    assert saved == [s for s in range(1, steps + 1) if policy.after(s).save]


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
