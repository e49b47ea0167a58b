"""Eight simulated CPU devices for every test, a per-session corpus cache, one compilation
cache and one measurement of the CPU peak for every worker of a session, and the longest tests
first."""

import contextlib
import dataclasses
import gc
import importlib
import io
import json
import os
import resource
import subprocess
from pathlib import Path

# The tests compile far more than they run: their models are tiny and nearly every test builds
# new programs (XLA's backend compile is about 40% of the suite's CPU time, tracing and lowering
# another 22%: `make test ARGS=--compile-times`). LLVM's optimisation level 0 cuts XLA:CPU's
# compile time by about 40%, and XLA:CPU's elemental emitters in place of its fusion emitters
# more than halve what is left (three steps: 5.6 -> 2.2 s). Code generation in one piece, not
# split for parallel threads, takes 5% more off the CPU time (the two workers already keep both
# cores busy). The sharding passes are a real run's, so collectives and the numbers every
# layout is compared on are; buffer sizes and rounding differ, so the tests that measure
# compiled memory, or compare two formulas at round-off, compile with `USERS_CODEGEN`. Most
# layouts' memory is within 0.01% either way, but not all: under these flags interleaved and
# ZB-V steps hold 1.18 MB fewer temporaries, a tenth and a twentieth of theirs
# (tests/test_pipeline.py: `temp_bytes`, 4 stages).
# Subprocesses inherit the flags; the two CLI runs of many steps that check learning drop them
# (`long_run_env`).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                      "--xla_cpu_parallel_codegen_split_count=1")
# What a test that measures compiled memory, or compares with an oracle at round-off, compiles
# with instead: XLA:CPU's default emitters, as every run compiles (`compile(compiler_options=)`).
USERS_CODEGEN = {"xla_cpu_use_fusion_emitters": True}
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_force_host_platform_device_count=8",
                                    FAST_COMPILE_FLAGS]).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxtron.config.loading import config_from_dict
from jaxtron.training.flops import CPU_PEAK_ENV, measure_cpu_peak

jax.config.update("jax_default_matmul_precision", "highest")

# Tracing a step makes millions of short-lived objects: collecting less often (and never the
# modules imported so far) takes about 15% off tracing.
gc.set_threshold(50_000, 20, 20)
gc.freeze()

TINY_MODEL = {"num_layers": 2, "d_model": 64, "num_heads": 4, "num_kv_heads": 2,
              "mlp_dim": 128, "vocab_size": 256, "max_seq_len": 256}


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether `-m` asks for the GPU tests (`gpu`, `gpu and not slow`), not against them."""
    return "gpu" in markexpr and "not gpu" not in markexpr


def pytest_configure(config):
    """JAX runs on the simulated CPU devices, in this process and the CLIs it starts, unless
    JAX_PLATFORMS says otherwise or the session selects the GPU tests (`pytest -m gpu`), which
    then run on the machine's accelerator. No backend has started yet: only the flag is set
    (an xdist controller then starts the CPU one to measure the peak for its workers)."""
    if os.environ.get("JAX_PLATFORMS") is None and not selects_gpu_tests(
            config.getoption("markexpr") or ""):
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")
    if config.getoption("numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        one_cpu_peak_for_the_session()  # before the workers start: they inherit it
    if config.getoption("--compile-times"):
        jax.monitoring.register_event_duration_secs_listener(_COMPILE_SECONDS.add)


@pytest.fixture(scope="session", autouse=True)
def corpus_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("jaxtron-cache")
    os.environ["JAXTRON_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One persistent XLA compilation cache for the session, shared by every xdist worker and
    the CLI subprocesses: a program one of them compiled is read back by the others. Only
    programs that took half a second or more are kept: with every small one kept too, the
    suite takes a fifth longer (each write also walks the folder to hold the size limit). It
    lives in the session's pytest folder (a worker's parent), which pytest removes three
    sessions later. A size limit turns on the cache's file lock, so workers never read an
    entry half written. Entries are compressed with zstandard (the test extra), which JAX
    prefers to zlib when installed: a third less time per write."""
    base = tmp_path_factory.getbasetemp()
    path = str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "xla-cache")
    settings = {"JAX_COMPILATION_CACHE_DIR": path,
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
                "JAX_COMPILATION_CACHE_MAX_SIZE": str(8 * 2**30)}
    os.environ.update(settings)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_compilation_cache_max_size", 8 * 2**30)
    return path


