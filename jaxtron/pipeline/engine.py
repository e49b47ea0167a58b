"""Run a tick table inside one `shard_map` over the `stage` axis: forward and backward
interleave in a single compiled loop, so 1F1B really holds at most ~p activations per rank.

Every tick each rank looks up its action in the table, runs it under `lax.switch`, then all
ranks call the same two collectives: `ppermute` of the forward output to rank d + 1 and of the
input gradient to rank d - 1 (idle ranks send zeros; the ring wrap-around carries interleaved
chunks from the last rank back to the first). A forward stores nothing but the received input
activation, in a slot the table assigned; the backward recomputes the stage from that input
under `jax.vjp` and adds the weight gradients to accumulators in the loop carry. The first
virtual stage embeds the microbatch's tokens and the last computes its loss, so embedding and
head gradients come out of the same loop.

Only `stage` is manual: data, fsdp and tensor sharding inside a stage stay automatic.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxtron.pipeline.schedule import Table

AXIS = "stage"


def pipeline_value_and_grad(table: Table, mesh: Mesh, first_fn: Callable, stage_fn: Callable,
                            last_fn: Callable):
    """Build fn(first_p, stage_p, last_p, active, inputs_M, targets_M) -> (loss, grads).

    first_fn(first_p, inputs) -> x; stage_fn(chunk_p, chunk_active, x) -> x;
    last_fn(last_p, x, targets) -> mean loss of the microbatch. stage_p and active carry a
    leading [p, v, ...] pipeline layout; the loss is the mean over microbatches.
    """
    p, v, m = table.stages, table.virtual, table.microbatches
    last_stage = p * v - 1
    tabs = {name: jnp.asarray(getattr(table, name)) for name in
            ("kind", "microbatch", "chunk", "act_slot", "grad_slot", "recv_act", "recv_grad")}
    forward_ring = [(d, (d + 1) % p) for d in range(p)]
    backward_ring = [(d, (d - 1) % p) for d in range(p)]

    def body(first_p, stage_p, last_p, active, inputs, targets):
        me = jax.lax.axis_index(AXIS)
        stage_p = jax.tree.map(lambda a: a[0], stage_p)  # [v, Lmax, ...] of this rank
        active = active[0]
        x_shape = jax.eval_shape(first_fn, first_p, inputs[0])
        zeros_x = jnp.zeros(x_shape.shape, x_shape.dtype)

        def composite(fp, chunk_p, lp, x_in, micro, chunk):
            virtual_stage = chunk * p + me
            x = jax.lax.cond(virtual_stage == 0, lambda: first_fn(fp, inputs[micro]),
                             lambda: x_in)
            y = stage_fn(chunk_p, active[chunk], x)
            loss = jax.lax.cond(virtual_stage == last_stage,
                                lambda: last_fn(lp, y, targets[micro]).astype(jnp.float32),
                                lambda: jnp.zeros((), jnp.float32))
            return y, loss

        def chunk_params(chunk):
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, chunk, 0, False),
                                stage_p)

        def idle(carry, t):
            return carry, zeros_x, zeros_x

        def forward(carry, t):
            micro, chunk = tabs["microbatch"][t, me], tabs["chunk"][t, me]
            x_in = carry["acts"][tabs["act_slot"][t, me]]
            y, loss = composite(first_p, chunk_params(chunk), last_p, x_in, micro, chunk)
            carry = dict(carry, loss=carry["loss"] + loss / m)
            is_last = chunk * p + me == last_stage
            return carry, jnp.where(is_last, zeros_x, y), zeros_x

        def backward(carry, t):
            micro, chunk = tabs["microbatch"][t, me], tabs["chunk"][t, me]
            x_in = carry["acts"][tabs["act_slot"][t, me]]
            is_last = chunk * p + me == last_stage
            dy = jnp.where(is_last, zeros_x, carry["grads_in"][tabs["grad_slot"][t, me]])
            dloss = jnp.where(is_last, 1.0 / m, 0.0).astype(jnp.float32)
            _, vjp = jax.vjp(lambda fp, cp, lp, x: composite(fp, cp, lp, x, micro, chunk),
                             first_p, chunk_params(chunk), last_p, x_in)
            g_first, g_chunk, g_last, dx = vjp((dy, dloss))
            carry = dict(
                carry,
                g_first=jax.tree.map(jnp.add, carry["g_first"], g_first),
                g_last=jax.tree.map(jnp.add, carry["g_last"], g_last),
                g_stage=jax.tree.map(lambda acc, g: acc.at[chunk].add(g), carry["g_stage"],
                                     g_chunk))
            is_first = chunk * p + me == 0
            return carry, zeros_x, jnp.where(is_first, zeros_x, dx)

        def tick(t, carry):
            carry, send_fwd, send_bwd = jax.lax.switch(tabs["kind"][t, me],
                                                       (idle, forward, backward), carry, t)
            got_fwd = jax.lax.ppermute(send_fwd, AXIS, forward_ring)
            got_bwd = jax.lax.ppermute(send_bwd, AXIS, backward_ring)
            return dict(carry, acts=carry["acts"].at[tabs["recv_act"][t, me]].set(got_fwd),
                        grads_in=carry["grads_in"].at[tabs["recv_grad"][t, me]].set(got_bwd))

        carry = {
            "acts": jnp.zeros((table.act_slots + 1, *x_shape.shape), x_shape.dtype),
            "grads_in": jnp.zeros((table.grad_slots + 1, *x_shape.shape), x_shape.dtype),
            "loss": jnp.zeros((), jnp.float32),
            "g_first": jax.tree.map(jnp.zeros_like, first_p),
            "g_stage": jax.tree.map(jnp.zeros_like, stage_p),
            "g_last": jax.tree.map(jnp.zeros_like, last_p),
        }
        carry = jax.lax.fori_loop(0, table.ticks, tick, carry)
        total = lambda tree: jax.lax.psum(tree, AXIS)  # noqa: E731 (only one rank is non-zero)
        return (total(carry["loss"]), total(carry["g_first"]),
                jax.tree.map(lambda g: g[None], carry["g_stage"]), total(carry["g_last"]))

    staged, replicated = PartitionSpec(AXIS), PartitionSpec()
    mapped = jax.shard_map(body, mesh=mesh, axis_names={AXIS}, check_vma=False,
                           in_specs=(replicated, staged, replicated, staged, replicated,
                                     replicated),
                           out_specs=(replicated, replicated, staged, replicated))

    def value_and_grad(first_p, stage_p, last_p, active, inputs_M, targets_M):
        loss, g_first, g_stage, g_last = mapped(first_p, stage_p, last_p, active, inputs_M,
                                                targets_M)
        return loss, (g_first, g_stage, g_last)

    return value_and_grad
