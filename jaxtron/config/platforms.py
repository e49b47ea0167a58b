"""Which hardware a step is built for, and the defaults that depend on it.

JAX calls every NVIDIA and AMD device "gpu"; kernels differ between them (cuDNN exists only on
CUDA, ROCm lowers Pallas only through Triton), so jaxtron names four platforms, the same names
`jax.jit(...).lower(lowering_platforms=...)` and `jax.lax.platform_dependent` use:

    cpu   cuda   rocm   tpu

A Trainer is built for the platform of its mesh's devices, or for the one it is told (the
`--dry-run --target` check on a CPU machine), and traces its steps inside `building_for(...)`:
kernels that differ by platform are then chosen while tracing, so the compiled step holds only
its platform's kernel. Code traced outside a Trainer (a jitted call of `attention` in a notebook)
has no such platform and stages every platform's kernel with `jax.lax.platform_dependent`
instead, leaving the choice to lowering.

`model.dtype: auto` resolves here: bf16 compute on accelerators (their matmul units and cuDNN's
attention want it), fp32 on CPU (no bf16 speed-up there, and tests compare against fp32
references).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

import jax

from jaxtron.errors import ConfigError

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
ACCELERATOR_DTYPE = "bfloat16"
CPU_DTYPE = "float32"

_BUILDING_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("building_for",
                                                                          default=None)


def platform_of(device) -> str:
    """cpu, cuda, rocm or tpu for a JAX device."""
    if device.platform in ("gpu", "cuda", "rocm"):
        version = getattr(device.client, "platform_version", "").lower()
        return "rocm" if "rocm" in version or device.platform == "rocm" else "cuda"
    return device.platform


def local_platform() -> str:
    """The platform of this process's default devices."""
    return platform_of(jax.devices()[0])


@contextlib.contextmanager
def building_for(platform: str) -> Iterator[None]:
    """Trace inside this to build for `platform` (see the module docstring)."""
    token = _BUILDING_FOR.set(check_platform(platform))
    try:
        yield
    finally:
        _BUILDING_FOR.reset(token)


def target_platform() -> str | None:
    """The platform being built for, or None outside `building_for`."""
    return _BUILDING_FOR.get()


def check_platform(platform: str) -> str:
    if platform not in PLATFORMS:
        raise ConfigError(f"platform {platform!r} is not one of {', '.join(PLATFORMS)}; pass "
                          "--target cpu, cuda, rocm or tpu.")
    return platform


def compute_dtype(dtype: str, platform: str) -> str:
    """`model.dtype` for `platform`: `auto` becomes bf16 on accelerators and fp32 on CPU."""
    if dtype != "auto":
        return dtype
    return CPU_DTYPE if platform == "cpu" else ACCELERATOR_DTYPE


def for_platform(config, platform: str):
    """`config` with its platform-dependent defaults resolved for `platform`, after checking
    the dtype can run there (the attention kernel's own checks: `kernels/choice.py`)."""
    check_platform(platform)
    m = config.model
    dtype = compute_dtype(m.dtype, platform)
    if platform == "tpu" and dtype == "float16":
        raise ConfigError("model.dtype=float16 is not a TPU compute type; set model.dtype="
                          "bfloat16 (or auto).")
    if dtype == m.dtype:
        return config
    return dataclasses.replace(config, model=dataclasses.replace(m, dtype=dtype))


def simulate_cpu_devices(count: int) -> None:
    """Make this process's JAX backend `count` CPU devices, for checking a layout of `count`
    accelerators on one machine. XLA reads the flag when the backend starts, so this must run
    before anything asks JAX for a device."""
    import os

    if count < 1:
        raise ConfigError(f"--devices {count} must be a positive device count.")
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, flag])
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    if jax.device_count() != count:
        raise ConfigError(f"--devices {count} could not take effect: JAX already started with "
                          f"{jax.device_count()} devices in this process; run the check in a "
                          "new process, or set XLA_FLAGS=--xla_force_host_platform_device_count"
                          f"={count} before starting it.")
