"""Every shipped GPU config is a recipe for the machine its header names (`# Target: N x H100
80GB`): its layout, at its batch and sequence length, fits that machine's memory with a tenth to
spare by the planner's model (the model `python -m jaxtron.planner.validate` checks against
XLA), and those that fit one node lower for cuda on simulated devices, as a dry run does."""

import re
from pathlib import Path

import pytest

from jaxtron.config.loading import load_config
from jaxtron.config.platforms import for_platform
from jaxtron.planner.layout import layout_of
from jaxtron.planner.memory import predict
from jaxtron.sharding.mesh import resolve_degrees
from jaxtron.training.trainer import Trainer

CONFIGS = Path(__file__).parent.parent / "configs"
CPU_CONFIGS = {"tiny", "moe-tiny", "blend-tiny", "sft-tiny", "tiny-fp8"}  # this machine's
TARGET = re.compile(r"^# Target: (\d+) x H100 80GB", re.M)
H100_BYTES = 80 * 2**30
RECIPES = sorted(p.stem for p in CONFIGS.glob("*.yaml") if p.stem not in CPU_CONFIGS)


def target_devices(name: str) -> int:
    found = TARGET.search((CONFIGS / f"{name}.yaml").read_text())
    assert found, f"configs/{name}.yaml names no '# Target: N x H100 80GB'"
    return int(found[1])


def test_every_gpu_config_names_its_target():
    assert len(RECIPES) >= 11
    assert all(target_devices(name) >= 1 for name in RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_the_recipe_fits_its_target_with_a_tenth_to_spare(name):
    devices = target_devices(name)
    config = for_platform(load_config(CONFIGS / f"{name}.yaml"), "cuda")
    layout = layout_of(config, resolve_degrees(config.mesh, devices))
    memory = predict(config, layout)
    assert memory.total <= 0.9 * H100_BYTES, (name, memory.total / 2**30)


@pytest.mark.parametrize("name", [n for n in RECIPES if target_devices(n) == 8])
def test_one_node_recipes_lower_for_cuda_at_a_reduced_depth(name):
    config = load_config(CONFIGS / f"{name}.yaml", ["model.num_layers=2"])
    text = Trainer(config, platform="cuda").lower_step().as_text()
    assert "bf16" in text
