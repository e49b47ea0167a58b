"""The package layers hold: imports go downward only and no package's modules import each
other in a circle (the contracts in pyproject.toml, checked by import-linter); and the check
fails on a tree that breaks them."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(root), "PATH": ""})


def test_the_layer_contracts_are_kept():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("models/layers.py", "from jaxtron.training import step", "commands on top"),
    ("pipeline/engine.py", "from jaxtron.models import transformer", "commands on top"),
    ("config/schema.py", "from jaxtron.config import loading", "no import cycles"),
])
def test_an_upward_import_or_a_cycle_breaks_them(tmp_path, module, line, broken):
    shutil.copytree(ROOT / "jaxtron", tmp_path / "jaxtron")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "jaxtron" / module, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout
