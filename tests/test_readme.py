"""The README's commands work in the order shown: each shell block is run, at tiny sizes.

Commands run in a scratch folder that links the project's configs/, examples/, jaxtron/ and
scripts/, so the runs, data and exports they write land there, as they would in a fresh clone.
Blocks introduced as needing a GPU or a cluster are skipped (their code is covered by the
lowering tests, tests/test_gpu.py and tests/test_multihost.py), and so are `make test` (this
suite) and activating the environment (the tests already run inside it). Everything else runs,
with overrides appended that shrink each training run to a few steps. A `python -m jaxtron.X`
command whose shell sees this process's devices runs in this process (its `main`, as the
module's `__main__` calls it, in the scratch folder, output captured); the rest, such as
`--devices` checks that must start JAX afresh, run as their own processes.
"""

import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from conftest import FAST_COMPILE_FLAGS

ROOT = Path(__file__).parent.parent
HARDWARE = {"On a machine with an NVIDIA GPU": "needs an NVIDIA GPU",
            "On a cluster": "needs a cluster"}
NOT_RUN = {"make test": "this suite", "source .venv/bin/activate": "the tests run inside it"}
# Appended to shrink a command; later overrides win.
TINY = {"jaxtron.train": ["train.steps=3", "train.log_every=1", "train.eval_batches=1",
                          "data.builtin_max_bytes=400000"],
        "jaxtron.bench": ["--warmup", "1", "--steps", "1", "--repeats", "1"],
        "jaxtron.data.throughput": ["--batches", "5", "data.builtin_max_bytes=400000"]}


def readme_commands(page: str = "README.md") -> list[tuple[str, str | None]]:
    """(command line, why it is not run or None), in the page's order."""
    text = (ROOT / page).read_text()
    commands = []
    for match in re.finditer(r"```bash\n(.*?)```", text, re.S):
        before = text[:match.start()].rstrip().rsplit("\n\n", 1)[-1]
        hardware = next((h for h in HARDWARE if h in before), None)
        for line in match.group(1).replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line:
                why = HARDWARE[hardware] if hardware else NOT_RUN.get(line)
                commands.append((line, why))
    return commands


def as_argv(line: str) -> tuple[dict, list[str]]:
    """Leading VAR=value words become environment; `make train` its python command."""
    words, env = shlex.split(line), {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[:2] == ["make", "train"]:  # the Makefile's command and devices
        words = ["python", "-m", "jaxtron.train", "--config", "configs/tiny.yaml"]
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    if words[0] == "python":
        words[0] = sys.executable
        module = words[2] if words[1] == "-m" else ""
        words += TINY.get(module, [])
    return env, words


def devices_in(env: dict) -> int:
    match = re.search(r"--xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
    return int(match.group(1)) if match else 1


def run_in_process(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """`python -m jaxtron.X args` as its `__main__` runs it: -> (status, stdout, stderr)."""
    module = importlib.import_module(argv[2])
    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = module.main(argv[3:])
            except SystemExit as exit_:  # argparse's --help
                status = exit_.code or 0
    finally:
        os.chdir(before)
    return status, out.getvalue(), err.getvalue()


def run(line: str, env: dict, cwd: Path) -> tuple[int, str, str]:
    extra_env, argv = as_argv(line)
    env = {**env, **extra_env}
    fresh_jax = argv[2:3] == ["jaxtron.train"] and "--devices" in argv  # simulates devices
    here = (argv[1:2] == ["-m"] and argv[2].startswith("jaxtron.") and not fresh_jax
            and devices_in(env) == jax.device_count())
    if here:
        return run_in_process(argv, cwd)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    return result.returncode, result.stdout, result.stderr


def run_in_order(commands, tmp_path: Path) -> list[str]:
    """Run every command not marked otherwise in a scratch folder: -> the lines run."""
    for name in ("configs", "examples", "jaxtron", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    # A user's shell: no device count unless the page sets one (the tests' faster compile
    # flags are kept on top).
    shell = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    ran = []
    for line, why in commands:
        if why:
            continue
        if line.startswith("export "):
            key, value = line.removeprefix("export ").split("=", 1)
            shell[key] = value
            continue
        status, stdout, stderr = run(line, shell, tmp_path)
        assert status == 0, f"{line}\n{stdout[-2000:]}\n{stderr[-3000:]}"
        assert "Traceback" not in stderr, f"{line}\n{stderr[-3000:]}"
        ran.append(line)
    return ran


def test_every_readme_command_runs_in_order(tmp_path):
    commands = readme_commands()
    ran = run_in_order(commands, tmp_path)
    # The walkthrough's products exist where the README says.
    assert (tmp_path / "exports" / "tiny-hf" / "config.json").is_file()
    assert (tmp_path / "runs" / "finetune" / "metrics.jsonl").is_file()
    assert len(ran) >= 20, ran
    skipped = {line: why for line, why in commands if why}
    assert all("GPU" in why or "cluster" in why for line, why in skipped.items()
               if line not in NOT_RUN), skipped


@pytest.mark.parametrize("page", ["docs/long-context.md"])
def test_every_command_of_a_docs_page_runs_in_order(page, tmp_path):
    assert run_in_order(readme_commands(page), tmp_path)
