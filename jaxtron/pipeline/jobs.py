"""What a pipeline rank does at one tick: the jobs of a tick table, and the loop state they share.

A job is a method `job(carry, t, held) -> (carry, out, written)`:

    carry    the loop state (`Carry`), without the slotted buffers (`slotted()`)
    t        the tick; the rank's entries of the table at t say which microbatch and chunk
    held     held(buffer) -> this tick's slot of a slotted buffer, sliced inside the branch that
             reads it (so other ticks copy nothing)
    out      the job's one output, sent after the tick the way the table says (zeros: nothing)
    written  {buffer: values} for the slotted buffers it fills, put into the tick's slot after
             the switch, in place

`engine.run_tick` runs the job of the table's kind under `lax.switch`. A forward stores nothing
but the received input activation (in the slot the table assigned); a whole backward recomputes
the stage from it under `jax.vjp` (or, with `recompute=False`, transposes the stage's tangent
map from the residuals its forward left, `stored_vjp.py`); a split backward is a B that forms
the input gradient and the ends' gradients and stashes what the weights' products need, and a
later W that forms those products (`split_vjp.py`). A split table that recomputes runs the stage
again as an R before each B, leaving the residuals B reads as a stored forward would.
Gradients accumulate in `Grads`, in the layouts of their parameters.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxtron.pipeline.program import Program, Rank
from jaxtron.pipeline.split_vjp import SplitVJP
from jaxtron.pipeline.stored_vjp import StoredVJP
from jaxtron.pipeline.ticks import FORWARD, INPUT_GRAD, RECOMPUTE


@struct.dataclass
class Grads:
    """Gradient accumulators: the ends' (whole, where this rank uses them) and the chunks'."""
    first: object
    shared: object
    stage: object
    last: object


@struct.dataclass
class Carry:
    acts: jax.Array  # [act_slots + 1, *x]: received activations, the last slot scratch
    loss: jax.Array  # the objective summed so far, scaled to a mean
    grads_in: jax.Array | None = None  # [grad_slots + 1, *x]: received gradients (training)
    metrics: tuple | None = None  # (scalars, per-chunk arrays), training
    grads: Grads | None = None  # training
    res: list | None = None  # [res_slots, ...] per residual: recompute=False, or R's
    stash: list | None = None  # [w_slots, ...] per stashed value: split tables


def _zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


class EvaluationJobs:
    """A forward-only table's jobs: idle, forward (adding the microbatch's loss)."""

    def __init__(self, program: Program, rank: Rank):
        self.program, self.rank = program, rank

    def by_kind(self) -> list[Callable]:
        return [self.idle, self.forward]

    def slotted(self) -> dict[str, tuple[str, int]]:
        """Buffers written by one kind of job and read by a later one: (slot table, writer's
        kind)."""
        residuals_from = RECOMPUTE if self.program.table.recomputes else FORWARD
        return {"res": ("res_slot", residuals_from), "stash": ("w_slot", INPUT_GRAD)}

    def initial_carry(self) -> Carry:
        table, x = self.program.table, self.rank.zeros_x
        return Carry(acts=jnp.zeros((table.act_slots + 1, *x.shape), x.dtype),
                     loss=jnp.zeros((), jnp.float32))

    def idle(self, carry: Carry, t, held):
        return carry, self.rank.zeros_x, {}

    def forward(self, carry: Carry, t, held):
        program, rank = self.program, self.rank
        micro, chunk = program.at("microbatch", t, rank.me), program.at("chunk", t, rank.me)
        x_in = carry.acts[program.at("act_slot", t, rank.me)]
        chunk_p, chunk_active = program.chunk(rank, chunk)
        (y, _), metrics = program.composite(rank, micro, chunk, chunk_active, rank.first,
                                            rank.shared, chunk_p, rank.last, x_in)
        carry = carry.replace(loss=carry.loss + metrics["loss"] / program.m)
        return carry, self._unless_last(chunk, y), {}

    def _unless_last(self, chunk, y):
        """The output to send on: nothing from the last virtual stage."""
        is_last = self.program.stage_of(chunk, self.rank.me) == self.program.last_stage
        return jnp.where(is_last, self.rank.zeros_x, y)


class TrainingJobs(EvaluationJobs):
    """A training table's jobs. `scale` turns each microbatch's loss into its share of the
    mean over microbatches and replicas; `store`: forwards keep their residuals."""

    def __init__(self, program: Program, rank: Rank, scale: float, store: bool):
        super().__init__(program, rank)
        self.scale, self.store = scale, store
        self.from_residuals = store or program.table.recomputes  # backwards read residuals
        # StoredVJP keeps its trace for the whole body: `_stage` may close over what lives as
        # long as the rank (program, rank), never over a value of one tick.
        self.stored_vjp, self.split = StoredVJP(self._stage), SplitVJP()

    def by_kind(self) -> list[Callable]:
        table = self.program.table
        if not table.split:
            return [self.idle, self.forward, self.backward]
        return [self.idle, self.forward, self.idle, self.input_grad, self.weight_grad,
                *([self.recompute] if table.recomputes else [])]

    def initial_carry(self) -> Carry:
        table, rank, x = self.program.table, self.rank, self.rank.zeros_x
        carry = super().initial_carry().replace(
            grads_in=jnp.zeros((table.grad_slots + 1, *x.shape), x.dtype),
            metrics=self.program.metric_zeros(rank),
            grads=Grads(_zeros(rank.first), _zeros(rank.shared), _zeros(rank.stage),
                        _zeros(rank.last)))
        t0 = jnp.zeros((), jnp.int32)
        res = []
        if self.from_residuals:  # each forward's (or R's) residuals, in a slot until B
            _, params, where = self._job_fn(t0)  # traced here once for every job that runs it
            res = self.stored_vjp.residual_shapes(params, x, where)
            carry = carry.replace(res=[jnp.zeros((table.res_slots, *a.shape), a.dtype)
                                       for a in res])
        if table.split:  # each B's stash, kept in its slot until its W
            zeros_res = [jnp.zeros(a.shape, a.dtype) for a in res]
            stash = jax.eval_shape(
                lambda t: self._input_and_stash(carry, t, lambda _: zeros_res)[2], t0)
            carry = carry.replace(stash=[jnp.zeros((table.w_slots, *a.shape), a.dtype)
                                         for a in stash])
        return carry

    def _at(self, name: str, t):
        return self.program.at(name, t, self.rank.me)

    def _stage(self, params, x, where):
        """The rank's composite stage: params (first, shared, chunk, last), where (microbatch,
        chunk, the chunk's active mask) -> ((y, objective), metrics)."""
        return self.program.composite(self.rank, *where, *params, x)

    def _job_fn(self, t):
        """(fn(params, x) -> ((y, objective), metrics), params, where) of the job at tick t:
        `_stage` at the tick's microbatch and chunk."""
        rank, chunk = self.rank, self._at("chunk", t)
        chunk_p, chunk_active = self.program.chunk(rank, chunk)
        where = (self._at("microbatch", t), chunk, chunk_active)
        return (lambda ps, x: self._stage(ps, x, where),
                (rank.first, rank.shared, chunk_p, rank.last), where)

    def forward(self, carry: Carry, t, held):
        x_in = carry.acts[self._at("act_slot", t)]
        fn, params, where = self._job_fn(t)
        if self.store:  # the residuals the backward reads, instead of recomputing them
            (y, objective), metrics, residuals = self.stored_vjp.forward(params, x_in, where)
        else:
            ((y, objective), metrics), residuals = fn(params, x_in), None
        carry = carry.replace(
            loss=carry.loss + objective * self.scale,
            metrics=self.program.add_metrics(carry.metrics, metrics, self._at("chunk", t),
                                             self.scale))
        return carry, self._unless_last(self._at("chunk", t), y), {"res": residuals}

    def recompute(self, carry: Carry, t, held):
        """R: the stage again from its input, for the residuals its B reads; nothing sent."""
        _, params, where = self._job_fn(t)
        _, _, residuals = self.stored_vjp.forward(params, carry.acts[self._at("act_slot", t)],
                                                  where)
        return carry, self.rank.zeros_x, {"res": residuals}

    def _backward_job(self, carry: Carry, t):
        """(fn, params, where, its input, the output cotangent) of the backward at tick t."""
        chunk = self._at("chunk", t)
        x_in = carry.acts[self._at("act_slot", t)]
        is_last = self.program.stage_of(chunk, self.rank.me) == self.program.last_stage
        dy = jnp.where(is_last, self.rank.zeros_x, carry.grads_in[self._at("grad_slot", t)])
        dloss = jnp.asarray(self.scale, jnp.float32)  # every stage may add auxiliary terms
        fn, params, where = self._job_fn(t)
        return fn, params, where, x_in, (dy, dloss)

    def _accumulate(self, carry: Carry, t, first=None, shared=None, stage=None, last=None):
        """Add gradients to the accumulators (the chunk's at its index); None: none."""
        g = carry.grads
        add = lambda acc, new: acc if new is None else jax.tree.map(jnp.add, acc, new)  # noqa
        if stage is not None:
            chunk = self._at("chunk", t)
            stage = jax.tree.map(lambda acc, new: acc.at[chunk].add(new), g.stage, stage)
        return carry.replace(grads=Grads(add(g.first, first), add(g.shared, shared),
                                         g.stage if stage is None else stage, add(g.last, last)))

    def _sent_back(self, t, dx):
        """The input gradient to send: nothing from the first virtual stage."""
        is_first = self.program.stage_of(self._at("chunk", t), self.rank.me) == 0
        return jnp.where(is_first, self.rank.zeros_x, dx)

    def backward(self, carry: Carry, t, held):
        fn, params, where, x_in, cotangent = self._backward_job(carry, t)
        if self.store:
            grads, dx = self.stored_vjp.backward(params, x_in, where, held("res"), cotangent)
        else:  # recompute the stage from its input
            _, vjp, _ = jax.vjp(fn, params, x_in, has_aux=True)
            grads, dx = vjp(cotangent)
        first, shared, stage, last = grads
        carry = self._accumulate(carry, t, first, shared, stage, last)
        return carry, self._sent_back(t, dx), {}

    def _input_and_stash(self, carry: Carry, t, held):
        """-> (dx, the ends' gradients, the chunk's stash). The ends (embedding, head) are
        differentiated in B with the input: they sit behind the first and last stages'
        conditionals, which W's program would otherwise carry."""
        fn, (first, shared, chunk_p, last), where, x_in, cotangent = self._backward_job(carry, t)
        tangent = None
        if self.from_residuals:
            full = self.stored_vjp.tangent_map((first, shared, chunk_p, last), x_in, where,
                                               held("res"))
            tangent = lambda c, xs: full((xs[1], xs[2], c, xs[3]), xs[0])  # noqa: E731
        (dx, *ends), stash = self.split.input_grad(
            lambda c, xs: fn((xs[1], xs[2], c, xs[3]), xs[0]), chunk_p,
            (x_in, first, shared, last), cotangent, tangent)
        return dx, ends, stash

    def input_grad(self, carry: Carry, t, held):
        dx, (first, shared, last), stash = self._input_and_stash(carry, t, held)
        carry = self._accumulate(carry, t, first=first, shared=shared, last=last)
        return carry, self._sent_back(t, dx), {"stash": stash}

    def weight_grad(self, carry: Carry, t, held):  # B's of this function were traced before
        carry = self._accumulate(carry, t, stage=self.split.weight_grad(held("stash")))
        return carry, self.rank.zeros_x, {}
