"""Run a tick table inside one `shard_map` over the `stage` axis: forward and backward
interleave in a single compiled loop, so 1F1B really holds at most ~p activations per rank.

Every tick each rank looks up its action in the table, runs it under `lax.switch`, then all
ranks call the same two collectives: `ppermute` to rank d + 1 and to rank d - 1, carrying the
rank's one output the way the table says (around a ring the forward output to d + 1 and the
input gradient to d - 1, the wrap-around carrying interleaved chunks from the last rank back
to the first; in a V also the other ways, and the turn kept local); idle ranks send zeros. A
forward stores nothing but the received input activation, in a slot the table assigned; the
backward recomputes the stage from that input under `jax.vjp` and adds the weight gradients to
accumulators in the loop carry. The first virtual stage (always on rank 0) embeds the
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
data-parallel reduction (`sharding/data_parallel.py`: gradient accumulation, ZeRO-2) `data` is
manual already and that reduction is the one. fsdp and tensor sharding inside a stage stay
automatic.

Without recomputation (`recompute=False`) a forward also leaves the residuals its backward
reads in a slot of the carry (`stored_vjp.py`), and the backward transposes the stage's tangent
map from them instead of running the stage again.

Split tables (`zb-h1`, `zbv`) run a backward as two jobs (`split_vjp.py`): B recomputes the
stage from its input as above (or reads its stored residuals) but forms only the input
gradient (and the ends', behind their conditionals), leaving the layers' weight inputs and
output gradients in a stash slot of the carry; W, later, forms the layers' weight gradients
from that stash and adds them to the accumulators.

What the training and evaluation loops share (the table's arrays, the ends' gather, the
composite stage, a V table's sends) is `stage_plan.Plan`.

`pipeline_loss` runs a forward-only table (`schedule.forward_table`) the same way: evaluation
through the pipeline, with every layer staying on its rank.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxtron.pipeline.ticks import FORWARD, INPUT_GRAD, Table
from jaxtron.pipeline.split_vjp import SplitVJP
from jaxtron.pipeline.stored_vjp import StoredVJP
from jaxtron.pipeline.stage_plan import AXIS, Plan, microbatch


def pipeline_value_and_grad(table: Table, mesh: Mesh, first_fn: Callable, stage_fn: Callable,
                            last_fn: Callable, recompute: bool = True):
    """Build fn(first_s, last_s, shared_s, stage_p, active, inputs_M, targets_M) -> ((objective,
    metrics), (g_first, g_last, g_shared, g_stage)), gradients in the layouts of their
    parameters.

    first_fn(first, shared, inputs) -> x; stage_fn(chunk_p, chunk_active, x, inputs) -> (x,
    extra) with extra["objective"] a term the stage adds to the objective (auxiliary losses;
    0 for none) and its other entries scalar metrics; last_fn(last, shared, x, targets) -> (mean
    loss of the microbatch, extra) with extra as a stage's (multi-token prediction's loss, say).
    The objective is the loss plus every stage's terms; metrics holds
    the loss and the stages' scalar metrics, each summed over stages and averaged like the loss,
    and a stage's array metrics (one row per layer, e.g. expert loads) in the pipeline layout
    [p, v, ...], averaged over microbatches and replicas. `inputs_M` and
    `targets_M` are trees of [M, ...] arrays (a microbatch's tokens, and whatever else its
    stages read: positions, segment ids, loss weights), each function given its microbatch. The ends (`first_s`,
    `last_s`, `shared_s`) are split `[p, n/p, ...]` and reach first_fn / last_fn whole, `[n, ...]`
    (n rounded up to a multiple of p); stage_p and active carry the pipeline layout
    `[p, v, Lmax, ...]`. The loss is the mean over microbatches (and replicas).
    """
    plan = Plan(table, mesh, first_fn, stage_fn, last_fn)
    m = plan.m
    tabs = plan.tabs
    store = not recompute

    def body(replicas, first_s, last_s, shared_s, stage_p, active, inputs, targets):
        me = jax.lax.axis_index(AXIS)
        stage_p = jax.tree.map(lambda a: a[0], stage_p)  # [v, Lmax, ...] of this rank
        active = active[0]
        (first_p, last_p, shared_p), send_back = jax.vjp(
            lambda f, l, s: plan.ends(f, l, s, me), first_s, last_s, shared_s)
        x_shape = jax.eval_shape(first_fn, first_p, shared_p, microbatch(inputs, 0))
        zeros_x = jnp.zeros(x_shape.shape, x_shape.dtype)
        # Each replica's loss is the mean of its rows: the global mean divides by replicas too.
        scale = 1.0 / (m * math.prod(mesh.shape[a] for a in replicas))

        stored_vjp, split = StoredVJP(), SplitVJP()

        def idle(carry, t, held):
            return carry, zeros_x, zeros_x, {}

        def job_run(t):
            """(fn(params, x) of the job at tick t, params = the ends and the chunk's)."""
            micro, chunk = tabs["microbatch"][t, me], tabs["chunk"][t, me]
            chunk_p, chunk_active = plan.chunk(stage_p, active, chunk)
            run = functools.partial(plan.composite, me, inputs, targets, micro, chunk,
                                    chunk_active)
            return lambda ps, x: run(*ps, x), (first_p, shared_p, chunk_p, last_p)

        def forward(carry, t, held):
            chunk = tabs["chunk"][t, me]
            x_in = carry["acts"][tabs["act_slot"][t, me]]
            fn, params = job_run(t)
            if store:  # the residuals the backward reads, instead of recomputing them
                (y, objective), metrics, residuals = stored_vjp.forward(fn, params, x_in)
            else:
                ((y, objective), metrics), residuals = fn(params, x_in), None
            carry = dict(carry, loss=carry["loss"] + objective * scale,
                         metrics=plan.add_metrics(carry["metrics"], metrics, chunk, scale))
            is_last = plan.stage_of(chunk, me) == plan.last_stage
            return carry, jnp.where(is_last, zeros_x, y), zeros_x, {"res": residuals}

        def stage_job(carry, t):
            """(fn, params, its input, the output cotangent) of the backward at tick t."""
            chunk = tabs["chunk"][t, me]
            x_in = carry["acts"][tabs["act_slot"][t, me]]
            is_last = plan.stage_of(chunk, me) == plan.last_stage
            dy = jnp.where(is_last, zeros_x, carry["grads_in"][tabs["grad_slot"][t, me]])
            dloss = jnp.asarray(scale, jnp.float32)  # every stage may add auxiliary terms
            fn, params = job_run(t)
            return fn, params, x_in, (dy, dloss)

        def accumulate(carry, t, grads):
            """Add (first, shared, chunk, last) gradients to the accumulators; None: none."""
            chunk = tabs["chunk"][t, me]
            carry = dict(carry)
            for name, g in zip(("g_first", "g_shared", "g_stage", "g_last"), grads):
                if g is None:
                    continue
                if name == "g_stage":
                    carry[name] = jax.tree.map(lambda acc, g: acc.at[chunk].add(g),
                                               carry[name], g)
                else:
                    carry[name] = jax.tree.map(jnp.add, carry[name], g)
            return carry

        def sent_back(t, dx):
            is_first = plan.stage_of(tabs["chunk"][t, me], me) == 0
            return jnp.where(is_first, zeros_x, dx)

        def backward(carry, t, held):
            fn, params, x_in, cotangent = stage_job(carry, t)
            if store:
                grads, dx = stored_vjp.backward(fn, params, x_in, held("res"), cotangent)
            else:  # recompute the stage from its input
                _, vjp, _ = jax.vjp(fn, params, x_in, has_aux=True)
                grads, dx = vjp(cotangent)
            return accumulate(carry, t, grads), zeros_x, sent_back(t, dx), {}

        def input_and_stash(carry, t, held):
            """-> (dx, the ends' gradients, the chunk's stash). The ends (embedding, head)
            are differentiated in B with the input: they sit behind the first and last
            stages' conditionals, which W's program would otherwise carry."""
            fn, (first, shared, chunk_p, last), x_in, cotangent = stage_job(carry, t)
            tangent = None
            if store:
                full = stored_vjp.tangent_map(fn, (first, shared, chunk_p, last), x_in,
                                              held("res"))
                tangent = lambda c, xs: full((xs[1], xs[2], c, xs[3]), xs[0])  # noqa: E731
            (dx, *ends), stash = split.input_grad(
                lambda c, xs: fn((xs[1], xs[2], c, xs[3]), xs[0]), chunk_p,
                (x_in, first, shared, last), cotangent, tangent)
            return dx, ends, stash

        def input_grad(c, t, held):
            dx, (g_first, g_shared, g_last), stash = input_and_stash(c, t, held)
            c = accumulate(c, t, (g_first, g_shared, None, g_last))
            return c, zeros_x, sent_back(t, dx), {"stash": stash}

        def weight_grad(c, t, held):  # B's of this function were traced before
            grads = (None, None, split.weight_grad(held("stash")), None)
            return accumulate(c, t, grads), zeros_x, zeros_x, {}

        # Buffers written by one kind of job and read by a later one: (slot table, writer).
        slotted = {"res": ("res_slot", FORWARD), "stash": ("w_slot", INPUT_GRAD)}

        def run_job(carry, t):
            """(carry, forward send, backward send) after this rank's job at tick t. Stored
            residuals and stashes are not returned by the switch (its branches would each
            return a copy of them): the job that reads a slot slices it inside its branch; the
            one that writes returns the values (the others zeros), and they go into their slot
            after the switch under a conditional that XLA updates in place."""
            kind = tabs["kind"][t, me]
            buffers = {name: carry.pop(name) for name in slotted if name in carry}
            slots = {name: tabs[slotted[name][0]][t, me] for name in buffers}

            def held(name):  # sliced inside the branch that reads it: no copy on other ticks
                return [b[slots[name]] for b in buffers[name]]

            def filled(job):
                def run(c, t):
                    c, send_fwd, send_bwd, written = job(c, t, held)
                    return c, send_fwd, send_bwd, {
                        name: written.get(name) or [jnp.zeros(b.shape[1:], b.dtype)
                                                    for b in bufs]
                        for name, bufs in buffers.items()}
                return run

            jobs = ((idle, forward, backward) if not table.split else
                    (idle, forward, idle, input_grad, weight_grad))
            carry, send_fwd, send_bwd, written = jax.lax.switch(
                kind, [filled(job) for job in jobs], carry, t)
            for name, bufs in buffers.items():  # in place, under a conditional
                slot = slots[name]
                carry[name] = jax.lax.cond(
                    kind == slotted[name][1],
                    lambda bs, vs: [b.at[slot].set(v) for b, v in zip(bs, vs)],
                    lambda bs, vs: bs, bufs, written[name])
            return carry, send_fwd, send_bwd

        def tick(t, carry):
            carry, send_fwd, send_bwd = run_job(dict(carry), t)
            # one job per tick, so one output: the other send is zeros
            buffers = {"acts": carry["acts"], "grads_in": carry["grads_in"]}
            return dict(carry, **plan.exchange(t, me, send_fwd + send_bwd, buffers))

        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
        carry = {
            "acts": jnp.zeros((table.act_slots + 1, *x_shape.shape), x_shape.dtype),
            "grads_in": jnp.zeros((table.grad_slots + 1, *x_shape.shape), x_shape.dtype),
            "loss": jnp.zeros((), jnp.float32),
            "metrics": plan.metric_zeros(stage_p, active, first_p, shared_p, last_p, inputs,
                                         targets),
            "g_first": zeros(first_p), "g_shared": zeros(shared_p), "g_last": zeros(last_p),
            "g_stage": zeros(stage_p),
        }
        t0 = jnp.zeros((), jnp.int32)
        if store:  # each forward's residuals, kept in its slot until its backward
            res = jax.eval_shape(lambda t: stored_vjp.forward(*job_run(t), zeros_x)[2],
                                 t0)
            carry["res"] = [jnp.zeros((table.res_slots, *a.shape), a.dtype) for a in res]
        if table.split:  # each B's stash, kept in its slot until its W
            zeros_res = [jnp.zeros(a.shape, a.dtype) for a in res] if store else []
            stash = jax.eval_shape(lambda t: input_and_stash(carry, t, lambda _: zeros_res)[2],
                                   t0)
            carry["stash"] = [jnp.zeros((table.w_slots, *a.shape), a.dtype) for a in stash]
        carry = jax.lax.fori_loop(0, table.ticks, tick, carry)
        g_ends = send_back((carry["g_first"], carry["g_last"], carry["g_shared"]))
        g_stage = jax.tree.map(lambda g: g[None], carry["g_stage"])
        # Every rank's share (the loss from the last stage, each stage's auxiliary terms), summed;
        # per-chunk metrics stay with their rank, [1, v, ...], in the pipeline layout.
        scalars, per_chunk = carry["metrics"]
        loss, scalars = jax.lax.psum((carry["loss"], scalars), (AXIS, *replicas))
        if replicas:
            per_chunk = jax.lax.psum(per_chunk, replicas)
        per_chunk = jax.tree.map(lambda a: a[None], per_chunk)
        # Unreduced over the replicas: a leading [1] per replica, summed after the map.
        unreduced = jax.tree.map(lambda g: g[None], (g_ends, g_stage))
        return (loss, scalars, per_chunk), unreduced if replicas else (g_ends, g_stage)

    def value_and_grad(first_s, last_s, shared_s, stage_p, active, inputs_M, targets_M):
        replicas = plan.replicas()

        def run(*args):
            with plan.manual(replicas):
                return body(replicas, *args)

        grads_spec = PartitionSpec(replicas, AXIS) if replicas else PartitionSpec(AXIS)
        out_specs = ((PartitionSpec(), PartitionSpec(), PartitionSpec(AXIS)), grads_spec)
        mapped = plan.shard_map(run, replicas, out_specs)
        (loss, scalars, per_chunk), (g_ends, g_stage) = mapped(
            first_s, last_s, shared_s, stage_p, active, inputs_M, targets_M)
        if replicas:  # the data-parallel reduction, once per step
            g_ends, g_stage = jax.tree.map(lambda g: g.sum(0), (g_ends, g_stage))
        g_first, g_last, g_shared = g_ends
        return (loss, {**scalars, **per_chunk}), (g_first, g_last, g_shared, g_stage)

    return value_and_grad


def pipeline_loss(table: Table, mesh: Mesh, first_fn: Callable, stage_fn: Callable,
                  last_fn: Callable):
    """Build fn(first_s, last_s, shared_s, stage_p, active, inputs_M, targets_M) -> mean loss,
    running a forward-only `table` (see `pipeline_value_and_grad` for the arguments)."""
    plan = Plan(table, mesh, first_fn, stage_fn, last_fn)
    m = plan.m
    tabs = plan.tabs

    def body(replicas, first_s, last_s, shared_s, stage_p, active, inputs, targets):
        me = jax.lax.axis_index(AXIS)
        stage_p = jax.tree.map(lambda a: a[0], stage_p)
        active = active[0]
        first_p, last_p, shared_p = plan.ends(first_s, last_s, shared_s, me)
        x_shape = jax.eval_shape(first_fn, first_p, shared_p, microbatch(inputs, 0))
        zeros_x = jnp.zeros(x_shape.shape, x_shape.dtype)

        def idle(carry, t):
            return carry, zeros_x

        def forward(carry, t):
            micro, chunk = tabs["microbatch"][t, me], tabs["chunk"][t, me]
            x_in = carry["acts"][tabs["act_slot"][t, me]]
            chunk_p, chunk_active = plan.chunk(stage_p, active, chunk)
            (y, _), metrics = plan.composite(me, inputs, targets, micro, chunk, chunk_active,
                                             first_p, shared_p, chunk_p, last_p, x_in)
            is_last = plan.stage_of(chunk, me) == plan.last_stage
            return (dict(carry, loss=carry["loss"] + metrics["loss"] / m),
                    jnp.where(is_last, zeros_x, y))

        def tick(t, carry):
            carry, send = jax.lax.switch(tabs["kind"][t, me], (idle, forward), carry, t)
            return dict(carry, **plan.exchange(t, me, send, {"acts": carry["acts"]}))

        carry = {"acts": jnp.zeros((table.act_slots + 1, *x_shape.shape), x_shape.dtype),
                 "loss": jnp.zeros((), jnp.float32)}
        carry = jax.lax.fori_loop(0, table.ticks, tick, carry)
        loss = jax.lax.psum(carry["loss"], AXIS)
        return jax.lax.pmean(loss, replicas) if replicas else loss

    def loss_fn(first_s, last_s, shared_s, stage_p, active, inputs_M, targets_M):
        replicas = plan.replicas()

        def run(*args):
            with plan.manual(replicas):
                return body(replicas, *args)

        return plan.shard_map(run, replicas, PartitionSpec())(
            first_s, last_s, shared_s, stage_p, active, inputs_M, targets_M)

    return loss_fn
