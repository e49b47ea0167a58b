"""`pipeline.schedule: auto`: a pipelined run that names no schedule gets the fastest that fits,
the same one the planner's full search ranks first for that layout; a resumed run keeps its
folder's choice; a trainer built in code must name one."""

import dataclasses

import pytest

from jaxtron.config.loading import load_config
from jaxtron.errors import ConfigError
from jaxtron.planner.hardware import HARDWARE
from jaxtron.planner.schedule_choice import choose, options
from jaxtron.planner.search import plan
from jaxtron.sharding.mesh import resolve_degrees

from conftest import metric_records

PIPELINED = ["mesh.stage=2", "mesh.data=4", "pipeline.microbatches=4", "model.num_layers=4",
             "train.batch_size=16"]


def tiny(*overrides):
    return load_config("configs/tiny.yaml", [*PIPELINED, *overrides])


def test_the_choice_is_the_schedule_the_planners_search_ranks_first():
    """The search enumerates every layout of 8 devices; among those with this config's mesh
    and settings, its fastest fitting schedule is the one `auto` takes."""
    config, cpu = tiny(), HARDWARE["cpu"]
    chosen, line = choose(config, 8, cpu, None, "cpu")
    same = dict(stage=2, data=4, fsdp=1, tensor=1, sequence=1, expert=1, microbatches=4,
                grad_accum=1, zero_stage=0, sequence_parallel=False, recompute=True,
                remat=config.model.remat)
    ranked = plan(config, 8, cpu, 2**40, "cpu")
    best = next(c.layout for c in ranked.fitting
                if all(getattr(c.layout, k) == v for k, v in same.items()))
    assert (chosen.pipeline.schedule, chosen.pipeline.virtual_stages) == (
        best.schedule, best.virtual_stages)
    assert line.startswith(f"pipeline.schedule=auto: {best.schedule}")
    names = {o.config.pipeline.schedule for o in options(config, resolve_degrees(
        config.mesh, 8), cpu, "cpu")}
    assert names == {"1f1b", "gpipe", "zb-h1", "zbv", "interleaved"}


def test_a_budget_the_fastest_exceeds_takes_the_next_and_none_the_smallest():
    """Devices of their own, where the idle share sets the order (on shared cores 1F1B and
    GPipe tie with the least work and the least memory)."""
    config = tiny()
    cpu = dataclasses.replace(HARDWARE["cpu"], shared_cores=False)
    found = sorted(options(config, resolve_degrees(config.mesh, 8), cpu, "cpu"),
                   key=lambda o: o.step_s)
    fastest = found[0]
    budget = fastest.memory - 1
    fitting = [o for o in found if o.memory <= budget]
    chosen, _ = choose(config, 8, cpu, budget, "cpu")
    assert fitting and chosen.pipeline.schedule == fitting[0].config.pipeline.schedule
    assert chosen.pipeline.schedule != fastest.config.pipeline.schedule
    chosen, line = choose(config, 8, cpu, 1, "cpu")
    smallest = min(found, key=lambda o: o.memory)
    assert chosen.pipeline.schedule == smallest.config.pipeline.schedule
    assert "none fits: the smallest" in line


def test_simulated_devices_sharing_cores_take_the_least_work():
    """On one machine's simulated devices a waiting rank's time goes to the others: the idle
    stretch is no cost there (`Hardware.shared_cores`), so the schedule with least work wins,
    where devices of their own take the smallest idle."""
    config, cpu = tiny(), HARDWARE["cpu"]
    own = dataclasses.replace(cpu, shared_cores=False)
    degrees = resolve_degrees(config.mesh, 8)
    shared, line = choose(config, 8, cpu, None, "cpu")
    apart, _ = choose(config, 8, own, None, "cpu")
    by_name = {o.config.pipeline.schedule: o for o in options(config, degrees, cpu, "cpu")}
    assert by_name[shared.pipeline.schedule].step_s == min(o.step_s for o in by_name.values())
    assert "the least work that fits" in line
    assert by_name[apart.pipeline.schedule].idle < by_name[shared.pipeline.schedule].idle


def test_a_named_schedule_or_no_pipeline_is_left_alone():
    named = tiny("pipeline.schedule=zb-h1")
    assert choose(named, 8, HARDWARE["cpu"], None, "cpu") == (named, "")
    flat = load_config("configs/tiny.yaml", ["mesh.data=8"])
    assert choose(flat, 8, HARDWARE["cpu"], None, "cpu") == (flat, "")


def test_a_trainer_built_in_code_needs_a_named_schedule():
    from jaxtron.training.trainer import Trainer

    with pytest.raises(ConfigError, match="pipeline.schedule=auto is chosen by the command"):
        Trainer(tiny())


def test_the_cli_reports_its_choice_and_a_resumed_run_keeps_its_folders(tmp_path, capsys):
    """A run started with zb-h1 named, continued with the schedule left to `auto`: the
    continuation runs zb-h1 from the saved step whatever auto would pick afresh."""
    from jaxtron import train

    run = [*PIPELINED, "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
           f"train.run_dir={tmp_path}", "data.builtin_max_bytes=400000",
           "optim.warmup_steps=1"]
    assert train.main(["--config", "configs/tiny.yaml", *run, "train.steps=1",
                       "pipeline.schedule=zb-h1"]) == 0
    capsys.readouterr()
    assert train.main(["--config", "configs/tiny.yaml", *run, "train.steps=2"]) == 0
    out = capsys.readouterr().out
    assert f"pipeline.schedule=auto: zb-h1, as the run it continues in {tmp_path} chose" in out
    assert "resumed from" in out
    assert [r["step"] for r in metric_records(tmp_path) if "loss" in r] == [1, 2]
    assert load_config(tmp_path / "config.yaml").pipeline.schedule == "zb-h1"