def one_cpu_peak_for_the_session() -> None:
    """One measurement of the machine's CPU peak for every process of the session (the xdist
    workers and the CLIs they start), as `jaxtron.launch` gives its processes one: measuring
    takes 0.6 s of both cores in each, and processes measuring at once see a share of the
    cores. tests/test_flops.py checks the measurement itself."""
    if os.environ.get("JAX_PLATFORMS") == "cpu" and CPU_PEAK_ENV not in os.environ:
        os.environ[CPU_PEAK_ENV] = repr(measure_cpu_peak())


@pytest.fixture(scope="session", autouse=True)
def cpu_peak(compilation_cache):
    """Without xdist, measured here: after the compilation cache is set, since JAX decides at
    its first compile whether a process uses one."""
    one_cpu_peak_for_the_session()


DURATIONS = Path(__file__).parent / "durations.json"


def pytest_collection_modifyitems(config, items):
    """Longest tests first, dealt alternately to the two halves that pytest-xdist's worksteal
    hands its two workers: each starts with its longest tests and steals short ones at the end,
    so no long test starts last. Seconds per test id come from tests/durations.json (written
    by `pytest --durations-file`); a test not listed there counts as a short one."""
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    ranked = sorted(items, key=lambda item: -known.get(item.nodeid, 1.0))
    items[:] = ranked[0::2] + ranked[1::2]


def pytest_addoption(parser):
    parser.addoption("--durations-file", action="store_true",
                     help="write each test's setup + call seconds to tests/durations.json")
    parser.addoption("--compile-times", action="store_true",
                     help="print the seconds the tests' processes (not the CLIs they start) "
                          "spent tracing, lowering and compiling, from JAX's compile events, "
                          "and the CPU seconds of the test processes and of those they started")


class CompileSeconds:
    """Seconds spent on each stage of building programs, from JAX's duration events."""

    EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "tracing",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
              "/jax/core/compile/backend_compile_duration": "XLA compile"}

    def __init__(self):
        self.seconds = dict.fromkeys(self.EVENTS.values(), 0.0)

    def add(self, event: str, seconds: float, **_):
        """A `jax.monitoring` duration listener."""
        if event in self.EVENTS:
            self.seconds[self.EVENTS[event]] += seconds

    def __str__(self):
        return ", ".join(f"{name} {s:.0f}" for name, s in self.seconds.items())


_COMPILE_SECONDS = CompileSeconds()


def cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds of this process, and of the processes it started and waited
    for (theirs included): the CLIs, launchers and multi-process runs the tests start."""
    own, started = (resource.getrusage(who)
                    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return {"test processes": own.ru_utime + own.ru_stime,
            "processes they started": started.ru_utime + started.ru_stime}


_WORKERS_CPU_SECONDS: list[dict[str, float]] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """A pytest-xdist worker's compile and CPU seconds, added to the session's."""
    output = getattr(node, "workeroutput", {})
    for name, seconds in output.get("compile_seconds", {}).items():
        _COMPILE_SECONDS.seconds[name] += seconds
    if "cpu_seconds" in output:
        _WORKERS_CPU_SECONDS.append(output["cpu_seconds"])


def pytest_terminal_summary(terminalreporter, config):
    if config.getoption("--compile-times"):
        terminalreporter.write_line(f"compile seconds: {_COMPILE_SECONDS}")
        processes = _WORKERS_CPU_SECONDS or [cpu_seconds()]  # the workers', or this process's
        terminalreporter.write_line("CPU seconds: " + ", ".join(
            f"{name} {sum(p[name] for p in processes):.0f}" for name in processes[0]))


_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call"):
        _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker reports to the session
        session.config.workeroutput["compile_seconds"] = _COMPILE_SECONDS.seconds
        session.config.workeroutput["cpu_seconds"] = cpu_seconds()
    if session.config.getoption("--durations-file") and _SECONDS:
        rows = {k: round(v, 1) for k, v in sorted(_SECONDS.items(), key=lambda x: -x[1])
                if v >= 0.5}
        DURATIONS.write_text(json.dumps(rows, indent=0) + "\n")


def long_run_env() -> dict:
    """The environment for a CLI run of many steps, where run time outweighs compile time: the
    flags a user has (LLVM's default optimisation level)."""
    flags = os.environ["XLA_FLAGS"].replace(FAST_COMPILE_FLAGS, "").strip()
    return dict(os.environ, XLA_FLAGS=flags)


def make_config(overrides: dict | None = None, model: dict | None = None, **sections):
    """A small config: TINY_MODEL plus per-section dicts, e.g. make_config(train={...})."""
    raw = {"model": {**TINY_MODEL, **(model or {})},
           "data": {"seq_len": 32, "builtin_max_bytes": 400_000},
           "train": {"batch_size": 8, "steps": 10, "log_every": 5, "eval_every": 0,
                     "eval_batches": 2},
           "optim": {"warmup_steps": 2}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return with_named_schedule(config_from_dict(
        raw, [f"{k}={v}" for k, v in (overrides or {}).items()]))


def with_named_schedule(config):
    """A pipelined config that leaves `pipeline.schedule: auto` with 1F1B named: a trainer
    built in code needs a named schedule (the commands choose one, tests/test_schedule_choice.py
    checks how)."""
    if config.mesh.stage > 1 and config.pipeline.schedule == "auto":
        return dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline,
                                                                         schedule="1f1b"))
    return config


