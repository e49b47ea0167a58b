"""Bytes each device sends per step, by mesh axis, predicted without compiling: the planner's
side of `jaxtron/sharding/collectives.py`, which counts the same bytes in a compiled step.

Ring collectives over n ranks on S bytes send 2 S (n-1)/n (all-reduce) or S (n-1)/n
(all-gather, reduce-scatter, all-to-all). A collective that spans several axes is booked to the
outermost of them (mesh order: stage, data, fsdp, expert, sequence, tensor), the slowest link it
crosses. G is the bytes of this device's gradients (parameters split by fsdp, tensor, expert and
stage), P = f G those of the fsdp-gathered parameters, A = e x tokens x D one microbatch's
residual stream on this device, and each microbatch pass is one of grad_accum (x pipeline
microbatches) per step.

    data      gradients once per step: all-reduce 2 G (n-1)/n (n = data x expert for weights
              outside the experts, data for the experts' own); ZeRO-1 adds the all-gather of the
              updated parameters, G (n-1)/n; ZeRO-2 reduce-scatters and all-gathers instead,
              2 G (n-1)/n (`sharding/data_parallel.py`)
    fsdp      per pass, the weights gathered for the forward and again for the backward,
              2 P (f-1)/f, and the gradients reduce-scattered, P (f-1)/f. XLA:CPU has no
              reduce-scatter rewrite: there the gradient reduction is an all-reduce, and
              without a manual data axis it is one all-reduce over data x fsdp (booked to data)
    tensor    per pass and block: Megatron's two all-reduces of A forward; backward one per
              column-parallel input matmul, as XLA emits them: q, k, v and both SwiGLU inputs
              (gate, up) are summed separately, 5 for Llama (4 for GPT-2), +1 with
              `remat: full` (the forward again, but for the block output, which is kept).
              That is the count XLA:CPU compiles; for GPUs and TPUs, which this machine cannot
              compile for, the prediction keeps Megatron's 2 backward (one per sublayer).
              The vocabulary-parallel embedding (forward) and head (backward) add one each
              per pass. With kv heads replicated over tensor
              (fewer kv heads than ranks) k and v are not partial sums; their gradients are
              all-reduced over the r = t / G ranks that share a kv head instead, and the kv
              heads all-gathered for the backward. Sequence parallelism replaces each
              all-reduce by a reduce-scatter and an all-gather, the same bytes; XLA:CPU keeps
              the all-reduce and slices it, then gathers: 1.5 times the bytes.
    expert    per pass and MoE layer: the dispatched slots [B, E, C, D] cross the axis forward
              and back (all-to-all, twice) and their gradients in the backward (twice). The
              experts' weights are gathered over fsdp once per pass (the expert shard_map keeps
              them for the backward) and reduced over data alone.
    sequence  per pass and layer, ring attention sends k and v on n-1 hops forward and n-1
              backward (compute dtype), and the fp32 dk/dv on n hops; all-to-all sends
              (n-1)/n of q, k, v and the output forward and of their gradients backward; the
              weights' gradients are reduced over sequence like over data
    stage     A per send the tick table makes (a stage output forward, an input gradient
              back; nothing where nothing goes), over p ranks; per pass the embedding and head
              slices to the ranks that use them, (p-1)/p^2 of each table, and their gradients
              back once per step

`python -m jaxtron.planner.validate` sets these beside the counted bytes; data, fsdp, tensor,
expert, sequence and stage are within 10% on its matrix.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jaxtron.config.checks import kv_heads_per_rank
from jaxtron.config.schema import Config
from jaxtron.pipeline.ticks import transfers
from jaxtron.planner.layout import Layout
from jaxtron.planner.memory import (
    dropless_buffer_rows,
    end_bytes,
    expert_gradient_bytes,
    microbatch_sequences,
    microbatch_tokens,
    schedule_table,
    state_bytes,
)

AXES = ("stage", "data", "fsdp", "expert", "sequence", "tensor")


def ring(n: int) -> float:
    return (n - 1) / n


def communication(config: Config, layout: Layout, platform: str = "gpu") -> dict[str, float]:
    """axis -> bytes one device sends per step (see the module docstring)."""
    out = dict.fromkeys(AXES, 0.0)
    grads, _, _ = state_bytes(config, layout, zero_stage=0)
    passes = layout.grad_accum * (layout.microbatches if layout.stage > 1 else 1)
    experts = expert_gradient_bytes(config, layout) if layout.expert > 1 else 0
    _data_and_fsdp(out, layout, grads - experts, passes, reduce_scatter=platform != "cpu")
    if experts:  # the experts' own weights: gathered over fsdp, replicated over data only
        _data_and_fsdp(out, dataclasses.replace(layout, expert=1), experts, passes,
                       reduce_scatter=platform != "cpu", gathers=1)
    out["tensor"] = _tensor(config, layout, separate_sums=platform == "cpu") * passes
    out["expert"] += _expert(config, layout, platform) * passes
    out["sequence"] += _sequence(config, layout) * passes
    per_pass, per_step = _stage(config, layout)  # a pass here: the schedule's whole table
    out["stage"] = per_pass * layout.grad_accum + per_step
    return out


def _sequence(config: Config, layout: Layout) -> float:
    """Per pass, what context parallelism sends: `context_parallel_bytes`."""
    return sum(context_parallel_bytes(config, layout))


def context_parallel_bytes(config: Config, layout: Layout) -> tuple[float, float]:
    """(all-to-all bytes, ring bytes) per pass over `sequence`. Ring attention
    (`kernels/ring.py`) sends the k/v block on n-1 hops forward and again in the backward,
    with the fp32 dk/dv accumulators travelling n hops (also under `remat: full`: the
    recomputed block takes the ring's saved output and log-sum-exp, as the counter shows).
    All-to-all (`kernels/all_to_all_context.py`): see `_all_to_all`. Hybrid: all-to-all
    within groups of g, then rings of n / g over each group's share (g times the tokens,
    max(G', g) / g of the kv heads)."""
    n, g, m, t = layout.sequence, layout.all_to_all_size, config.model, layout.tensor
    if n == 1:
        return 0.0, 0.0
    if g == 1:
        return 0.0, _ring_attention(config, layout, n, 1, m.kv_heads // t if m.kv_heads % t == 0
                                    else m.kv_heads)
    exchanged = _all_to_all(config, layout, g)
    if g == n:
        return exchanged, 0.0
    heads = max(kv_heads_per_rank(m, t), g) / g  # hybrid: each ring member's kv heads
    return exchanged, _ring_attention(config, layout, n // g, g, heads)


def _ring_attention(config: Config, layout: Layout, n: int, tokens_factor: int,
                    kv_heads: float) -> float:
    """Ring attention over n members, each holding `tokens_factor` x this device's tokens
    and `kv_heads` kv heads."""
    m = config.model
    e = np.dtype(m.compute_dtype).itemsize
    tokens = microbatch_tokens(config, layout) * tokens_factor
    layers = math.ceil(m.num_layers / layout.stage)
    kv = 2 * tokens * kv_heads * m.resolved_head_dim  # k and v elements of this member's block
    forward = (n - 1) * e * kv
    backward = (n - 1) * e * kv + n * 4 * kv
    return (forward + backward) * layers


def _all_to_all(config: Config, layout: Layout, n: int) -> float:
    """Per pass and layer: q, k, v and the output each cross the axis once forward, (n-1)/n of
    this device's share, and their gradients once backward; any remat policy runs the
    forward's again (`save_dots` keeps the projections, not what the exchange made of them).
    k and v go at max(G', n) heads (G' = the kv heads a tensor rank reads: repeated up to n
    when fewer). Packed documents add the int32 segment ids, all-gathered per layer."""
    m = config.model
    e = np.dtype(m.compute_dtype).itemsize
    tokens = microbatch_tokens(config, layout)
    layers = math.ceil(m.num_layers / layout.stage)
    heads = m.num_heads // layout.tensor
    q = tokens * heads * m.qk_head_dim
    out = tokens * heads * m.value_head_dim
    kv = tokens * max(kv_heads_per_rank(m, layout.tensor), n) * (m.qk_head_dim
                                                                 + m.value_head_dim)
    passes = 2 if layout.remat == "none" else 3
    sent = passes * ring(n) * e * (q + kv + out)
    if config.data.packing == "documents":
        sent += ring(n) * 4 * tokens * n
    return sent * layers


def _stage(config: Config, layout: Layout) -> tuple[float, float]:
    """(bytes per run of the schedule, bytes per step) over `stage`. Each send the tick table
    makes carries one microbatch activation (or its gradient) A to a neighbour, and nothing
    else is sent: `ticks.transfers` of them per run, transfers / p A per device; with sequence
    parallelism the activation stays split over `tensor` along the sequence, so each device
    sends A / tensor (Megatron-LM's scatter-gather of pipeline sends). The
    embedding and head are stored split over the p ranks: per pass the p-1 other slices of
    each travel to the rank that uses it, (p-1)/p^2 of the table per device, and their
    gradients go back once per step."""
    p = layout.stage
    if p == 1:
        return 0.0, 0.0
    m = config.model
    e = np.dtype(m.compute_dtype).itemsize
    tokens = microbatch_tokens(config, layout)
    sends = _sends(layout.schedule, p, layout.microbatches, layout.virtual_stages,
                   layout.recompute)
    split = layout.tensor if layout.sequence_parallel else 1
    per_pass = sends / p * e * tokens * m.d_model / split
    ends = end_bytes(config, layout)  # per device, before the split over stages
    # the one table goes to both ends (in a V both are rank 0)
    ends *= 2 if m.tied_embeddings and layout.schedule != "zbv" else 1
    moved = ends * (p - 1) / p ** 2
    return per_pass + moved, moved


@functools.lru_cache(maxsize=4096)
def _sends(schedule: str, stages: int, microbatches: int, virtual: int,
           recompute: bool) -> int:
    """A table's sends, counted once per shape: the planner asks for millions of layouts."""
    return transfers(schedule_table(schedule, stages, microbatches, virtual, recompute))


def _data_and_fsdp(out, layout: Layout, grads: float, passes: int, reduce_scatter: bool,
                   gathers: int = 2):
    """Gradients replicated over data, fsdp, expert and sequence (outside the experts, expert
    ranks are data-parallel ranks: the reduction spans data x expert, booked to data, or expert
    alone in each pass when data is manual or absent; over sequence XLA reduces in each pass,
    apart from data). `gathers`: fsdp all-gathers of the weights per pass; the
    experts' weights are gathered once, kept by the expert shard_map for its backward."""
    n, f = layout.data, layout.fsdp
    manual_data = n > 1 and (layout.grad_accum > 1 or layout.zero_stage >= 2)
    if layout.sequence > 1:  # XLA reduces over sequence in each pass, apart from data
        out["sequence"] += 2 * ring(layout.sequence) * grads * passes
    if layout.expert > 1:
        if n == 1 or manual_data:  # reduced over expert in each pass, apart from data
            out["expert"] += 2 * ring(layout.expert) * grads * passes
        else:
            n *= layout.expert
    gathered = grads * f
    if f > 1:
        out["fsdp"] += gathers * ring(f) * gathered * passes  # weights for forward, backward
        if reduce_scatter:
            out["fsdp"] += ring(f) * gathered * passes
        elif n > 1 and not manual_data:  # one all-reduce over data x fsdp
            out["data"] += 2 * ring(n * f) * gathered * passes
            if layout.zero_stage == 1:
                out["data"] += ring(layout.data) * grads
            return
        else:
            out["fsdp"] += 2 * ring(f) * gathered * passes
    if n > 1:
        out["data"] += 2 * ring(n) * grads
        if layout.zero_stage == 1:
            out["data"] += ring(layout.data) * grads


def _tensor(config: Config, layout: Layout, separate_sums: bool) -> float:
    """Bytes per microbatch pass over the tensor axis. `separate_sums`: the backward
    all-reduces each column-parallel input gradient on its own (as XLA:CPU compiles it);
    otherwise one per sublayer, Megatron's count."""
    t = layout.tensor
    if t == 1:
        return 0.0
    m = config.model
    e = np.dtype(m.compute_dtype).itemsize
    tokens = microbatch_tokens(config, layout)
    activation = e * tokens * m.d_model
    layers = math.ceil(m.num_layers / layout.stage)
    replicated_kv = m.kv_heads % t != 0
    forward = 2 + (1 if layout.remat == "full" else 0)  # the block output is not recomputed
    inputs = 1 if replicated_kv else 3  # q (k, v) read the replicated block input
    backward = inputs + (2 if m.type == "llama" else 1) if separate_sums else 2
    sent = (layers * (forward + backward) + 2) * 2 * ring(t) * activation
    if layout.sequence_parallel and separate_sums:
        # Megatron's reduce-scatter + all-gather in place of each all-reduce (the same bytes)
        # compiles on XLA:CPU as all-reduce + slice + all-gather: 1.5 times the bytes
        sent *= 1.5
    if replicated_kv:
        r = t // math.gcd(t, m.kv_heads)  # ranks that share one kv head
        kv = e * tokens * m.resolved_head_dim
        local_kv_heads = max(1, m.kv_heads * r // t)
        sent += layers * (2 * 2 * ring(r) * kv * local_kv_heads  # dk, dv summed
                          + 2 * ring(r) * kv * m.kv_heads)       # k, v gathered
    return sent


def _expert(config: Config, layout: Layout, platform: str = "gpu") -> float:
    """Per pass: each MoE layer's two exchanges, forward and backward. Capacity routing sends
    every expert's slots; dropless sends the rows routed (T k each way, `dropless_experts`),
    which on CPU go padded to the operand's length to every rank (`ragged_exchange`)."""
    x, moe = layout.expert, config.moe
    if x == 1 or not moe.enabled:
        return 0.0
    m = config.model
    e = np.dtype(m.compute_dtype).itemsize
    sequences = microbatch_sequences(config, layout)
    length = config.data.seq_len // layout.sequence
    moe_layers = math.ceil(moe.stacked_layers(m.num_layers) / layout.stage) // moe.every
    if moe.mode == "dropless":
        sent = sequences * length * moe.top_k  # A rows out, and the same back
        if platform == "cpu":  # [x, A] out and [x, R] back, padded slices to every rank
            received = dropless_buffer_rows(config, layout)
            return 2 * (x - 1) * (sent + received) * e * m.d_model * moe_layers
        return 4 * ring(x) * sent * e * m.d_model * moe_layers
    slots = math.ceil(moe.capacity_factor * length * moe.top_k / moe.num_experts)
    buffer = e * sequences * moe.num_experts * slots * m.d_model
    return 4 * ring(x) * buffer * moe_layers
