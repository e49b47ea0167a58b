"""Golden parameter PartitionSpecs for configs/tiny.yaml: a change in placement is deliberate.

Regenerate after an intended change with JAXTRON_UPDATE_GOLDEN=1 pytest tests/test_golden_specs.py
(that run rewrites the file and fails), then check it with a run without the variable.
"""

import json
import os
from pathlib import Path

import pytest
from flax import nnx

from jaxtron.config.loading import load_config
from jaxtron.training.trainer import Trainer

GOLDEN = Path(__file__).parent / "golden" / "tiny_partition_specs.json"
LAYOUTS = {
    "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "data4_tensor2_zero1": ["mesh.data=4", "mesh.tensor=2", "optim.zero_stage=1"],
}


def specs(overrides):
    trainer = Trainer(load_config("configs/tiny.yaml", overrides))
    state = trainer.abstract_state()

    def table(tree):
        return {"/".join(map(str, path)): str(tuple(var.get_value().sharding.spec))
                for path, var in nnx.to_flat_state(tree)}

    return {"params": table(state.params), "adam_mu": table(state.opt_state.inner_state[1][0].mu)}


def test_partition_specs_match_golden_file():
    current = {name: specs(overrides) for name, overrides in LAYOUTS.items()}
    if os.environ.get("JAXTRON_UPDATE_GOLDEN"):
        # The run that writes the file has nothing to compare against: it must not pass.
        GOLDEN.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
        pytest.fail(f"rewrote {GOLDEN}; review the diff and rerun without JAXTRON_UPDATE_GOLDEN")
    assert current == json.loads(GOLDEN.read_text())
