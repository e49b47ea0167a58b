"""Enumerate legal layouts for a device count, predict each one, rank the ones that fit.

The search covers every factorisation of the devices into stage x data x fsdp x expert x
sequence x tensor (tensor within one node and dividing the heads, MLP and vocabulary; expert
dividing the experts; sequence only for sequences of 4k tokens or more, as a ring or by
all-to-all), sequence parallelism with tensor > 1, ZeRO 0/1/2 with data > 1, remat
none/save_dots/full (and offload to host memory, not on CPUs), pipeline microbatches p, 2p, 4p,
8p (and the smallest count >= p dividing the batch; multiples of p when interleaved) with 1F1B,
GPipe, zero-bubble ZB-H1 and ZB-V and interleaved (2 chunks) schedules, and gradient
accumulation to bring the microbatch down (to one sequence) when nothing else fits. Each
candidate passes the same checks a run does (`config.checks.validate` and `check_layout`) before
it is shown.
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxtron.config.checks import all_to_all_splits, check_layout
from jaxtron.config.platforms import for_platform
from jaxtron.config.schema import Config
from jaxtron.errors import ConfigError
from jaxtron.planner.cost import Cost, estimate
from jaxtron.planner.hardware import Hardware
from jaxtron.planner.layout import Layout, apply
from jaxtron.planner.memory import Memory, activation_bytes, state_bytes, with_state

REMATS = ("none", "save_dots", "full", "offload")  # offload: not on CPUs (no host memory kind)
# What `_meshes` chooses of a layout; `_variants` chooses the rest.
MESH_FIELDS = ("data", "fsdp", "tensor", "sequence", "expert", "stage", "context_parallel",
               "all_to_all_group")
VARIANT_FIELDS = ("sequence_parallel", "zero_stage", "remat", "microbatches", "schedule",
                  "virtual_stages", "grad_accum", "recompute")


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: Memory | None  # None: its state alone exceeds the budget
    cost: Cost | None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(config: Config, devices: int, node_size: int):
    m = config.model
    for tensor in divisors(devices):
        if tensor > node_size or any(x % tensor for x in (m.num_heads, m.mlp_dim,
                                                          m.vocab_size)):
            continue
        for stage in divisors(devices // tensor):
            if stage > m.num_layers:
                continue
            rest = devices // tensor // stage
            for sequence in divisors(rest):
                for mode in _context_modes(config, sequence, stage, tensor, node_size):
                    mode, group = mode if isinstance(mode, tuple) else (mode, 1)
                    for expert in divisors(rest // sequence):
                        if expert > 1 and (not config.moe.enabled
                                           or config.moe.num_experts % expert):
                            continue
                        for fsdp in divisors(rest // sequence // expert):
                            if m.d_model % fsdp:
                                continue
                            data = rest // sequence // expert // fsdp
                            yield Layout(data=data, fsdp=fsdp, tensor=tensor,
                                         sequence=sequence, expert=expert, stage=stage,
                                         context_parallel=mode, all_to_all_group=group)


def _context_modes(config: Config, sequence: int, stage: int, tensor: int,
                   node_size: int) -> tuple:
    """Forms of context parallelism worth trying over `sequence` devices (hybrid as
    ("hybrid", group)): none below 4k tokens; all-to-all where the heads split; hybrid only
    where the whole axis leaves the node and a group with its tensor ranks stays inside (else
    plain all-to-all does as well). Inside pipeline stages the ring gathers k/v instead
    (`context_gather.py`), whose memory and traffic the predictions do not model, and so does
    hybrid; all-to-all runs there as it is."""
    if sequence == 1:
        return ("ring",)
    if config.data.seq_len < 4096 or config.moe.enabled:
        return ()
    ring = stage == 1 and config.data.seq_len % (2 * sequence) == 0
    modes = ("ring",) * ring
    if all_to_all_splits(config.model, tensor, sequence):
        modes += ("all_to_all",)
    if stage == 1 and sequence * tensor > node_size:
        modes += tuple(("hybrid", g) for g in divisors(sequence)
                       if 1 < g < sequence and g * tensor <= node_size
                       and config.data.seq_len % (2 * sequence // g) == 0
                       and all_to_all_splits(config.model, tensor, g))
    return modes


def _accumulations(sequences: int) -> list[int]:
    """Accumulation steps that divide a replica's `sequences` per microbatch: powers of two,
    and all of them (one sequence per microbatch, as Megatron's large MoE recipes run)."""
    steps = [a for a in (2 ** i for i in range(sequences.bit_length())) if sequences % a == 0]
    return steps + ([sequences] if sequences and sequences not in steps else [])


def _microbatch_counts(per_replica: int, stages: int) -> list[int]:
    """Pipeline microbatch counts to try: p, 2p, 4p, 8p where they divide the replica's batch,
    and the smallest count from p up that does (1F1B needs m >= p, not a multiple of it), so a
    batch like 15 x 2^k still gets a pipeline."""
    counts = [stages * f for f in (1, 2, 4, 8) if per_replica % (stages * f) == 0]
    smallest = next((d for d in divisors(per_replica) if d >= stages), None)
    if smallest is not None and smallest <= 8 * stages and smallest not in counts:
        counts.insert(0, smallest)
    return counts


def _variants(config: Config, mesh: Layout, remats: tuple[str, ...]):
    batch = config.train.batch_size
    if batch % mesh.batch_split:
        return
    per_replica = batch // mesh.batch_split
    # sequence parallelism splits each sequence over tensor x sequence ranks
    sp_splits = mesh.tensor > 1 and config.data.seq_len % (mesh.tensor * mesh.sequence) == 0
    sps = (False, True) if sp_splits else (False,)
    zeros = (0, 1, 2) if mesh.data > 1 else (0,)
    pipelines = [(1, "1f1b", 1)]
    if mesh.stage > 1:
        pipelines = []
        for mb in _microbatch_counts(per_replica, mesh.stage):
            pipelines += [(mb, "1f1b", 1), (mb, "gpipe", 1), (mb, "zb-h1", 1)]
            if config.model.num_layers >= 2 * mesh.stage:
                pipelines.append((mb, "zbv", 2))
                if mb % mesh.stage == 0:
                    pipelines.append((mb, "interleaved", 2))
    recomputes = (True, False) if mesh.stage > 1 else (True,)
    # The mesh's own fields, copied whole into each variant, which is filled at once
    # (`Layout.of_fields`): a large search builds half a million.
    degrees = {name: getattr(mesh, name) for name in MESH_FIELDS}
    for sp, zero, remat, (mb, schedule, virtual), recompute in itertools.product(
            sps, zeros, remats, pipelines, recomputes):
        for accum in _accumulations(per_replica // mb if per_replica % mb == 0 else 0):
            yield Layout.of_fields({**degrees, **dict(zip(VARIANT_FIELDS, (
                sp, zero, remat, mb, schedule, virtual, accum, recompute)))})


def candidates(config: Config, devices: int, hardware: Hardware, platform: str = "gpu",
               budget: float = float("inf")):
    """Every layout with its predicted memory, and its step time where the memory fits
    `budget` (a layout that cannot run needs no timing: cost None). Where the parameters,
    gradients and optimizer state alone exceed `budget`, no activations can make the layout
    fit and none are predicted: memory None."""
    remats = REMATS if platform != "cpu" else REMATS[:-1]
    for mesh in _meshes(config, devices, hardware.node_size):
        activations = {}  # a mesh's variant holds the same activations at every ZeRO stage
        states = {}  # and the same state at every remat, schedule and microbatch count
        for layout in _variants(config, mesh, remats):
            holds = (layout.zero_stage, layout.grad_accum > 1)
            if holds not in states:
                states[holds] = state_bytes(config, layout)
            state = states[holds]
            if sum(state) > budget:
                yield Candidate(layout, None, None)
                continue
            variant = (layout.sequence_parallel, layout.remat, layout.microbatches,
                       layout.schedule, layout.virtual_stages, layout.grad_accum,
                       layout.recompute)
            if variant not in activations:
                activations[variant] = activation_bytes(config, layout)
            memory = with_state(config, state, activations[variant])
            yield Candidate(layout, memory, estimate(config, layout, hardware, platform)
                            if memory.total <= budget else None)


def is_legal(config: Config, layout: Layout) -> bool:
    """The same checks a run makes before it starts."""
    try:
        check_layout(apply(config, layout), layout.degrees())
    except ConfigError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Ranking:
    """Every layout that fits the budget, fastest first, and how many were considered."""
    fitting: list[Candidate]
    considered: int

    def best(self, config: Config, top: int = 10) -> list[Candidate]:
        """The `top` fastest layouts that pass the run's own checks."""
        legal = (c for c in self.fitting if is_legal(config, c.layout))
        return list(itertools.islice(legal, top))

    def position_of(self, fixed: dict) -> tuple[int | None, Candidate | None]:
        """The best layout whose fields include `fixed` (e.g. a published mesh; the planner
        picks the rest) and its rank among the fitting layouts (1 = fastest)."""
        for index, candidate in enumerate(self.fitting):
            if all(getattr(candidate.layout, k) == v for k, v in fixed.items()):
                faster = sum(c.cost.step_s < candidate.cost.step_s for c in self.fitting[:index])
                return faster + 1, candidate
        return None, None


def plan(config: Config, devices: int, hardware: Hardware, budget: int,
         platform: str = "gpu") -> Ranking:
    # The planner's "gpu" is a CUDA machine; `model.dtype: auto` then means bf16.
    config = for_platform(config, "cuda" if platform == "gpu" else platform)
    considered, fitting = 0, []
    for candidate in candidates(config, devices, hardware, platform, budget):
        considered += 1
        if candidate.cost is not None:
            fitting.append(candidate)
    # Among equally fast layouts prefer fewer moving parts: no accumulation, no recompute,
    # no ZeRO, no sequence parallelism; then less memory.
    fitting.sort(key=lambda c: (round(c.cost.step_s, 9), c.layout.grad_accum,
                                REMATS.index(c.layout.remat), not c.layout.recompute,
                                c.layout.zero_stage,
                                c.layout.sequence_parallel, c.memory.total))
    return Ranking(fitting, considered)
