"""What a pipeline's training and evaluation programs share: the tick table's arrays, the
shard_map over `stage` (and the replica axes), the ends' gather to the ranks that use them, the
composite stage (embed first on the first virtual stage, the loss on the last), the per-tick
exchange of outputs, and the metrics a stage reports. `engine.py` runs the loops; `jobs.py`
holds what each tick's job does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxtron.pipeline.ticks import Table, exchange_patterns
from jaxtron.sharding.rules import manual_axes, shard_map_mesh, without_mesh_axis

AXIS = "stage"
EXCHANGE_SCOPE = "pipeline_exchange_ticks_"  # + "<n>_of_<ticks>": how often a branch runs
REPLICA_AXES = ("data",)  # mesh axes over which parameters are replicated and the batch split
TABLE_ARRAYS = ("kind", "microbatch", "chunk", "act_slot", "grad_slot", "recv_act", "recv_grad",
                "w_slot", "recv_act_up", "recv_act_self", "recv_grad_down", "recv_grad_self",
                "send_dir", "res_slot")


def gather_ends(tree, users: tuple[int, ...], me, p: int):
    """This rank's `[1, n/p, ...]` slices -> `[n, ...]` whole on the ranks in `users`.

    Other ranks end up with their own slice and zeros, which nothing reads. Linear, so its
    transpose (jax.vjp) sends each user's gradient of a slice back to the slice's owner.
    """
    def one(slice_1xK):
        own_K = slice_1xK[0]
        parts = []
        for src in range(p):
            part = jnp.where(me == src, own_K, jnp.zeros_like(own_K))
            for user in users:
                if user != src:  # a single pair: only `user` receives
                    part = part + jax.lax.ppermute(own_K, AXIS, [(src, user)])
            parts.append(part)
        return jnp.concatenate(parts)

    return jax.tree.map(one, tree)


def microbatch(tree, index):
    """Microbatch `index` of every [M, ...] leaf of an input or target tree."""
    return jax.tree.map(lambda a: a[index], tree)


@dataclasses.dataclass
class Rank:
    """What one rank holds inside the map: its index, the ends gathered whole where it uses
    them, its own chunks' parameters `[v, Lmax, ...]` and active masks, the microbatches'
    inputs and targets, and a zero activation of the stages' shape."""
    me: jax.Array
    first: object
    shared: object
    last: object
    stage: object
    active: jax.Array
    inputs: dict
    targets: dict
    zeros_x: jax.Array


