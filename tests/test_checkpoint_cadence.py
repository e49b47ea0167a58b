"""`checkpoint.every: auto`: Young's interval from measured save and step times, and a run that
measures, decides and saves at that interval."""

import re

import pytest

from jaxtron.checkpoint.cadence import MEASURE_AT, young_interval_steps
from jaxtron.checkpoint.manager import saved_steps
from jaxtron.errors import ConfigError

from conftest import make_config, run_in_process


def test_the_interval_minimises_save_cost_plus_expected_lost_work():
    # C = 2 s per save, M = 1 h between failures: T = sqrt(2 C M) = 120 s = 240 steps of 0.5 s
    assert young_interval_steps(2.0, 0.5, 1.0) == 240
    save, step, mtbf = 0.7, 0.05, 3.0
    n = young_interval_steps(save, step, mtbf)

    def lost(steps):  # expected overhead per second: saves, and half an interval per failure
        return save / (steps * step) + steps * step / (2 * mtbf * 3600)
    assert lost(n) <= min(lost(n - 1), lost(n + 1))
    assert young_interval_steps(10.0, 1e4, 1.0) == 1  # never less than every step


def test_a_run_measures_decides_and_saves_at_that_interval(tmp_path):
    out = run_in_process(
        "jaxtron.train", "--config", "configs/tiny.yaml", "train.steps=14",
        "checkpoint.every=auto", "checkpoint.mtbf_hours=0.0005", "checkpoint.keep=20",
        "model.num_layers=2", "data.seq_len=64", "train.log_every=7", f"train.run_dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-2000:]
    every = int(re.search(r"a checkpoint every (\d+) steps", out.stdout).group(1))
    # the interval exists from the timed save on: no interval save comes before it
    want = {MEASURE_AT, 14} | {s for s in range(MEASURE_AT + 1, 15) if s % every == 0}
    assert set(saved_steps(tmp_path / "checkpoints")) == want


@pytest.mark.parametrize("override, message", [
    ({"checkpoint.every": "often"}, "checkpoint.every='often' must be a number of steps"),
    ({"checkpoint.mtbf_hours": 0}, "checkpoint.mtbf_hours=0.0 must be > 0")])
def test_bad_cadence_settings_name_the_field(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(override)
