"""Opt-in (`JAXTRON_CPU_MATMULS=onednn`): one-device CPU steps hand their matmuls to oneDNN.

Off by default: the option is experimental in XLA 0.10 and can abort the process (below), it
keeps every executable built with it alive until exit, and on a fresh clone of this machine it
measured no faster end to end than XLA's default (`benchmarks/cpu_vs_pytorch.py`,
docs/performance.md). What it does and why, when asked for:

YNNPACK splits a matmul among threads by tiles of one output matrix, so a batched matmul of
small matrices, such as attention's per-(batch, head) [64..256, 64] blocks, runs on one core: on
the 2-core test machine `bgqs,bgsk->bgqk` at batch 8, 6 heads, 64 x 256 x 64 keeps 1.05 cores
busy (1.4 ms). oneDNN spreads the batch over the threads too (0.66 ms, 1.87 cores); large
matmuls run at the same speed in either. The 6-layer, width-384 benchmark step is 10-14% faster
(fp32 and bf16, GPT-2 and Llama with grouped-query attention).

Limits, all from XLA 0.10's oneDNN support:
- Single-dot fusions only (`LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT`): fusing elementwise work into
  the call (`LIBRARY_FUSION_TYPE_DOT`) stops the process with an illegal instruction.
- XLA returns a oneDNN runtime to its pool a moment after a step's outputs are ready; freeing
  the executable in that window aborts the process ("Check failed: available_.size() ==
  num_created_", object_pool.h: 2 of 3 runs of 400 run-then-free cycles, none with a 2 ms
  pause). The executables are therefore kept until exit (`keep_until_exit`), which pauses
  before JAX frees them. Several devices running one executable widen the window (an 8-device
  run aborted at exit), so multi-device runs keep YNNPACK; the 8-device tiny model runs as fast
  either way.
- oneDNN executables cannot be written to JAX's persistent compilation cache, so with the
  cache on (`jax_compilation_cache_dir`) the steps keep YNNPACK and stay cacheable.
- Linux x86-64 only, where it was measured. XLA itself leaves a dot to YNNPACK when oneDNN
  cannot take it (bf16 without AVX512-BF16, column-major operands).

`JAXTRON_CPU_MATMULS=xla` (the default) keeps XLA's choice everywhere.
"""

from __future__ import annotations

import atexit
import os
import platform
import sys
import time

import jax

from jaxtron.runtime.distributed import LaunchError

ENV = "JAXTRON_CPU_MATMULS"
CHOICES = ("xla", "onednn")

ONEDNN_MATMULS = {
    "xla_cpu_use_onednn": True,
    "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
}


def matmul_library() -> str:
    choice = os.environ.get(ENV, "xla").strip().lower()
    if choice not in CHOICES:
        raise LaunchError(f"the environment variable {ENV}={choice!r} is not a CPU matmul "
                          f"library: set {ENV}=xla (the default: XLA:CPU's own choice, "
                          f"YNNPACK) or {ENV}=onednn (experimental), or unset it.")
    return choice


def onednn_available() -> bool:
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def compiler_options(devices) -> dict | None:
    """XLA compiler options for a step that runs on `devices` (a list or array of devices)."""
    library, devices = matmul_library(), list(getattr(devices, "flat", devices))
    if (library != "onednn" or len(devices) != 1 or devices[0].platform != "cpu"
            or not onednn_available() or jax.config.jax_compilation_cache_dir):
        return None
    return dict(ONEDNN_MATMULS)


_KEPT: list = []


def keep_until_exit(*executables) -> None:
    """Hold jitted or compiled functions built with oneDNN options until the process exits.

    The pause is registered after `import jax`, so it runs before JAX frees its executables at
    exit: by then every oneDNN runtime is back in its pool (see the module docstring)."""
    if not _KEPT:
        atexit.register(time.sleep, 0.05)
    _KEPT.extend(executables)
