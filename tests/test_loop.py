"""The train loop's policies: random cadences and resume points never crash, log each step once,
save where asked, and resume to the uninterrupted run's losses."""

import random

import pytest

from jaxtron import train
from jaxtron.checkpoint import Checkpointer, checkpoint_dir
from jaxtron.loop import LoopPolicy

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
    train.run(config_for(whole, steps, log_every, eval_every, every))
    split = tmp_path / "split"
    train.run(config_for(split, stop, log_every, eval_every, every))  # ends (and saves) at stop
    train.run(config_for(split, steps, log_every, eval_every, every))  # resumes at stop
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
    summary = train.run(config_for(tmp_path, 12, 10, 0, 5))
    assert summary["steps"] == 12
    assert [r["step"] for r in metric_records(tmp_path)] == [10, 12]
    saved = Checkpointer(checkpoint_dir(tmp_path), 100, read_only=True).manager.all_steps()
    assert sorted(saved) == [5, 10, 12]
