import time

import numpy as np
import pytest

from jaxtron import launch, train
from jaxtron.runtime.distributed import LaunchError
from jaxtron.supervisor.local_job import LocalJob
from jaxtron.training.flops import (
    CPU_PEAK_ENV,
    cpu_peak,
    matmul_params,
    training_flops_per_token,
)

from conftest import make_config
from test_bad_input import fails_with_one_line


def test_flops_per_token_matches_a_hand_count():
    # 2 layers, D=64, H=4, G=2, K=16, F=128, V=256, L=32, llama (SwiGLU: three D x F matrices).
    m = make_config().model
    q, kv, o = 64 * 4 * 16, 2 * 64 * 2 * 16, 4 * 16 * 64      # 4096, 4096, 4096
    mlp = 3 * 64 * 128                                         # 24576
    head = 64 * 256                                            # 16384
    params = 2 * (q + kv + o + mlp) + head                     # 90112
    assert matmul_params(m) == params == 90112
    # Causal attention: position i attends to i + 1 keys; summed over L = 32 positions that is
    # 32 * 33 / 2 = 528 key positions, so (L + 1) / 2 = 16.5 per token, each costing
    # 2 (qk and pv) * H * K = 128 multiply-adds = 256 FLOPs forward, x3 for training, x2 layers.
    attention = 2 * 3 * 256 * 16.5
    assert training_flops_per_token(m, 32) == 6 * 90112 + attention == 566016


def test_gpt2_small_parameter_count_is_the_published_one():
    from jaxtron.config.loading import load_config
    m = load_config("configs/gpt2-124m.yaml").model
    # 85M non-embedding matmul weights (12 * 12 * 768^2) plus the tied 768 x 50304 head.
    assert matmul_params(m) == 12 * 12 * 768 * 768 + 768 * 50304


def test_recompute_adds_the_forward_matmuls_each_policy_repeats():
    from jaxtron.training.flops import hardware_flops_per_token

    base = make_config()
    model = training_flops_per_token(base.model, 32)
    attention_forward = 2 * 256 * 16.5          # both layers' forward, from the hand count above
    blocks = 90112 - 64 * 256                   # matmul weights outside the head

    def hardware(policy, platform="cpu"):
        return hardware_flops_per_token(make_config(model={"remat": policy}), platform)

    assert hardware("none") == model
    # save_dots keeps weight-matmul outputs and the blockwise kernel's named output...
    assert hardware("save_dots") == model
    # ...but cuDNN's (attention_impl auto on a GPU) has no name: its forward runs again.
    assert hardware("save_dots", "gpu") == model + attention_forward
    # full repeats every block's forward: weights (2 FLOPs per weight) and attention.
    assert hardware("full") == model + 2 * blocks + attention_forward


def numpy_matmul_flops(size: int = 1024, seconds: float = 0.5) -> float:
    """The fastest fp32 matmul numpy's BLAS runs here: an independent view of the same cores."""
    a = np.ones((size, size), np.float32)
    fastest, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        began = time.perf_counter()
        a @ a
        fastest = min(fastest, time.perf_counter() - began)
    return 2 * size**3 / fastest


def test_the_cpu_peak_is_measured_unless_the_environment_gives_it(monkeypatch):
    monkeypatch.delenv(CPU_PEAK_ENV, raising=False)
    measured, source = cpu_peak()
    assert source == "measured fp32 matmul, whole machine"
    # Another library's matmul on the same cores lands near it (both are noisy under load).
    assert 0.25 < measured / numpy_matmul_flops() < 4, measured
    monkeypatch.setenv(CPU_PEAK_ENV, "1.5e11")
    assert cpu_peak() == (1.5e11, f"fp32 matmul, whole machine, from {CPU_PEAK_ENV}")


@pytest.mark.parametrize("value", ["fast", "0", "-2e11", "nan", "inf", ""])
def test_a_cpu_peak_that_is_not_a_rate_is_one_line_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(CPU_PEAK_ENV, value)
    with pytest.raises(LaunchError, match=f"{CPU_PEAK_ENV}={value!r} is not a rate: set it"):
        cpu_peak()


@pytest.mark.parametrize("command, argv", [
    (train, ["--config", "configs/tiny.yaml"]),
    (launch, ["--processes", "2", "--cpu-devices", "4", "--", "--config", "configs/tiny.yaml"]),
])
def test_the_commands_refuse_a_bad_cpu_peak_at_start(monkeypatch, capsys, tmp_path, command,
                                                     argv):
    monkeypatch.setenv(CPU_PEAK_ENV, "fast")
    run_dir = tmp_path / "run"
    fails_with_one_line(capsys, command.main, [*argv, f"train.run_dir={run_dir}"],
                        f"{CPU_PEAK_ENV}='fast' is not a rate")
    assert not run_dir.exists()  # before anything started


def test_the_supervisor_measures_once_for_every_cpu_process_it_starts(monkeypatch):
    monkeypatch.delenv(CPU_PEAK_ENV, raising=False)
    job = LocalJob(2, [], make_config(), cpu_devices=4, heartbeat_timeout_s=10,
                   min_processes=2)
    first, second = job.environment(0, 1234), job.environment(1, 1234)
    assert float(first[CPU_PEAK_ENV]) > 0 and first[CPU_PEAK_ENV] == second[CPU_PEAK_ENV]
    assert first["JAX_PROCESS_ID"] == "0" and second["JAX_PROCESS_ID"] == "1"
    monkeypatch.setenv(CPU_PEAK_ENV, "1.5e11")  # given: passed on as it is
    assert job.environment(0, 1234)[CPU_PEAK_ENV] == "1.5e11"
    monkeypatch.delenv(CPU_PEAK_ENV)
    one_device_each = LocalJob(2, [], make_config(), cpu_devices=None, heartbeat_timeout_s=10,
                               min_processes=2)
    assert float(one_device_each.environment(0, 1234)[CPU_PEAK_ENV]) > 0  # JAX_PLATFORMS=cpu
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # processes on accelerators: none measured
    on_accelerators = LocalJob(2, [], make_config(), cpu_devices=None, heartbeat_timeout_s=10,
                               min_processes=2)
    assert CPU_PEAK_ENV not in on_accelerators.environment(0, 1234)
