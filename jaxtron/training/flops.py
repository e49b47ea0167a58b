"""Model FLOPs per token and the peak FLOP/s that MFU is measured against.

Training FLOPs per token (Kaplan et al. 2020; Chowdhery et al. 2022, appendix B):

    6 * P_matmul  +  6 * N * (2 * H * K) * (L + 1) / 2

P_matmul counts every weight that takes part in a matmul per token: the q/k/v/o projections,
the MLP, and the output head (tied or not); the embedding lookup and norms are excluded. The
second term is attention: per layer and token, q.k and p.v cost 2 * H * K multiply-adds for each
attended position, and causal masking attends to (L + 1) / 2 positions on average. The factor 6
is 2 (forward multiply-add) x 3 (forward + two backward matmuls). Recompute from remat is not
model FLOPs; it is reported separately as hardware FLOPs where measured. Multi-head latent
attention counts its down- and up-projections, and H * (K_qk + V) in the attention term. With a
sliding window w < L (`model.sliding_window`) position i attends to min(i + 1, w) keys: on
average (w (w + 1) / 2 + (L - w) w) / L, at most w, in place of (L + 1) / 2.
"""

from __future__ import annotations

import functools
import math
import os
import time

import jax
import jax.numpy as jnp

from jaxtron.config.platforms import local_platform
from jaxtron.config.schema import ModelConfig, MoEConfig
from jaxtron.kernels.choice import Kernel, configured_kernel
from jaxtron.runtime.distributed import LaunchError

# Dense bf16 tensor-core peaks per device, FLOP/s (vendor datasheets, without sparsity).
PEAK_FLOPS_BY_KIND = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12, "L4": 121e12,
    "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v4": 275e12, "TPU v6 lite": 918e12,
}


