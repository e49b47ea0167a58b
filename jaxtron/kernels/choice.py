"""Which attention kernel runs: one decision from (platform, dtype, shape, features), taken
while a step is traced, checked when a Trainer is built, and read by `--dry-run`'s report.

`model.attention_impl` states a preference; the kernel that runs depends on the platform the
step is built for (`config/platforms.py`), the compute dtype, the head dim and the features the
call needs:

| impl     | cpu                 | cuda                                  | rocm   | tpu    |
|----------|---------------------|---------------------------------------|--------|--------|
| `auto`   | xla (blockwise)     | cuDNN where it serves, else Triton    | Triton | splash |
| `pallas` | Pallas, interpreted | Triton                                | Triton | splash |
| `xla`    | xla                 | xla                                   | xla    | xla    |
| `cudnn`  | error               | cuDNN (Triton where it cannot serve)  | error  | error  |

cuDNN serves bf16/fp16 with a head dim that is a multiple of 8 and at most 128 (256 on
Hopper), without packed segments (JAX's cuDNN call takes no segment ids) and with as many
queries as keys (its causal mask is top-left aligned; every other kernel's bottom-right).
Explicit `cudnn` runs Triton for the calls it cannot serve that way, and refuses a platform,
dtype or head dim it never serves. With ring or hybrid context parallelism (a `sequence` mesh
axis) every impl runs as ring attention; with `mesh.context_parallel=all_to_all` the kernel
above runs on whole sequences between two all-to-alls.

cuDNN can only be traced where cuDNN is installed: on any other machine a step lowered for
CUDA (`--dry-run --target cuda`) lowers Triton in cuDNN's place (`cudnn_traceable=False`), and
the report says so.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from jaxtron.config.platforms import compute_dtype, local_platform
from jaxtron.config.schema import Config
from jaxtron.errors import ConfigError


class AttentionImpl(str, enum.Enum):
    """What `model.attention_impl` asks for."""
    AUTO = "auto"
    XLA = "xla"
    CUDNN = "cudnn"
    PALLAS = "pallas"


class Kernel(str, enum.Enum):
    """What actually runs."""
    XLA = "xla"
    CUDNN = "cudnn"
    TRITON = "pallas-triton"
    INTERPRET = "pallas-interpret"
    SPLASH = "splash"
    RING = "ring"


DESCRIPTIONS = {
    Kernel.XLA: "plain XLA (blockwise causal attention)",
    Kernel.CUDNN: "cuDNN flash attention",
    Kernel.TRITON: "jaxtron's flash attention in Pallas, lowered through Triton",
    Kernel.INTERPRET: "jaxtron's flash attention in Pallas, interpreted (slow; for tests)",
    Kernel.SPLASH: "JAX's splash attention (Pallas, Mosaic TPU)",
    Kernel.RING: "ring attention over the sequence axis (plain XLA per ring step)",
}


def cudnn_present() -> bool:
    """Whether cuDNN can be traced here: only on a machine whose devices are CUDA GPUs (JAX's
    cuDNN attention checks the library's version while tracing)."""
    return local_platform() == "cuda"


def _hopper_here() -> bool:
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    return float(capability) >= 9.0


def cudnn_serves(dtype, head_dim: int, hopper: bool = False) -> bool:
    """Whether JAX's cuDNN flash attention takes these dtypes and head dims (its own checks,
    restated)."""
    return (jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0
            and head_dim <= (256 if hopper else 128))


def choose(impl, platform: str, *, dtype, head_dim: int, segments: bool = False,
           cudnn_traceable: bool | None = None) -> Kernel:
    """The kernel `impl` runs as on `platform` for one call. `segments`: packed documents, or
    fewer queries than keys (what JAX's cuDNN call cannot express). `cudnn_traceable`: whether
    cuDNN can be traced in this process (default: whether this machine has it)."""
    impl = AttentionImpl(impl)
    traceable = cudnn_present() if cudnn_traceable is None else cudnn_traceable
    hopper = traceable and platform == "cuda" and cudnn_present() and _hopper_here()
    if impl is AttentionImpl.XLA:
        return Kernel.XLA
    if impl is AttentionImpl.CUDNN:
        _check_cudnn(platform, dtype, head_dim, hopper)
        return Kernel.CUDNN if traceable and not segments else Kernel.TRITON
    if platform == "tpu":
        return Kernel.SPLASH
    if platform in ("cuda", "rocm"):
        if (impl is AttentionImpl.AUTO and platform == "cuda" and traceable and not segments
                and cudnn_serves(dtype, head_dim, hopper)):
            return Kernel.CUDNN
        return Kernel.TRITON
    return Kernel.XLA if impl is AttentionImpl.AUTO else Kernel.INTERPRET


def _check_cudnn(platform: str, dtype, head_dim: int, hopper: bool) -> None:
    """`model.attention_impl=cudnn` where cuDNN can never serve: one line with the fix."""
    if platform != "cuda":
        raise ConfigError(f"model.attention_impl=cudnn needs an NVIDIA GPU (CUDA), but the "
                          f"step is built for {platform}; use model.attention_impl=auto or "
                          "pallas.")
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        raise ConfigError(f"model.attention_impl=cudnn needs bf16 or fp16 compute, but "
                          f"model.dtype is {jnp.dtype(dtype).name}; set model.dtype=bfloat16 (or "
                          "auto), or model.attention_impl=auto to use the Pallas kernel at fp32.")
    if not cudnn_serves(dtype, head_dim, hopper=True) or (head_dim > 128 and not hopper
                                                          and cudnn_present()):
        raise ConfigError(f"model.attention_impl=cudnn cannot take head dim {head_dim} (cuDNN "
                          "needs a multiple of 8 up to 128, 256 on Hopper); use "
                          "model.attention_impl=auto.")


def configured_kernel(config: Config, platform: str, cudnn_traceable: bool = True) -> Kernel:
    """The kernel a config's model runs on `platform` (for checks, reports and FLOP counts);
    ConfigError for an `attention_impl` the platform cannot run. `cudnn_traceable=False`: what
    a machine without cuDNN lowers for it instead."""
    m = config.model
    kernel = choose(m.attention_impl, platform, dtype=compute_dtype(m.dtype, platform),
                    head_dim=max(m.qk_head_dim, m.value_head_dim),
                    segments=config.data.packing == "documents",
                    cudnn_traceable=cudnn_traceable)
    # hybrid context parallelism runs the ring's steps after its all-to-alls
    ring = config.mesh.sequence > 1 and config.mesh.context_parallel != "all_to_all"
    return Kernel.RING if ring else kernel


def report_line(config: Config, platform: str) -> str:
    """What `--dry-run` says about attention: the kernel that runs on `platform`, and the one
    this machine lowers in its place when cuDNN cannot be traced here."""
    impl = config.model.attention_impl
    there = configured_kernel(config, platform)
    here = configured_kernel(config, platform, cudnn_traceable=cudnn_present())
    line = f"attention: model.attention_impl={impl} -> {DESCRIPTIONS[there]}"
    if config.mesh.sequence > 1 and config.mesh.context_parallel == "all_to_all":
        line += (f", on whole sequences of 1/{config.mesh.sequence} of the heads between "
                 "all-to-alls over sequence")
    elif config.mesh.sequence > 1 and config.mesh.context_parallel == "hybrid":
        line += (f", across groups after all-to-alls within groups of "
                 f"{config.mesh.all_to_all_group}")
    if here is not there:
        line += (f"; cuDNN cannot be lowered on a machine without it, so this check lowers "
                 f"{DESCRIPTIONS[here]} in its place")
    return line
