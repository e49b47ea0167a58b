"""Every user-facing error names what is wrong and how to fix it.

The messages are collected from the source: each `raise <JaxtronError subclass>(...)` and each
`_check(condition, message)` of the config validator, in every module. A message passes when it
names a field, flag, variable or file (a dotted config key such as `mesh.tensor`, a `--flag`, an
environment variable, or a formatted path/key), and says what to do: an imperative such as
"set", "use", "make", "choose", or the value the field must take ("must be >= 0", "needs
pipeline.schedule=interleaved"). A few are also triggered for real, end to end.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "jaxtron"
USER_ERRORS = {"JaxtronError", "ConfigError", "DataError", "CheckpointError", "LaunchError",
               "NonFiniteError", "DamagedCheckpoint", "RunDirError"}
FIELD = re.compile(r"\b[a-z_]+\.[a-z_]+\b|--[a-z][a-z-]+|\b[A-Z][A-Z_]{3,}\b|\bfolder\b|"
                   r"\bfile\b|\bdirectory\b|\.bin\b|\.idx\b")
FIELD_VALUES = re.compile(r"path|prefix|key|name|field|flag|where|dotted|text|directory|folder|"
                          r"checkpoint|location|args\.|spec|parts|rest|missing|degrees|FILE|src")
FIX = re.compile(r"\b(set|use|make|give|add|remove|delete|pass|choose|raise|lower|run|change|"
                 r"fix|launch|put|shorten|rename|install|point|relaunch|increase|reduce|write|"
                 r"pick|keep|split|start|export|prepare|resume|align|divide|restart|must|needs|create|check|convert|download|name|save)\b",
                 re.I)


def _message_parts(node):
    """(static text, formatted expression sources) of a message expression."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, ""
    if isinstance(node, ast.JoinedStr):
        text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
        values = " ".join(ast.unparse(v.value) for v in node.values
                          if isinstance(v, ast.FormattedValue))
        return text, values
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        (a, av), (b, bv) = _message_parts(node.left), _message_parts(node.right)
        return a + b, av + " " + bv
    return "", ast.unparse(node)


def collect_messages():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            message = None
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
                if name in USER_ERRORS and node.exc.args:
                    message = node.exc.args[0]
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_check"
                  and len(node.args) == 2):
                message = node.args[1]
            if message is not None and not isinstance(message, ast.Name):  # _check's own raise
                found.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno}",
                              *_message_parts(message)))
    return found


MESSAGES = collect_messages()


def test_there_are_many_messages_to_check():
    assert len(MESSAGES) > 100  # config, data, checkpoint and launch errors all found


@pytest.mark.parametrize("where, text, values", MESSAGES, ids=[m[0] for m in MESSAGES])
def test_message_names_the_field_and_the_fix(where, text, values):
    assert FIELD.search(text) or FIELD_VALUES.search(values), f"{where}: names no field: {text!r}"
    assert FIX.search(text), f"{where}: gives no fix: {text!r}"


@pytest.mark.parametrize("args, expected", [
    (["mesh.data=2", "mesh.tensor=3"], "multiply to 6, but 8 devices"),
    (["model.d_modle=64"], "Did you mean model.d_model?"),
    (["data.path=/nonexistent/corpus"], "data.path"),
    (["train.init_from=/nonexistent/export"], "python -m jaxtron.export"),
    (["distributed.num_processes=2"], "distributed.process_id"),
])
def test_bad_input_stops_the_cli_with_one_readable_line(args, expected, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jaxtron.train", "--config", "configs/tiny.yaml",
         f"train.run_dir={tmp_path}", *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: ") and expected in result.stderr
    assert "Traceback" not in result.stderr
