"""Accelerators the planner knows: peak FLOP/s, memory and link bandwidths per device.

Peaks are dense bf16 datasheet numbers; bandwidths are one direction per device: NVLink (or
TPU ICI) inside a node, the network (InfiniBand / DCN) between nodes, and the host link
(PCIe) that `remat: offload` moves activations over. `efficiency` is the share
of peak that large transformer matmuls reach in practice; the roofline uses peak x efficiency.
Every number can be overridden on the command line.
"""

from __future__ import annotations

import dataclasses

from jaxtron.training.flops import PEAK_FLOPS_BY_KIND as PEAK


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float
    memory_bytes: int
    intra_bw: float
    inter_bw: float
    node_size: int
    efficiency: float = 0.7
    host_bw: float = 50e9  # device <-> pinned host memory, one direction (PCIe Gen5 x16)
    # Simulated devices on one machine: they share its cores, so a rank's idle time goes to
    # the others and the pipeline's idle share does not stretch the step.
    shared_cores: bool = False


GiB = 2**30
HARDWARE = {
    "a100": Hardware("a100", PEAK["A100"], 80 * GiB, 300e9, 25e9, 8, host_bw=25e9),
    "h100": Hardware("h100", PEAK["H100"], 80 * GiB, 450e9, 50e9, 8),
    "h200": Hardware("h200", PEAK["H200"], 141 * 10**9, 450e9, 50e9, 8),
    "b200": Hardware("b200", PEAK["B200"], 180 * 10**9, 900e9, 50e9, 8),
    "tpu-v5p": Hardware("tpu-v5p", PEAK["TPU v5p"], 95 * 10**9, 600e9, 25e9, 8960),
    # Simulated devices sharing one machine: `python -m jaxtron.plan --hardware cpu` sets the
    # peak to this machine's measured fp32 matmul rate over the devices; the tiny model's step
    # reached 0.375 of it on 8 devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8
    # python -m jaxtron.bench --config configs/tiny.yaml mesh.data=8`, 2 cores, 2026-12-06).
    "cpu": Hardware("cpu", 1e11, 16 * GiB, 10e9, 10e9, 1 << 20, efficiency=0.35,
                    shared_cores=True),
}
