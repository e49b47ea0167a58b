"""Keep freed host memory mapped, so XLA:CPU does not page-fault its working set every step.

XLA:CPU allocates each step's temporaries (one buffer of hundreds of MB for a small model) with
malloc from its worker threads. glibc serves a large request on a worker thread's arena with a
fresh `mmap` and unmaps it on free, so the next step touches brand-new pages again: on the
6-layer, width-384 benchmark model that is ~240,000 page faults and ~0.5 s of kernel time per
1.5 s step. With one arena, no mmap for large blocks and no trimming, freed blocks stay in the
heap and the next step reuses them (0 faults, the step about 12% faster). PyTorch avoids the same
cost with per-tensor allocations small enough for glibc's adaptive threshold.

Applied by the command-line entry points (`jaxtron.train`, `jaxtron.bench`) before JAX starts
its threads, on glibc systems whose JAX runs on one CPU device; importing jaxtron changes
nothing. A notebook can call `keep_freed_host_memory()` itself, first thing. Not with several simulated devices: their threads allocate at the same
time, one arena serialises them (1.8 -> 1.5 busy cores, the 8-device tiny model 30% slower), and
their smaller per-device buffers fault far less anyway. The cost is that the process keeps its
peak host memory until it exits.
`JAXTRON_KEEP_HOST_MEMORY=0` leaves malloc as it was.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys

# mallopt parameters from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_NEVER = 2**31 - 1  # the largest value mallopt takes: in effect "never"
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin", "libtpu")

ENV = "JAXTRON_KEEP_HOST_MEMORY"


def jax_runs_on_cpu() -> bool:
    """True when JAX will pick the CPU: asked for explicitly, or no accelerator plugin installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(name) for name in _ACCELERATOR_PLUGINS)


def simulated_cpu_devices() -> int:
    """How many CPU devices JAX will create, as far as the environment says before it starts."""
    match = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    count = os.environ.get("JAX_NUM_CPU_DEVICES") or (match.group(1) if match else "1")
    return int(count) if count.isdigit() else 1


_APPLIED = False


def applied() -> bool:
    """Whether this process has called `keep_freed_host_memory` with effect."""
    return _APPLIED


def keep_freed_host_memory() -> bool:
    """Tune glibc malloc for XLA:CPU's allocation pattern; returns whether it was applied."""
    global _APPLIED
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if not jax_runs_on_cpu() or simulated_cpu_devices() != 1:
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this Python is linked against
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl and others lack these knobs)
    except (OSError, AttributeError):
        return False
    codes = [libc.mallopt(_M_ARENA_MAX, 1), libc.mallopt(_M_TRIM_THRESHOLD, _NEVER),
             libc.mallopt(_M_MMAP_THRESHOLD, _NEVER)]
    _APPLIED = all(code == 1 for code in codes)
    return _APPLIED