def first_batch_objective_metrics_grads(config, devices: int):
    """(objective, metrics, gradients in the model layout) of the config's first training
    batch on the first `devices` devices: what layout-equivalence tests compare."""
    from jaxtron.data.pipeline import open_dataset, train_batches
    from jaxtron.training.trainer import Trainer

    trainer = Trainer(config, devices=jax.devices()[:devices])
    state = initial_state(trainer)
    batch = trainer.put_batch(next(train_batches(config, open_dataset(config))))
    with trainer._tracing():
        (objective, metrics), grads = trainer._grads(state.params, batch)
    return (float(objective), jax.device_get(metrics),
            trainer.to_model_params(jax.device_get(grads)))


_ONE_DEVICE_REFERENCES: dict[str, tuple] = {}  # repr(config) -> its first batch on one device


def one_device_reference(config):
    """`first_batch_objective_metrics_grads(config, 1)`, computed once per config in a
    process: several layouts compare with the same one-device run. Not for a test that
    changes the code the reference runs (`monkeypatch`): its second run would not be run."""
    key = repr(config)
    if key not in _ONE_DEVICE_REFERENCES:
        _ONE_DEVICE_REFERENCES[key] = first_batch_objective_metrics_grads(config, 1)
    return _ONE_DEVICE_REFERENCES[key]


def run_in_process(module: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` as its `__main__` runs it, but in this process with its
    output captured: for a command test that checks what the command prints or writes, not
    what a process of its own does (starting Python and importing JAX and jaxtron take about
    2 s). Returns what `subprocess.run` would: exit status, stdout and stderr."""
    main = importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(args))
            except SystemExit as exit_:  # argparse's --help and its usage errors
                status = exit_.code
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess([module, *args], status or 0, out.getvalue(),
                                       err.getvalue())


def metric_records(run_dir) -> list[dict]:
    """The records a training run appended to <run_dir>/metrics.jsonl, in order."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses_by_step(run_dir) -> dict:
    """Per-step losses; a step logged again after a resume overwrites the earlier record."""
    return {r["step"]: r["loss"] for r in metric_records(run_dir)}


_ONE_DEVICE_PARAMS: dict[tuple, object] = {}  # (model, moe, seed) -> host parameters


@contextlib.contextmanager
def kept_in_the_compilation_cache():
    """Programs compiled inside are kept in the session's compilation cache however quickly
    they compiled: for a program that each worker would otherwise compile again."""
    least = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", least)


def initial_state(trainer):
    """The values of `trainer.init_state()` without compiling its initialisation for each
    layout: each model is initialised once on one device and placed onto the trainer's
    shardings (as pipeline stages where it has them). Tests of a layout's step start here;
    `tests/test_train.py` checks that `init_state` itself gives these values on every layout."""
    c = trainer.config
    key = (c.model, c.moe, c.train.seed)
    if key not in _ONE_DEVICE_PARAMS:
        one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        with kept_in_the_compilation_cache():  # the other worker initialises the same models
            _ONE_DEVICE_PARAMS[key] = jax.device_get(
                jax.jit(trainer._initial_params, out_shardings=one_device)())
    return jax.device_put(trainer._fresh_state(_ONE_DEVICE_PARAMS[key]),
                          trainer.state_shardings)
