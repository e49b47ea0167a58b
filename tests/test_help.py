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
