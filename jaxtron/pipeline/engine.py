"""Run a tick table inside one `shard_map` over the `stage` axis: forward and backward
interleave in a single compiled loop, so 1F1B really holds at most ~p activations per rank.

Every tick each rank looks up its job in the table and runs it under `lax.switch`
(`jobs.py`), then the tick's exchange: of the distinct exchanges the table makes
(`ticks.exchange_patterns`), the one for this tick, chosen alike on every rank, with one
`ppermute` per direction over just the pairs whose job's output goes that way (around a ring
the forward output to d + 1 and the input gradient to d - 1, the wrap-around carrying
interleaved chunks from the last rank back to the first; in a V also the other ways, and the
turn kept local). Nothing is sent where nothing goes, and a rank that trades with no one at a
tick waits for no one there. The first virtual stage (always on rank 0) embeds the
microbatch's tokens and the last (on rank p - 1, or rank 0 in a V) computes its loss, so
embedding and head gradients come out of the same loop.

The parameters of the two ends arrive split evenly over the ranks, `[p, n/p, ...]` (SPMD
programs give every rank the same shapes, so a table kept whole on its one user would cost its
size on every rank). Before the loop each slice is sent only to the rank that uses it:
`first` to rank 0, `last` to the loss's rank, `shared` (tied embeddings) to both, one
collective-permute per slice and user. After the loop the transpose of that gather sends each
gradient slice back to its owner, so the ends never need an all-reduce over `stage`.

Data parallelism: the `data` axis is manual here too, so each replica accumulates its own
gradients over the whole schedule and they are summed once, after the loop, outside this map
(GSPMD would otherwise reduce them over `data` at every backward tick). Inside an enclosing
data-parallel reduction (`training/data_parallel.py`: gradient accumulation, ZeRO-2) `data` is
manual already and that reduction is the one. fsdp and tensor sharding inside a stage stay
automatic.

`pipeline_loss` runs a forward-only table (`schedules.forward_table`) the same way: evaluation
through the pipeline, with every layer staying on its rank.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxtron.pipeline.jobs import Carry, EvaluationJobs, TrainingJobs
from jaxtron.pipeline.program import AXIS, Program
from jaxtron.pipeline.ticks import Table


def run_tick(program: Program, jobs: EvaluationJobs, carry: Carry, t) -> Carry:
    """This rank's job at tick t, then the exchange. Stored residuals and stashes are not
    returned by the switch (its branches would each return a copy of them): the job that reads
    a slot slices it inside its branch; the one that writes returns the values (the others
    zeros), and they go into their slot after the switch under a conditional that XLA updates
    in place."""
    me = jobs.rank.me
    kind = program.at("kind", t, me)
    slotted = jobs.slotted()
    buffers = {name: getattr(carry, name) for name in slotted
               if getattr(carry, name) is not None}
    slots = {name: program.at(slotted[name][0], t, me) for name in buffers}

    def held(name):  # sliced inside the branch that reads it: no copy on other ticks
        return [b[slots[name]] for b in buffers[name]]

    def branch(job):
        def run(c, t):
            c, out, written = job(c, t, held)
            return c, out, {name: written.get(name) or [jnp.zeros(b.shape[1:], b.dtype)
                                                        for b in bufs]
                            for name, bufs in buffers.items()}
        return run

    bare = carry.replace(**dict.fromkeys(buffers))
    bare, out, written = jax.lax.switch(kind, [branch(job) for job in jobs.by_kind()], bare, t)
    for name, bufs in buffers.items():  # in place, under a conditional
        slot = slots[name]
        buffers[name] = jax.lax.cond(
            kind == slotted[name][1],
            lambda bs, vs: [b.at[slot].set(v) for b, v in zip(bs, vs)],
            lambda bs, vs: bs, bufs, written[name])
    carry = bare.replace(**buffers)
    received = {"acts": carry.acts, "grads_in": carry.grads_in}
    return carry.replace(**program.exchange(
        t, me, out, {k: v for k, v in received.items() if v is not None}))


def pipeline_value_and_grad(table: Table, mesh: Mesh, first_fn: Callable, stage_fn: Callable,
                            last_fn: Callable, recompute: bool = True):
    """Build fn(first_s, last_s, shared_s, stage_p, active, inputs_M, targets_M) -> ((objective,
    metrics), (g_first, g_last, g_shared, g_stage)), gradients in the layouts of their
    parameters.

    The stage functions are `program.Program`'s. The objective is the loss plus every stage's
    terms, the mean over microbatches (and replicas); metrics holds the loss and the stages'
    scalar metrics, each summed over stages and averaged like the loss, and a stage's array
    metrics (one row per layer, e.g. expert loads) in the pipeline layout [p, v, ...],
    averaged over microbatches and replicas. `inputs_M` and `targets_M` are trees of [M, ...]
    arrays (a microbatch's tokens, and whatever else its stages read: positions, segment ids,
    loss weights), each function given its microbatch. The ends (`first_s`, `last_s`,
    `shared_s`) are split `[p, n/p, ...]` and reach first_fn / last_fn whole, `[n, ...]` (n
    rounded up to a multiple of p); stage_p and active carry the pipeline layout `[p, v,
    Lmax, ...]`. Without recomputation (`recompute=False`) a forward also leaves the
    residuals its backward reads (`stored_vjp.py`).
    """
    if table.recomputes and not recompute:
        raise ValueError("a table with R jobs recomputes its stages: build it for "
                         "pipeline.recompute=false (schedules.build_table) instead")
    program = Program(table, mesh, first_fn, stage_fn, last_fn)

    def body(replicas, *args):
        rank, send_back = program.rank(*args, differentiate_ends=True)
        # Each replica's loss is the mean of its rows: the global mean divides by replicas too.
        scale = 1.0 / (program.m * program.replica_count(replicas))
        jobs = TrainingJobs(program, rank, scale, store=not recompute)
        carry = jax.lax.fori_loop(0, table.ticks, lambda t, c: run_tick(program, jobs, c, t),
                                  jobs.initial_carry())
        return _training_results(carry, send_back, replicas)

    def specs(replicas):
        grads = PartitionSpec(replicas, AXIS) if replicas else PartitionSpec(AXIS)
        return (PartitionSpec(), PartitionSpec(), PartitionSpec(AXIS)), grads

    def value_and_grad(*args):
        mapped, replicas = program.mapped(body, specs)
        (loss, scalars, per_chunk), (g_ends, g_stage) = mapped(*args)
        if replicas:  # the data-parallel reduction, once per step
            g_ends, g_stage = jax.tree.map(lambda g: g.sum(0), (g_ends, g_stage))
        g_first, g_last, g_shared = g_ends
        return (loss, {**scalars, **per_chunk}), (g_first, g_last, g_shared, g_stage)

    return value_and_grad


def _training_results(carry: Carry, send_back, replicas):
    """The loop's sums as the map returns them: every rank's share of the objective and of the
    scalar metrics summed; per-chunk metrics and the chunks' gradients [1, v, ...] with their
    rank; each end's gradient sent back to the ranks that own its slices. Over the replicas the
    gradients stay unreduced (a leading [1] per replica, summed after the map)."""
    g = carry.grads
    g_ends = send_back((g.first, g.last, g.shared))
    g_stage = jax.tree.map(lambda a: a[None], g.stage)
    scalars, per_chunk = carry.metrics
    loss, scalars = jax.lax.psum((carry.loss, scalars), (AXIS, *replicas))
    if replicas:
        per_chunk = jax.lax.psum(per_chunk, replicas)
    per_chunk = jax.tree.map(lambda a: a[None], per_chunk)
    grads = (g_ends, g_stage)
    return (loss, scalars, per_chunk), jax.tree.map(lambda a: a[None], grads) if replicas \
        else grads


def pipeline_loss(table: Table, mesh: Mesh, first_fn: Callable, stage_fn: Callable,
                  last_fn: Callable):
    """Build fn(first_s, last_s, shared_s, stage_p, active, inputs_M, targets_M) -> mean loss,
    running a forward-only `table` (see `pipeline_value_and_grad` for the arguments)."""
    program = Program(table, mesh, first_fn, stage_fn, last_fn)

    def body(replicas, *args):
        rank, _ = program.rank(*args)
        jobs = EvaluationJobs(program, rank)
        carry = jax.lax.fori_loop(0, table.ticks, lambda t, c: run_tick(program, jobs, c, t),
                                  jobs.initial_carry())
        loss = jax.lax.psum(carry.loss, AXIS)
        return jax.lax.pmean(loss, replicas) if replicas else loss

    def loss_fn(*args):
        mapped, _ = program.mapped(body, PartitionSpec())
        return mapped(*args)

    return loss_fn
