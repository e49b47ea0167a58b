"""The README's commands, and every docs page's, work in the order shown: each shell block is
run, at tiny sizes.

Commands run in a scratch folder that links the project's configs/, examples/, jaxtron/ and
scripts/, so the runs, data and exports they write land there, as they would in a fresh clone.
Blocks introduced (in their paragraph or section heading) as needing a GPU, a cluster or a
download are skipped, and so is a line whose comment says it runs on a GPU (their code is covered
by the lowering tests, tests/test_gpu.py, tests/test_multihost.py and tests/test_hf_oracle.py), and
so are `make test` (this suite) and activating the environment (the tests already run inside
it). Everything else runs, shrunk: every step count of a training command (`train.steps`, its
config's own, `checkpoint.every`, an export's `--step`) is divided by 50, so a page's resumes and
exports keep their meaning at a few steps, and benchmarks time one step without a warm-up. A
`python -m jaxtron.X` command whose shell sees this process's devices, or that uses no devices
(the planner), runs in this process (its `main`, as the module's `__main__` calls it, in the
scratch folder, output captured); the rest, such as `--devices` checks that must start JAX
afresh, run as their own processes.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxtron.config.loading import load_config

from conftest import FAST_COMPILE_FLAGS, run_in_process

ROOT = Path(__file__).parent.parent
# What a block's paragraph or section heading says it needs -> why it is not run here.
NEEDS_A_GPU = "needs an NVIDIA GPU"
HARDWARE = {r"On a machine with (an|one) NVIDIA GPU": NEEDS_A_GPU,
            r"On a cluster|Under SLURM|on \d+ nodes|two\s+hosts": "needs a cluster",
            r"Import from Hugging Face": "needs a model downloaded from Hugging Face (the "
                                         "README's walkthrough imports one it exported)",
            r"another transformers release": "installs transformers and torch"}
ON_A_GPU = re.compile(r"#\s*on (a|an|one) .*GPU")  # a line's own comment
NOT_RUN = {"make test": "this suite", "source .venv/bin/activate": "the tests run inside it"}
# Appended to shrink a command (the training flags also to a launch's job); later overrides win.
TRAINING = ["train.log_every=1", "train.eval_batches=1", "data.builtin_max_bytes=400000"]
TINY = {"jaxtron.train": TRAINING, "jaxtron.launch": TRAINING,
        "jaxtron.bench": ["--warmup", "0", "--steps", "1", "--repeats", "1"],
        "jaxtron.data.throughput": ["--batches", "5", "data.builtin_max_bytes=400000"]}
STEP_SCALE = 50  # step counts divided by this (at least 1): the tiny config's 200 steps -> 4
# Commands whose output does not depend on how many devices their process sees: they run in
# this process whatever the page's device count. (The planner plans for its `--devices`; on
# `--hardware cpu` it measures the machine, which all simulated devices share.)
DEVICE_FREE = ("jaxtron.plan", "jaxtron.pipeline.show", "jaxtron.data.prepare")


def readme_commands(page: str = "README.md") -> list[tuple[str, str | None]]:
    """(command line, why it is not run or None), in the page's order."""
    text = (ROOT / page).read_text()
    commands = []
    for match in re.finditer(r"```bash\n(.*?)```", text, re.S):
        above = re.sub(r"```.*?```", "", text[:match.start()], flags=re.S).rstrip()
        heading = (re.findall(r"^#+ .*$", above, re.M) or [""])[-1]
        before = heading + "\n" + above.rsplit("\n\n", 1)[-1]
        needs = next((why for phrase, why in HARDWARE.items() if re.search(phrase, before)),
                     None)
        for line in match.group(1).replace("\\\n", " ").splitlines():
            line, _, comment = line.partition("  #")
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            gpu = NEEDS_A_GPU if ON_A_GPU.search("#" + comment) else None
            for command in line.split(" && "):
                commands.append((command, needs or gpu or NOT_RUN.get(command)))
    return commands