class Program:
    """The set-up the training and evaluation maps share (see the module docstring).

    first_fn(first, shared, inputs) -> x; stage_fn(chunk_p, chunk_active, x, inputs) -> (x,
    extra) with extra["objective"] a term the stage adds to the objective (0 for none) and its
    other entries metrics; last_fn(last, shared, x, targets) -> (mean loss of the microbatch,
    extra) with extra as a stage's."""

    def __init__(self, table: Table, mesh: Mesh, first_fn: Callable, stage_fn: Callable,
                 last_fn: Callable):
        self.table, self.mesh = table, mesh
        self.first_fn, self.stage_fn, self.last_fn = first_fn, stage_fn, last_fn
        self.p, self.m = table.stages, table.microbatches
        self.last_stage = table.stages * table.virtual - 1
        self.tabs = {name: jnp.asarray(getattr(table, name)) for name in TABLE_ARRAYS}
        # The loss's rank: p - 1 around a ring, rank 0 at the top of a V.
        self.last_rank = 0 if table.v_shape else self.p - 1
        # The exchanges the table makes, each with only the pairs that carry a value, and
        # which one each tick makes (the same on every rank: a switch all ranks take alike).
        self.patterns, pattern_of_tick = exchange_patterns(table)
        self.pattern_of_tick = jnp.asarray(pattern_of_tick)
        self.pattern_shares = np.bincount(pattern_of_tick, minlength=len(self.patterns))

    # -- the map --------------------------------------------------------------------------

    def replicas(self) -> tuple[str, ...]:
        """Replica axes to make manual: those with more than one rank, unless an enclosing
        shard_map (a data-parallel gradient reduction) has made them manual already."""
        outer = manual_axes()
        return tuple(a for a in REPLICA_AXES if self.mesh.shape.get(a, 1) > 1 and a not in outer)

    def replica_count(self, replicas) -> int:
        return math.prod(self.mesh.shape[a] for a in replicas)

    def mapped(self, body: Callable, out_specs):
        """body(replicas, first_s, last_s, shared_s, stage_p, active, inputs_M, targets_M) as
        one shard_map over `stage` and the replica axes; -> (fn of the same arguments less
        `replicas`, replicas)."""
        replicas = self.replicas()

        def run(*args):
            with self._manual(replicas):
                return body(replicas, *args)

        batch = PartitionSpec(None, replicas or None)  # [M, B, T]: rows split over replicas
        staged = PartitionSpec(AXIS)
        specs = out_specs(replicas) if callable(out_specs) else out_specs
        return jax.shard_map(run, mesh=shard_map_mesh(self.mesh),
                             axis_names={AXIS, *replicas}, check_vma=False,
                             in_specs=(staged, staged, staged, staged, staged, batch, batch),
                             out_specs=specs), replicas

    @staticmethod
    @contextlib.contextmanager
    def _manual(replicas):
        """Activation constraints inside the map name only the automatic axes."""
        with contextlib.ExitStack() as stack:
            for axis in (AXIS, *replicas):
                stack.enter_context(without_mesh_axis(axis))
            yield

    # -- a rank inside the map ------------------------------------------------------------

    def rank(self, first_s, last_s, shared_s, stage_p, active, inputs, targets,
             differentiate_ends: bool = False):
        """-> (Rank, the transpose of the ends' gather when `differentiate_ends`)."""
        me = jax.lax.axis_index(AXIS)
        gather = lambda f, l, s: self.ends(f, l, s, me)  # noqa: E731
        if differentiate_ends:
            (first_p, last_p, shared_p), send_back = jax.vjp(gather, first_s, last_s, shared_s)
        else:
            (first_p, last_p, shared_p), send_back = gather(first_s, last_s, shared_s), None
        x = jax.eval_shape(self.first_fn, first_p, shared_p, microbatch(inputs, 0))
        stage = jax.tree.map(lambda a: a[0], stage_p)  # [v, Lmax, ...] of this rank
        return Rank(me, first_p, shared_p, last_p, stage, active[0], inputs, targets,
                    jnp.zeros(x.shape, x.dtype)), send_back

    def ends(self, first_s, last_s, shared_s, me):
        p, last = self.p, self.last_rank
        return (gather_ends(first_s, (0,), me, p), gather_ends(last_s, (last,), me, p),
                gather_ends(shared_s, tuple(sorted({0, last})), me, p))

    def at(self, name: str, t, me):
        """This rank's entry of table array `name` at tick t."""
        return self.tabs[name][t, me]

    def stage_of(self, chunk, me):
        """The virtual stage this rank's `chunk` runs (`ticks.virtual_stage`)."""
        if self.table.v_shape:
            return jnp.where(chunk == 0, me, 2 * self.p - 1 - me)
        return chunk * self.p + me

    @staticmethod
    def chunk(rank: Rank, chunk):
        """(parameters, active mask) of the rank's model chunk `chunk`."""
        pick = lambda a: jax.lax.dynamic_index_in_dim(a, chunk, 0, False)  # noqa: E731
        return jax.tree.map(pick, rank.stage), pick(rank.active)

    def composite(self, rank: Rank, micro, chunk, chunk_active, first, shared, chunk_p, last,
                  x_in):
        """One virtual stage: embed first if it is the first, add the loss if the last.
        -> ((y, objective), metrics)."""
        virtual_stage = self.stage_of(chunk, rank.me)
        inputs, targets = microbatch(rank.inputs, micro), microbatch(rank.targets, micro)
        x = jax.lax.cond(virtual_stage == 0, lambda: self.first_fn(first, shared, inputs),
                         lambda: x_in)
        y, extra = self.stage_fn(chunk_p, chunk_active, x, inputs)
        last_fn = lambda: self.last_fn(last, shared, y, targets)  # noqa: E731
        loss, last_extra = jax.lax.cond(
            virtual_stage == self.last_stage, last_fn,
            lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(last_fn)))
        extra, last_extra = dict(extra), dict(last_extra)
        objective = loss.astype(jnp.float32) + extra.pop("objective") + last_extra.pop(
            "objective")
        return (y, objective), {"loss": loss.astype(jnp.float32), **extra, **last_extra}

    # -- between ticks --------------------------------------------------------------------

    def exchange(self, t, me, out, buffers: dict) -> dict:
        """After a tick: send this rank's output `out` the way `send_dir` says (around a
        ring: forward outputs to d + 1, the last rank's to rank 0, input gradients to d - 1)
        and store what arrives (from d - 1, from d + 1, or in a V this rank's own turn at its
        bottom) where the table says, in `buffers` ({"acts": ..., "grads_in": ...}); the
        table's scratch slot takes what goes nowhere. Only the ranks the tick's pattern names
        send: a rank that trades with no one waits for no one."""
        got_down, got_up = jax.lax.switch(self.pattern_of_tick[t],
                                          [self._trade(i) for i in range(len(self.patterns))],
                                          out)
        writes = {"acts": (("recv_act", got_down), ("recv_act_up", got_up),
                           ("recv_act_self", out)),
                  "grads_in": (("recv_grad_down", got_down), ("recv_grad", got_up),
                               ("recv_grad_self", out))}
        out_buffers = {}
        for name, buffer in buffers.items():
            for slots, value in writes[name]:
                buffer = buffer.at[self.at(slots, t, me)].set(value)
            out_buffers[name] = buffer
        return out_buffers

    def _trade(self, index: int) -> Callable:
        """The exchange of pattern `index`: one collective permute per direction that has
        pairs (zeros arrive where none does). Its scope names how many of the table's ticks
        make it, which the collective counter reads (`sharding/collectives.py`)."""
        down, up = self.patterns[index]
        share = int(self.pattern_shares[index])

        def trade(out):
            with jax.named_scope(f"{EXCHANGE_SCOPE}{share}_of_{self.table.ticks}"):
                got_down = jax.lax.ppermute(out, AXIS, list(down)) if down else \
                    jnp.zeros_like(out)
                got_up = jax.lax.ppermute(out, AXIS, list(up)) if up else jnp.zeros_like(out)
            return got_down, got_up
        return trade

    # -- metrics --------------------------------------------------------------------------

    def metric_zeros(self, rank: Rank):
        """Zeros shaped like the metrics `composite` reports: (scalars, per-chunk arrays)."""
        chunk_p, chunk_active = self.chunk(rank, 0)
        inputs, targets = microbatch(rank.inputs, 0), microbatch(rank.targets, 0)
        x = jax.eval_shape(self.first_fn, rank.first, rank.shared, inputs)
        y, extra = jax.eval_shape(self.stage_fn, chunk_p, chunk_active,
                                  jnp.zeros(x.shape, x.dtype), inputs)
        _, last_extra = jax.eval_shape(self.last_fn, rank.last, rank.shared,
                                       jnp.zeros(y.shape, y.dtype), targets)
        scalars = {"loss": jnp.zeros((), jnp.float32)}
        per_chunk = {}
        for name, value in {**extra, **last_extra}.items():
            if name == "objective":
                continue
            if value.ndim:  # one value per layer of the chunk: kept per chunk, not summed
                per_chunk[name] = jnp.zeros((self.table.virtual, *value.shape), value.dtype)
            else:
                scalars[name] = jnp.zeros((), jnp.float32)
        return scalars, per_chunk

    @staticmethod
    def add_metrics(acc, metrics, chunk, scale):
        """Scalars summed; per-chunk arrays (e.g. each layer's expert load) added at `chunk`."""
        scalars, per_chunk = acc
        scalars = {k: v + metrics[k] * scale for k, v in scalars.items()}
        per_chunk = {k: v.at[chunk].add(metrics[k] * scale) for k, v in per_chunk.items()}
        return scalars, per_chunk
