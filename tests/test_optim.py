"""The optimizer's settings mean what they say: decay on weight matrices only, a warmup kept as
configured, and a logged learning rate that is the rate each update applied."""

import math

import pytest
from flax import nnx

from jaxtron.training.loop import run_training
from jaxtron.training.nonfinite import NonFiniteError
from jaxtron.training.optimizers import decay_mask, learning_rate
from jaxtron.training.trainer import Trainer

from conftest import make_config, metric_records

# Every parameter of each family by path, and whether it is a weight matrix (decayed).
MATRICES = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "w_in", "w_out", "embed",
            "pos_embed", "lm_head", "router"}


@pytest.mark.parametrize("overrides, model", [
    ({}, {"type": "gpt2", "num_kv_heads": None}),  # q/k/v/o and MLP biases
    ({}, {}),  # llama
    ({"moe.num_experts": 4}, {}),  # router and expert weights
    ({"mesh.stage": 2, "pipeline.microbatches": 2, "mesh.data": 4}, {}),  # pipeline layout
])
def test_weight_decay_reaches_weight_matrices_only(overrides, model):
    trainer = Trainer(make_config(overrides, model=model))
    mask = decay_mask(trainer.abstract_state().params)
    decided = {}
    for path, variable in nnx.to_flat_state(mask):
        decided[path[-1]] = variable.get_value()
    expected = {name: name in MATRICES for name in decided}
    assert decided == expected
    assert any(not v for v in decided.values()) and any(decided.values())


def test_warmup_longer_than_the_run_is_kept_and_warned_about(capsys):
    config = make_config({"train.steps": 10, "optim.warmup_steps": 20})
    schedule = learning_rate(config)
    assert float(schedule(5)) == pytest.approx(config.optim.lr * 5 / 20)  # not shortened
    from jaxtron.config.checks import config_warnings
    (warning,) = config_warnings(config)
    assert "optim.warmup_steps=20 exceeds train.steps=10" in warning and "50%" in warning


def cosine_without_warmup(t, peak, floor, decay_steps):
    """Megatron's cosine rate of update t with no warmup: peak at t = 0, floor from decay_steps."""
    progress = min(t, decay_steps) / decay_steps
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def test_logged_lr_is_the_rate_applied_also_around_skipped_updates(tmp_path):
    config = make_config({"train.steps": 8, "train.log_every": 1, "train.eval_every": 0,
                          "optim.lr": 1e8, "optim.warmup_steps": 0, "optim.grad_clip": 0,
                          "train.on_nan": "skip", "train.run_dir": str(tmp_path)})
    try:
        run_training(config)
    except NonFiniteError as err:  # most updates skipped: the run says it did not train
        assert "updates were skipped for non-finite gradients" in str(err)
    rows = metric_records(tmp_path)
    skipped_before = 0
    assert rows[-1]["skipped_updates"] > 0  # the test sees skips
    for row in rows:
        if row["skipped_updates"] > skipped_before:
            assert row["lr"] == 0.0, row  # a skipped update applied nothing
        else:  # the schedule advances with applied updates only
            # floor 1e7: the default min_lr_ratio 0.1; the decay ends at train.steps = 8
            want = cosine_without_warmup(row["step"] - 1 - skipped_before, 1e8, 1e7, 8)
            assert row["lr"] == pytest.approx(want, rel=1e-6), row
        skipped_before = row["skipped_updates"]
