"""CPU matmul library: XLA's by default; oneDNN on request, with XLA's results."""

import jax
import numpy as np
import pytest

from jaxtron import bench
from jaxtron.runtime.cpu_matmuls import ENV, compiler_options, onednn_available
from jaxtron.runtime.distributed import LaunchError
from jaxtron.training.trainer import Trainer

from conftest import make_config

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="oneDNN is used on Linux x86-64")


@pytest.fixture
def no_persistent_cache():
    """The tests' persistent compilation cache off while a Trainer chooses its options."""
    path = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", path)


def one_device_run(library: str, monkeypatch):
    """Compiled HLO, the first step's gradients and two steps' losses with one library."""
    monkeypatch.setenv(ENV, library)
    # Grouped-query attention and SwiGLU: batched attention dots and the plain matmuls of every
    # layout the backward produces (weight gradients contract the token axis).
    config = make_config(mesh={"data": 1})
    trainer = Trainer(config, jax.devices()[:1])
    state = trainer.init_state()
    batch = trainer.put_batch({"tokens": bench.random_tokens(config)})
    hlo = trainer.compile_step(state, batch).as_text()
    _, grads = trainer.loss_and_grads(state.params, batch)
    losses = []
    for _ in range(2):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return hlo, jax.tree.leaves(jax.device_get(grads)), np.array(losses)


@needs_onednn
@pytest.mark.filterwarnings("ignore:Error writing persistent compilation cache entry")
def test_onednn_step_matches_xla_step(monkeypatch, no_persistent_cache):
    onednn_hlo, onednn_grads, onednn_losses = one_device_run("onednn", monkeypatch)
    xla_hlo, xla_grads, xla_losses = one_device_run("xla", monkeypatch)
    assert "__onednn_fusion" in onednn_hlo
    assert "__onednn_fusion" not in xla_hlo
    np.testing.assert_allclose(onednn_losses, xla_losses, rtol=1e-5)
    assert len(onednn_grads) == len(xla_grads)
    for ours, theirs in zip(onednn_grads, xla_grads):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)


@needs_onednn
def test_a_persistent_compilation_cache_keeps_xlas_matmuls(monkeypatch):
    # The tests run with JAX's persistent compilation cache, which cannot store oneDNN steps.
    monkeypatch.setenv(ENV, "onednn")
    assert jax.config.jax_compilation_cache_dir
    assert compiler_options(jax.devices()[:1]) is None


def test_xla_matmuls_unless_asked(monkeypatch, no_persistent_cache):
    """An experimental option that can abort the process is never on by default."""
    monkeypatch.delenv(ENV, raising=False)
    assert compiler_options(jax.devices()[:1]) is None


@needs_onednn
def test_options_only_for_one_cpu_device(monkeypatch, no_persistent_cache):
    monkeypatch.setenv(ENV, "onednn")
    one_cpu = jax.devices()[:1]
    assert compiler_options(one_cpu)["xla_cpu_use_onednn"] is True
    # Several devices would run one oneDNN executable concurrently: XLA then aborts when the
    # executable is freed (object_pool.h, "available_.size() == num_created_").
    assert compiler_options(jax.devices()[:2]) is None

    class Accelerator:
        platform = "gpu"

    assert compiler_options([Accelerator()]) is None
    monkeypatch.setenv(ENV, "xla")
    assert compiler_options(one_cpu) is None


def test_unknown_library_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV, "mkl")
    with pytest.raises(LaunchError, match=f"{ENV}='mkl'.*{ENV}=xla"):
        compiler_options(jax.devices()[:1])
