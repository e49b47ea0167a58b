"""How the suite picks JAX's platform: the simulated CPU devices unless the session asks for
the GPU tests, so that `pytest -m gpu` on a GPU machine tests the GPU; and what
`--compile-times` counts: compile stages and CPU seconds."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp

from conftest import CompileSeconds, cpu_seconds, selects_gpu_tests


def test_gpu_sessions_leave_the_platform_to_jax():
    assert selects_gpu_tests("gpu") and selects_gpu_tests("gpu and not slow")
    assert not selects_gpu_tests("") and not selects_gpu_tests("not gpu")


def test_other_sessions_run_on_the_simulated_cpu_devices():
    assert jax.default_backend() == "cpu" and jax.device_count() == 8
    assert os.environ["JAX_PLATFORMS"] == "cpu"  # the CLIs a test starts, too


def test_a_gpu_session_does_not_pin_the_cpu():
    """`pytest -m gpu` collects with JAX_PLATFORMS unset: JAX takes the accelerator if any."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    probe = ("import os, jax; print('platforms', os.environ.get('JAX_PLATFORMS'), "
             "jax.config.jax_platforms)")
    conftest_dir = os.path.dirname(__file__)
    code = (f"import sys; sys.path.insert(0, {conftest_dir!r}); import pytest; "
            "import conftest\n"
            "class Probe:\n"
            "    def pytest_collection_finish(self, session):\n"
            f"        exec({probe!r})\n"
            "sys.exit(pytest.main(['-m', 'gpu', '--collect-only', '-q', '-p', "
            f"'no:cacheprovider', {os.path.join(conftest_dir, 'test_gpu.py')!r}], "
            "plugins=[Probe()]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "platforms None None" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_compile_times_count_each_stage_of_a_new_program():
    """What `--compile-times` registers adds up JAX's tracing, lowering and compile events,
    and nothing else JAX reports."""
    counted = CompileSeconds()
    jax.monitoring.register_event_duration_secs_listener(counted.add)
    try:
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.arange(7.0)).block_until_ready()
        jax.monitoring.record_event_duration_secs("/jax/some/other/event", 100.0)
    finally:
        jax.monitoring.unregister_event_duration_listener(counted.add)
    assert all(0 < s < 100 for s in counted.seconds.values()), counted.seconds
    assert str(counted).startswith("tracing ") and ", XLA compile " in str(counted)


def test_cpu_seconds_count_a_started_process_apart_from_the_test_process():
    """A process started and waited for counts as started, not as the test process's own."""
    before = cpu_seconds()
    busy = "import time\nwhile time.process_time() < 0.5: pass"
    subprocess.run([sys.executable, "-c", busy], check=True, timeout=60)
    after = cpu_seconds()
    started = after["processes they started"] - before["processes they started"]
    own = after["test processes"] - before["test processes"]
    assert started >= 0.5 and own < 0.25, (started, own)
