"""Every command prints its help and exits 0 with `--help`, without doing its work."""

import contextlib
import importlib
import io
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "jaxtron"
COMMANDS = sorted(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
                  for p in PACKAGE.rglob("*.py") if '__name__ == "__main__"' in p.read_text())


def test_the_commands_are_found():
    assert {"jaxtron.train", "jaxtron.launch", "jaxtron.plan",
            "jaxtron.planner.validate"} <= set(COMMANDS)


@pytest.mark.parametrize("module", COMMANDS)
def test_help_prints_usage_and_exits_0(module):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        importlib.import_module(module).main(["--help"])
    assert done.value.code in (0, None)
    assert f"python -m {module}" in out.getvalue() or "usage:" in out.getvalue()


def test_overrides_may_come_before_and_after_a_flag(capsys):
    """`train --config X a=1 --print-config b=2`: every override is read, wherever it sits."""
    from jaxtron import train
    assert train.main(["--config", "configs/tiny.yaml", "model.num_layers=1", "--print-config",
                       "train.steps=7"]) in (0, None)
    printed = capsys.readouterr().out
    assert "num_layers: 1" in printed and "steps: 7" in printed