def shrunk_steps(words: list[str], cwd: Path) -> list[str]:
    """A command's step counts divided by STEP_SCALE: its `train.steps=`, `checkpoint.every=`
    and `--step`, and, for a training command that names none, its config's `train.steps`."""
    def scaled(count: str) -> str:  # at least 1, but 0 (no periodic saves) stays 0
        return str(max(1, int(count) // STEP_SCALE) if int(count) else 0)
    out = [re.sub(r"^(train\.steps|checkpoint\.every)=(\d+)$",
                  lambda m: f"{m.group(1)}={scaled(m.group(2))}", w) for w in words]
    out = [scaled(w) if i and out[i - 1] == "--step" else w for i, w in enumerate(out)]
    trains = out[2:3] in (["jaxtron.train"], ["jaxtron.launch"]) and "--config" in out
    if (trains and not any(w.startswith("train.steps=") for w in out)
            and not {"--dry-run", "--print-config"} & set(out)):
        config = load_config(str(cwd / out[out.index("--config") + 1]), [])
        out.append(f"train.steps={scaled(config.train.steps)}")
    return out


def as_argv(line: str, cwd: Path) -> tuple[dict, list[str]]:
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
        words = shrunk_steps(words + TINY.get(module, []), cwd)
    return env, words


def devices_in(env: dict) -> int:
    match = re.search(r"--xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
    return int(match.group(1)) if match else 1


def run(line: str, env: dict, cwd: Path) -> tuple[int, str, str]:
    extra_env, argv = as_argv(line, cwd)
    env = {**env, **extra_env}
    fresh_jax = argv[2:3] == ["jaxtron.train"] and "--devices" in argv  # simulates devices
    here = (argv[1:2] == ["-m"] and argv[2].startswith("jaxtron.") and not fresh_jax
            and (devices_in(env) == jax.device_count() or argv[2] in DEVICE_FREE))
    if here:
        result = run_in_process(argv[2], *argv[3:], cwd=cwd)
        return result.returncode, result.stdout, result.stderr
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    return result.returncode, result.stdout, result.stderr


def run_in_order(commands, tmp_path: Path) -> dict[str, str]:
    """Run every command not marked otherwise in a scratch folder: -> {line run: its output}
    (an `export` sets the shell's environment and is not a run)."""
    for name in ("configs", "examples", "jaxtron", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    # A user's shell: no device count unless the page sets one (the tests' faster compile
    # flags are kept on top).
    shell = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    ran = {}
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
        ran[line] = stdout
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


DOCS = sorted(str(page.relative_to(ROOT)) for page in (ROOT / "docs").glob("*.md")
              if "```bash" in page.read_text())


# What each page's commands leave in the scratch folder.
PRODUCTS = {"docs/checkpoints.md": ["exports/tiny-300/config.yaml", "exports/tiny-hf/config.json"],
            "docs/data.md": ["data/chat.idx", "runs/sft-tiny/metrics.jsonl"],
            "docs/long-context.md": ["runs/tiny/metrics.jsonl"],
            "docs/multihost.md": ["runs/supervised/launch.json"],
            "docs/performance.md": ["runs/planned.yaml", "runs/planned/metrics.jsonl"]}


@pytest.mark.parametrize("page", DOCS)
def test_every_command_of_a_docs_page_runs_in_order(page, tmp_path):
    commands = readme_commands(page)
    ran = run_in_order(commands, tmp_path)
    assert ran or page == "docs/megatron.md", commands  # that page's runs need a cluster
    for product in PRODUCTS.get(page, []):
        assert (tmp_path / product).exists(), (product, list(ran))
    for line, out in ran.items():  # a comparison prints every schedule it was asked for
        if "--compare-schedules" in line:
            words = shlex.split(line)
            names = words[words.index("--compare-schedules") + 1]
            assert all(name in out for name in names.split(",")), (line, out)


def test_the_pages_mark_what_cannot_run_here():
    """The markers are read as the page means them: its GPU, cluster and download lines are
    skipped with their reason, and the CPU launch beside a cluster's is not."""
    why = {page: dict(readme_commands(page)) for page in DOCS}
    assert why["docs/megatron.md"] and all(w == "needs a cluster"
                                           for w in why["docs/megatron.md"].values())
    performance = why["docs/performance.md"]
    assert [w for line, w in performance.items() if "llama3-8b.yaml model" in line] == [
        "needs an NVIDIA GPU"]
    assert performance["scripts/gpu_check.sh"] == "needs an NVIDIA GPU"
    launches = {line: w for line, w in why["docs/multihost.md"].items() if "jaxtron.launch" in line}
    assert sorted(launches.values(), key=str) == [None, "needs a cluster"], launches
    assert any("installs transformers" in str(w) for w in why["docs/checkpoints.md"].values())
