"""Every learning-rate schedule equals its closed form at every step, written here from
Megatron-LM's OptimizerParamScheduler.get_lr; a WSD run logs its three phases."""

import math

import numpy as np
import pytest

from jaxtron.training.loop import run_training
from jaxtron.training.lr_schedule import learning_rate

from conftest import make_config, metric_records

PEAK, RATIO, WARMUP, STEPS = 1e-3, 0.1, 10, 100


def megatron_lr(step, style, decay_steps=STEPS, wsd_steps=20, wsd_style="linear"):
    """Megatron's get_lr with init_lr 0, min_lr = RATIO x max_lr."""
    max_lr, min_lr = PEAK, PEAK * RATIO
    if WARMUP > 0 and step <= WARMUP:
        return max_lr * step / WARMUP
    if style == "constant":
        return max_lr
    if step > decay_steps:
        return min_lr
    if style == "inverse_sqrt":
        return max(min_lr, max_lr * math.sqrt(max(WARMUP, 1)) / math.sqrt(max(step, 1)))
    ratio = (step - WARMUP) / (decay_steps - WARMUP)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # wsd
        anneal_start = decay_steps - wsd_steps
        if step <= anneal_start:
            coeff = 1.0
        else:
            r = (step - anneal_start) / wsd_steps
            coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                     "minus_sqrt": 1.0 - math.sqrt(r)}[wsd_style]
    return min_lr + coeff * (max_lr - min_lr)


TOLERANCE = {"rtol": 1e-5, "atol": 1e-12}


def configured_schedule(style, **optim):
    return learning_rate(make_config({"train.steps": STEPS}, optim={
        "lr": PEAK, "min_lr_ratio": RATIO, "warmup_steps": WARMUP, "schedule": style, **optim}))


def rates(schedule):
    """The schedule's rate at every update of the run and a few past its end."""
    return np.array([float(schedule(t)) for t in range(STEPS + 5)])


def closed_form(style, **reference):
    return np.array([megatron_lr(t, style, **reference) for t in range(STEPS + 5)])


@pytest.mark.parametrize("style, extra, reference", [
    ("cosine", {}, {}),
    ("linear", {}, {}),
    ("constant", {}, {}),
    ("inverse_sqrt", {}, {}),
    ("wsd", {}, {}),
    ("wsd", {"wsd_shape": "cosine", "decay_fraction": 0.3}, {"wsd_steps": 30,
                                                             "wsd_style": "cosine"}),
    ("wsd", {"wsd_shape": "minus_sqrt"}, {"wsd_style": "minus_sqrt"}),
    ("linear", {"decay_steps": 60}, {"decay_steps": 60}),  # then the floor until the end
    ("inverse_sqrt", {"decay_steps": 60}, {"decay_steps": 60}),
])
def test_each_schedule_equals_its_closed_form_at_every_step(style, extra, reference):
    schedule = configured_schedule(style, **extra)
    np.testing.assert_allclose(rates(schedule), closed_form(style, **reference), **TOLERANCE)


def test_the_closed_form_notices_a_warmup_one_step_late():
    schedule = configured_schedule("cosine")
    late = rates(lambda t: schedule(max(t - 1, 0)))
    assert not np.allclose(late, closed_form("cosine"), **TOLERANCE)
    assert np.allclose(late[1:], closed_form("cosine")[:-1], **TOLERANCE)  # only the delay


def test_a_wsd_run_logs_warmup_stable_and_decay(tmp_path):
    config = make_config({"train.steps": 20, "train.log_every": 1, "train.eval_every": 0,
                          "train.run_dir": str(tmp_path)},
                         optim={"lr": PEAK, "min_lr_ratio": 0.0, "warmup_steps": 4,
                                "schedule": "wsd", "decay_fraction": 0.25})
    run_training(config)
    lr = [row["lr"] for row in metric_records(tmp_path)]  # row i: update i
    assert lr[:5] == pytest.approx([0.0, PEAK / 4, PEAK / 2, 3 * PEAK / 4, PEAK])
    assert lr[4:16] == pytest.approx([PEAK] * 12)  # stable until T - D = 15
    assert lr[15:] == pytest.approx([PEAK * (1 - s / 5) for s in range(5)])  # down to 0 at 20