def matmul_params(m: ModelConfig, moe: MoEConfig | None = None) -> int:
    """Weights one token multiplies by; for MoE layers only the top_k routed experts, the shared
    experts and the router count (the active parameters)."""
    d, h, g, k, f = m.d_model, m.num_heads, m.kv_heads, m.resolved_head_dim, m.mlp_dim
    attention = d * h * k + 2 * d * g * k + h * k * d
    if m.attention == "mla":
        qk, v, c = m.qk_head_dim, m.v_head_dim, m.kv_lora_rank
        q = d * m.q_lora_rank + m.q_lora_rank * h * qk if m.q_lora_rank else d * h * qk
        attention = q + d * (c + m.qk_rope_head_dim) + c * h * (m.qk_nope_head_dim + v) + h * v * d
    mlp = (3 if m.type == "llama" else 2) * d * f
    total = m.num_layers * (attention + mlp) + d * m.vocab_size
    if moe is not None and moe.enabled:
        expert = 3 * d * (moe.expert_mlp_dim or f)
        active = (moe.top_k + moe.shared_experts) * expert + d * moe.num_experts
        total += (moe.stacked_layers(m.num_layers) // moe.every) * (active - mlp)
    return total


def attended_keys(seq_len: int, window: int | None = None) -> float:
    """Keys a token attends to on average: (L + 1) / 2 causally; with a window w < L, the
    first w positions see 1..w keys and the other L - w see w each."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def attention_forward_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Causal attention's two matmuls (scores, weighted values) over all layers, forward only,
    over the keys a token attends to on average (`attended_keys`)."""
    per_key = m.num_heads * (m.qk_head_dim + m.value_head_dim)  # 2 H K without MLA
    return 2 * m.num_layers * per_key * attended_keys(seq_len, m.sliding_window)


def training_flops_per_token(m: ModelConfig, seq_len: int, moe: MoEConfig | None = None) -> float:
    return 6 * matmul_params(m, moe) + 3 * attention_forward_flops_per_token(m, seq_len)


@functools.cache
def measure_cpu_peak(size: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of an fp32 matmul on the whole machine (all simulated devices share its cores),
    measured once per process: the machine stays the same from one run to the next.

    XLA's default library: on one large square matmul oneDNN (`cpu_matmuls`) runs at the same
    speed within noise (164-190 against 164-176 GFLOP/s). The fastest single matmul counts, not
    the mean: other work on the machine at start (data threads, a compile) only slows some
    repetitions, and a peak measured low would put MFU above 100%."""
    a = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    fastest, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        began = time.perf_counter()
        matmul(a).block_until_ready()
        fastest = min(fastest, time.perf_counter() - began)
    return 2 * size**3 / fastest


def measure_cpu_peak_for_children() -> float:
    """`measure_cpu_peak` in a process that runs none of its own work on JAX (a supervisor): it
    starts only JAX's CPU backend, so no accelerator memory is taken from its children."""
    jax.config.update("jax_platforms", "cpu")
    return measure_cpu_peak()


CPU_PEAK_ENV = "JAXTRON_CPU_PEAK_FLOPS"


def cpu_peak() -> tuple[float, str]:
    """This machine's fp32 FLOP/s and where the number came from: $JAXTRON_CPU_PEAK_FLOPS when
    set, else measured in this process. `python -m jaxtron.launch` measures once and sets it for
    the CPU processes it starts: measuring at the same moment on the same cores, each would see
    a share of the machine and report its MFU too high, and a restart would measure again."""
    given = given_cpu_peak()
    if given is None:
        return measure_cpu_peak(), "measured fp32 matmul, whole machine"
    return given, f"fp32 matmul, whole machine, from {CPU_PEAK_ENV}"


def given_cpu_peak() -> float | None:
    """$JAXTRON_CPU_PEAK_FLOPS, checked (the commands check it at start)."""
    given = os.environ.get(CPU_PEAK_ENV)
    if given is None:
        return None
    try:
        value = float(given)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise LaunchError(f"the environment variable {CPU_PEAK_ENV}={given!r} is not a rate: set "
                          f"it to this machine's fp32 FLOP/s, e.g. {CPU_PEAK_ENV}=1.8e11, or "
                          "unset it to measure the machine at start.")
    return value


def peak_flops(devices) -> tuple[float, str]:
    """Total peak FLOP/s of `devices` and where the number came from."""
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        return cpu_peak()
    for name, flops in PEAK_FLOPS_BY_KIND.items():
        if name.lower() in kind.lower():
            return flops * len(devices), f"{name} datasheet bf16 x {len(devices)}"
    return float("nan"), f"unknown accelerator {kind!r}"


def recomputes_block_forward(config) -> bool:
    """Whether the backward runs every block's forward again: `model.remat: full` (or
    `offload`, all but attention), or a
    pipeline, whose backward re-runs each stage from its stored input (unless
    `pipeline.recompute: false` stores the residuals instead)."""
    return (config.model.remat in ("full", "offload")
            or (config.mesh.stage > 1 and config.pipeline.recompute))


def save_dots_repeats_attention(config, platform: str | None = None) -> bool:
    """Whether `remat: save_dots` runs the attention forward again in the backward. The
    blockwise (xla), pallas and ring (a `sequence` mesh axis) kernels name their output and
    log-sum-exp, which the policy keeps; cuDNN's residuals have no names."""
    platform = {"gpu": "cuda"}.get(platform, platform) or local_platform()
    return configured_kernel(config, platform) is Kernel.CUDNN


def hardware_flops_per_token(config, platform: str | None = None) -> float:
    """Model FLOPs plus the matmul FLOPs that activation recompute repeats (HFU's numerator).
    `save_dots` keeps the weight matmuls' outputs, and attention's output where the kernel
    names it (`save_dots_repeats_attention`); otherwise it repeats the attention forward."""
    m, seq_len, moe = config.model, config.data.seq_len, config.moe
    model = training_flops_per_token(m, seq_len, moe)
    attention = attention_forward_flops_per_token(m, seq_len)
    if not recomputes_block_forward(config):
        repeats = m.remat == "save_dots" and save_dots_repeats_attention(config, platform)
        return model + (attention if repeats else 0.0)
    blocks = matmul_params(m, moe) - m.d_model * m.vocab_size
    # `offload` brings attention's output back from the host: its forward is not repeated
    kept = m.remat == "offload" and not (config.mesh.stage > 1 and config.pipeline.recompute)
    return model + 2 * blocks + (0.0 if kept else attention)
