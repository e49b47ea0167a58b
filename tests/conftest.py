"""Eight simulated CPU devices for every test, and a per-session corpus cache."""

import json
import os

# The tests compile far more than they run: their models are tiny and nearly every test builds
# new programs. LLVM's optimisation level 0 cuts XLA:CPU's compile time by about 40%; the HLO
# passes (sharding propagation, SPMD partitioning, fusion, scheduling, buffer assignment) are
# those of a real run, and the arithmetic differs only at round-off. Subprocesses inherit it.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_force_host_platform_device_count=8",
                                    FAST_COMPILE_FLAG]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxtron import config as config_lib  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

TINY_MODEL = {"num_layers": 2, "d_model": 64, "num_heads": 4, "num_kv_heads": 2,
              "mlp_dim": 128, "vocab_size": 256, "max_seq_len": 256}


@pytest.fixture(scope="session", autouse=True)
def corpus_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("jaxtron-cache")
    os.environ["JAXTRON_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One persistent XLA compilation cache for the session, shared with the CLI subprocesses:
    the same tiny programs are compiled by many tests, and a cache hit skips XLA entirely."""
    path = str(tmp_path_factory.mktemp("xla-cache"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def long_run_env() -> dict:
    """The environment for a CLI run of many steps, where run time outweighs compile time: the
    flags a user has (LLVM's default optimisation level)."""
    flags = os.environ["XLA_FLAGS"].replace(FAST_COMPILE_FLAG, "").strip()
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
    return config_lib.from_dict(raw, [f"{k}={v}" for k, v in (overrides or {}).items()])


def first_batch_objective_metrics_grads(config, devices: int):
    """(objective, metrics, gradients in the model layout) of the config's first training
    batch on the first `devices` devices: what layout-equivalence tests compare."""
    from jaxtron.data.pipeline import open_dataset, train_batches
    from jaxtron.trainer import Trainer

    trainer = Trainer(config, devices=jax.devices()[:devices])
    state = trainer.init_state()
    batch = trainer.put_batch(next(train_batches(config, open_dataset(config))))
    with trainer._tracing():
        (objective, metrics), grads = trainer._grads(state.params, batch)
    return (float(objective), jax.device_get(metrics),
            jax.device_get(trainer.to_model_params(grads)))


def metric_records(run_dir) -> list[dict]:
    """The records a training run appended to <run_dir>/metrics.jsonl, in order."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses_by_step(run_dir) -> dict:
    """Per-step losses; a step logged again after a resume overwrites the earlier record."""
    return {r["step"]: r["loss"] for r in metric_records(run_dir)}
