"""Host-memory tuning: on one CPU device, repeated steps stop page-faulting their buffers."""

import os
import subprocess
import sys

import pytest

from jaxtron.runtime import host_memory

# A step whose temporary, a [3072, 3072] fp32 matrix (36 MiB), is allocated by XLA's worker
# threads. It is larger than glibc's largest dynamic mmap threshold (32 MiB on 64-bit), so
# without the tuning it is mapped afresh every step whatever malloc's history; a smaller one
# may or may not be, and the baseline would be flaky.
REPEATED_STEPS = """
import resource, sys
import jaxtron, jaxtron.train, jaxtron.training.trainer  # importing alone must change nothing
from jaxtron.runtime.host_memory import keep_freed_host_memory
kept = keep_freed_host_memory() if sys.argv[1] == "tune" else False  # as the CLI entry points
import jax, jax.numpy as jnp

@jax.jit
def step(x):
    y = jnp.tanh(x @ x.T)
    return (y @ x).sum()

x = jnp.full((3072, 64), 1e-3, jnp.float32)
step(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step(x).block_until_ready()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_over_five_steps(tune=True, **env_overrides):
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", **env_overrides)
    result = subprocess.run([sys.executable, "-c", REPEATED_STEPS, "tune" if tune else "import"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    kept, faults = result.stdout.split()
    return kept == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_one_device_steps_reuse_their_pages():
    kept, faults = faults_over_five_steps()
    untouched, baseline = faults_over_five_steps(JAXTRON_KEEP_HOST_MEMORY="0")
    _, imported_only = faults_over_five_steps(tune=False)
    assert kept and not untouched
    # Without the tuning every step maps its temporaries afresh: thousands of faults per step.
    assert baseline > 4000, baseline
    assert faults < baseline / 20, (faults, baseline)
    # Importing jaxtron (and its CLI modules) tunes nothing: faults as many as untuned.
    assert imported_only > baseline / 2, (imported_only, baseline)


def test_applies_only_to_one_cpu_device(monkeypatch):
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert host_memory.simulated_cpu_devices() == 8
    assert not host_memory.keep_freed_host_memory()  # several simulated devices: left alone
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
    assert host_memory.simulated_cpu_devices() == 1
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "4")
    assert host_memory.simulated_cpu_devices() == 4


def test_accelerator_platforms_are_left_alone(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not host_memory.jax_runs_on_cpu()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.jax_runs_on_cpu()
