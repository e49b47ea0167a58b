"""Communication per step by mesh axis, the pipeline bubble, and a roofline step time.

Volumes are bytes each device sends per step, with ring collectives (an all-reduce of S bytes
over n ranks sends 2 S (n-1)/n; an all-gather or reduce-scatter S (n-1)/n):

    data      gradient all-reduce (ZeRO-1/2: reduce-scatter + all-gather, the same volume)
    fsdp      parameter all-gather in the forward and again in the backward, gradient
              reduce-scatter: 3 S (n-1)/n of the parameters the device uses
    tensor    per block and microbatch, two all-reduces forward and two backward of the block's
              [tokens, D] activations (with sequence parallelism: all-gathers and
              reduce-scatters of the same total volume)
    sequence  ring attention passes k and v round the ring, forward and twice backward
    expert    all-to-all dispatch and combine of each routed token, forward and backward
    stage     the stage output forward and its gradient backward, per microbatch

An axis runs on the fast intra-node links when it and the axes inside it fit in one node (axes
nest as stage, data, fsdp, expert, sequence, tensor from outside in), else on the inter-node
network. Step time = compute / (1 - bubble) + tensor, sequence, expert and stage time (on the
critical path) + the part of data and fsdp time that the backward cannot hide.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxtron.config import Config
from jaxtron.flops import hardware_flops_per_token, training_flops_per_token
from jaxtron.planner.hardware import Hardware
from jaxtron.planner.layout import Layout
from jaxtron.planner.memory import microbatch_sequences, state_bytes

AXES = ("stage", "data", "fsdp", "expert", "sequence", "tensor")
# `save_dots` also repeats the elementwise work (norms, activations, softmax): a few percent of
# a step that is matmul-bound. Attention matmuls it repeats (cuDNN) are in
# hardware_flops_per_token.
SAVE_DOTS_OVERHEAD = 0.03


@dataclasses.dataclass(frozen=True)
class Cost:
    comm_bytes: dict          # axis -> bytes sent per device per step
    comm_s: dict              # axis -> seconds
    bubble: float
    compute_s: float
    step_s: float
    mfu: float


def bubble_fraction(layout: Layout) -> float:
    """Idle share of a pipeline rank: (p-1)/(m+p-1), interleaved (p-1)/(v m + p-1)."""
    p, m, v = layout.stage, layout.microbatches, layout.virtual_stages
    if p == 1:
        return 0.0
    return (p - 1) / ((v if layout.schedule == "interleaved" else 1) * m + p - 1)


def intra_node(layout: Layout, axis: str, node_size: int) -> bool:
    degrees = layout.degrees()
    inner = math.prod(degrees[a] for a in AXES[AXES.index(axis):])
    return inner <= node_size


def communication(config: Config, layout: Layout) -> dict:
    m = config.model
    e = np.dtype(m.compute_dtype).itemsize
    degrees = layout.degrees()
    ring = {a: (n - 1) / n for a, n in degrees.items()}
    params, _, _ = state_bytes(config, dataclasses.replace(layout, zero_stage=0))
    steps_per_layer = layout.grad_accum * (layout.microbatches if layout.stage > 1 else 1)
    tokens = microbatch_sequences(config, layout) * config.data.seq_len // layout.sequence
    layers = math.ceil(m.num_layers / layout.stage)
    activation = e * tokens * m.d_model
    kv = e * tokens * m.kv_heads * m.resolved_head_dim * 2
    out = {"data": 2 * ring["data"] * params,
           "fsdp": 3 * ring["fsdp"] * params * degrees["fsdp"] * steps_per_layer,
           "tensor": 4 * 2 * ring["tensor"] * activation * layers * steps_per_layer,
           "sequence": 3 * (degrees["sequence"] - 1) * kv * layers * steps_per_layer,
           "stage": 2 * activation * steps_per_layer if layout.stage > 1 else 0.0,
           "expert": 0.0}
    if config.moe.enabled:
        moe_layers = layers // config.moe.every
        out["expert"] = (4 * ring["expert"] * activation * config.moe.top_k * moe_layers
                         * steps_per_layer)
    return out


def estimate(config: Config, layout: Layout, hardware: Hardware, platform: str = "gpu") -> Cost:
    tokens = config.train.batch_size * config.data.seq_len
    c = _with_remat(config, layout)
    model_flops = training_flops_per_token(c.model, c.data.seq_len, c.moe) * tokens
    hw_flops = hardware_flops_per_token(c, platform) * tokens
    per_device_peak = hardware.peak_flops * hardware.efficiency
    compute = hw_flops / layout.devices / per_device_peak
    if layout.remat == "save_dots":
        compute *= 1 + SAVE_DOTS_OVERHEAD
    bubble = bubble_fraction(layout)
    volumes = communication(config, layout)
    seconds = {axis: volume / (hardware.intra_bw if intra_node(layout, axis, hardware.node_size)
                               else hardware.inter_bw)
               for axis, volume in volumes.items()}
    critical = seconds["tensor"] + seconds["sequence"] + seconds["expert"] + seconds["stage"]
    hidden = max(0.0, seconds["data"] + seconds["fsdp"] - compute * 2 / 3)  # overlap backward
    step = compute / (1 - bubble) + critical + hidden
    mfu = model_flops / step / (layout.devices * hardware.peak_flops)
    return Cost(volumes, seconds, bubble, compute, step, mfu)


def _with_remat(config: Config, layout: Layout) -> Config:
    model = dataclasses.replace(config.model, remat=layout.remat)
    mesh = dataclasses.replace(config.mesh, stage=layout.stage)
    return dataclasses.replace(config, model=model, mesh=mesh)
