"""Refuse a model that cannot fit before anything is allocated.

A state that does not fit does not fail cleanly: on CPU the host swaps or the process is killed,
and even creating it can run for minutes first. What a device must hold at the least is known
from shapes alone: its shards of the parameters, the optimizer state and one set of gradients.
That lower bound is compared with the device's memory (an accelerator's allocator limit; on CPU
the host's available memory, which the simulated devices share).
"""

from __future__ import annotations

import os

import jax

from jaxtron.errors import ConfigError
from jaxtron.sharding.report import shard_bytes

GIB = 2**30


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else physical memory, else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return host_total_bytes()


def host_total_bytes() -> int | None:
    """Physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_bytes(device) -> int | None:
    try:
        stats = device.memory_stats() or {}
    except Exception:  # backends without memory statistics
        stats = {}
    return stats.get("bytes_limit")


def check_fits(trainer) -> None:
    """ConfigError, with the figures, when the state alone exceeds the devices' memory."""
    state = trainer.abstract_state()
    params, optimizer = shard_bytes(state.params), shard_bytes(state.opt_state)
    needed = params * 2 + optimizer  # parameters, their gradients, optimizer state
    devices = list(trainer.mesh.devices.flat)
    local = [d for d in devices if d.process_index == jax.process_index()]
    if devices[0].platform == "cpu":
        available, where = host_available_bytes(), "this host's available memory"
        needed *= len(local)  # simulated devices share the host
        count = f" for {len(local)} CPU devices"
    else:
        available, where = device_bytes(devices[0]), f"one {devices[0].device_kind}"
        count = " per device"
    if available is None or needed <= available:
        return
    m = trainer.config.model
    raise ConfigError(
        f"the model does not fit: its state needs at least {needed / GIB:,.2f} GiB{count} "
        f"(each device: {params / GIB:,.2f} GiB of parameters, as much for gradients, "
        f"{optimizer / GIB:,.2f} GiB of optimizer state), but {where} is "
        f"{available / GIB:,.2f} GiB; lower model.num_layers (now {m.num_layers}) or "
        f"model.d_model (now {m.d_model}), or shard it over more devices with mesh.fsdp or "
        "mesh.tensor.")
