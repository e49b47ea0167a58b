"""The pipeline bubble, and a roofline step time from compute and communication.

Communication per mesh axis comes from `jaxtron/planner/traffic.py` (bytes each device sends
per step, checked against the compiled step by `python -m jaxtron.planner.validate`). An axis
runs on the fast intra-node links when it and the axes inside it fit in one node (axes nest as
stage, data, fsdp, expert, sequence, tensor from outside in), else on the inter-node network.
Step time = compute / (1 - idle) + tensor, sequence, expert and stage time (on the critical
path) + the part of data and fsdp time that the backward cannot hide. A pipeline rank's idle
share is its tick table's walked with jobs at their real lengths (`pipeline/timeline.py`: a
backward beside a neighbour's forward stalls it), not the table's unit-tick bubble.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxtron.config.schema import Config
from jaxtron.pipeline.schedules import formula_idle
from jaxtron.pipeline.timeline import weighted_idle
from jaxtron.planner.hardware import Hardware
from jaxtron.planner.layout import Layout
from jaxtron.planner.memory import offloaded_bytes, schedule_table
from jaxtron.planner.traffic import communication, context_parallel_bytes
from jaxtron.training.flops import hardware_flops_per_token, training_flops_per_token

AXES = ("stage", "data", "fsdp", "expert", "sequence", "tensor")
# `save_dots` also repeats the elementwise work (norms, activations, softmax): a few percent of
# a step that is matmul-bound. Attention matmuls it repeats (cuDNN) are in
# hardware_flops_per_token.
SAVE_DOTS_OVERHEAD = 0.03


@dataclasses.dataclass(frozen=True)
class Cost:
    comm_bytes: dict          # axis -> bytes sent per device per step
    comm_s: dict              # axis -> seconds
    bubble: float             # the schedule's formula (`schedules.formula_idle`)
    idle: float               # a rank's idle share with jobs at their real lengths
    compute_s: float
    step_s: float
    mfu: float


def bubble_fraction(layout: Layout) -> float:
    """Idle share of a pipeline rank by its schedule's formula (`schedules.formula_idle`)."""
    if layout.stage == 1:
        return 0.0
    return _formula_idle(layout.schedule, layout.stage, layout.microbatches,
                         layout.virtual_stages)


_formula_idle = functools.lru_cache(maxsize=4096)(formula_idle)


def idle_fraction(layout: Layout) -> float:
    """Share of the step a pipeline rank waits, jobs at their lengths (`timeline.py`)."""
    if layout.stage == 1:
        return 0.0
    return _table_idle(layout.schedule, layout.stage, layout.microbatches,
                       layout.virtual_stages, layout.recompute)


@functools.lru_cache(maxsize=4096)
def _table_idle(schedule: str, stages: int, microbatches: int, virtual: int,
                recompute: bool) -> float:
    """Walked once per table shape: the planner asks for thousands of layouts."""
    return weighted_idle(schedule_table(schedule, stages, microbatches, virtual, recompute),
                         recompute)


def intra_node(layout: Layout, axis: str, node_size: int) -> bool:
    return _inner_devices(layout)[axis] <= node_size


def _inner_devices(layout: Layout) -> dict[str, int]:
    """axis -> devices of that axis and every faster one (mesh order), i.e. the span of one
    of its groups in device order."""
    degrees, inner, out = layout.degrees(), 1, {}
    for axis in reversed(AXES):
        inner *= degrees[axis]
        out[axis] = inner
    return out


def estimate(config: Config, layout: Layout, hardware: Hardware, platform: str = "gpu") -> Cost:
    tokens = config.train.batch_size * config.data.seq_len
    model_per_token, hw_per_token = _flops_per_token(config, layout, platform)
    model_flops, hw_flops = model_per_token * tokens, hw_per_token * tokens
    per_device_peak = hardware.peak_flops * hardware.efficiency
    compute = hw_flops / layout.devices / per_device_peak
    if layout.remat == "save_dots":
        compute *= 1 + SAVE_DOTS_OVERHEAD
    bubble, idle = bubble_fraction(layout), idle_fraction(layout)
    volumes = communication(config, layout, platform)
    inner = _inner_devices(layout)
    seconds = {axis: volume / (hardware.intra_bw if inner[axis] <= hardware.node_size
                               else hardware.inter_bw)
               for axis, volume in volumes.items()}
    if (layout.context_parallel == "hybrid" and inner["sequence"] > hardware.node_size
            and layout.all_to_all_size * layout.tensor <= hardware.node_size):
        # the rings cross nodes, but each all-to-all group and its tensor ranks stay inside
        a2a = context_parallel_bytes(config, layout)[0] * layout.grad_accum  # no pipeline
        seconds["sequence"] += a2a / hardware.intra_bw - a2a / hardware.inter_bw
    critical = seconds["tensor"] + seconds["sequence"] + seconds["expert"] + seconds["stage"]
    # remat: offload copies to host in the forward and back in the backward, beside the
    # compute like the data-parallel reductions
    host = host_seconds(config, layout, hardware)
    hidden = max(0.0, seconds["data"] + seconds["fsdp"] + host - compute * 2 / 3)
    stretch = 1.0 if hardware.shared_cores else 1 / (1 - idle)  # see Hardware.shared_cores
    step = compute * stretch + critical + hidden
    mfu = model_flops / step / (layout.devices * hardware.peak_flops)
    return Cost(volumes, seconds, bubble, idle, compute, step, mfu)


def host_seconds(config: Config, layout: Layout, hardware: Hardware) -> float:
    """Seconds per step on the host link under `remat: offload`: each layer's offloaded bytes
    out in the forward and in again in the backward."""
    passes = layout.grad_accum * (layout.microbatches if layout.stage > 1 else 1)
    layers = math.ceil(config.model.num_layers / layout.stage)
    return 2 * offloaded_bytes(config, layout) * layers * passes / hardware.host_bw


_FLOPS: dict[tuple, tuple[Config, tuple[float, float]]] = {}


def _flops_per_token(config: Config, layout: Layout, platform: str) -> tuple[float, float]:
    """(model, hardware) FLOPs per token of `config` with the layout's remat, stage count,
    pipeline recompute and context parallelism (which picks the attention kernel); the
    planner asks for a handful of these per search, for a million layouts, so they are kept."""
    key = (id(config), layout.remat, layout.stage, layout.recompute, layout.sequence > 1,
           layout.context_parallel, platform)
    kept = _FLOPS.get(key)
    if kept is not None and kept[0] is config:
        return kept[1]
    if len(_FLOPS) > 1024:
        _FLOPS.clear()
    c = _derive(config, layout)
    flops = (training_flops_per_token(c.model, c.data.seq_len, c.moe),
             hardware_flops_per_token(c, platform))
    _FLOPS[key] = (config, flops)
    return flops


def _derive(config: Config, layout: Layout) -> Config:
    model = dataclasses.replace(config.model, remat=layout.remat)
    mesh = dataclasses.replace(config.mesh, stage=layout.stage, sequence=layout.sequence,
                               context_parallel=layout.context_parallel)
    pipeline = dataclasses.replace(config.pipeline, recompute=layout.recompute)
    return dataclasses.replace(config, model=model, mesh=mesh, pipeline=pipeline)
