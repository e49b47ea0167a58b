"""One gradient reduction per step over the `data` axis, whatever happens inside the step.

Under GSPMD the gradient of each microbatch is reduced as soon as it exists: with
`optim.grad_accum = A` the data-parallel all-reduce runs A times per step, and ZeRO-2's
"reduce-scatter" is an all-reduce followed by a slice on backends without XLA's reduce-scatter
rewrite (CPU). Here `data` becomes a manual axis: each data-parallel rank computes the sum of
its own microbatches' gradients (`grad_fn` sees only its rows; fsdp, tensor, sequence, expert
and stage stay automatic or are mapped by the kernels inside), and then the ranks combine them
once, the way Megatron-LM's DDP buckets do after the last microbatch:

    ZeRO 0/1   psum over data            (all-reduce, 2 S (n-1)/n sent per device)
    ZeRO-2     psum_scatter over data    (reduce-scatter, S (n-1)/n), each rank keeping the
               slice of every gradient its optimizer-state shard updates

The reduce-scatter runs in a fully manual shard_map on each device's own (fsdp, tensor) block
of the unreduced gradients: inside a region where only `data` is manual, XLA's partitioner
would replicate the operand over the automatic axes first (measured: 4x the bytes on
data=2 x fsdp=2 x tensor=2). Scattering the local block of `W[D_fsdp, ...]` gives data rank j
the j-th part of it, which is the optimizer rules' layout `W[D_(fsdp,data), ...]`, so nothing
moves again before the update.

The objective is a mean over equal shards, so the mean of the ranks' means is the global mean
and the gradients equal the unsharded ones.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtron.kernels import fp8
from jaxtron.sharding.rules import without_mesh_axis

AXIS = "data"


def _leaves(shardings) -> list[NamedSharding]:
    return jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


def _scatter_dim(sharding: NamedSharding) -> int | None:
    """The dimension the optimizer state splits over `data`, if any."""
    for dim, entry in enumerate(sharding.spec):
        if AXIS in ((entry,) if isinstance(entry, str) else tuple(entry or ())):
            return dim
    return None


def _manual_scatter(mesh: Mesh, params: list, moments: list):
    """unreduced[n, *shape] leaves (n = data ranks) -> the sum over ranks, each rank keeping
    its optimizer shard: a fully manual shard_map, so every device reduce-scatters only its own
    (fsdp, tensor) block."""
    dims = [_scatter_dim(s) for s in moments]

    def body(*grads):
        return tuple(jax.lax.psum(g[0], AXIS) if dim is None else
                     jax.lax.psum_scatter(g[0], AXIS, scatter_dimension=dim, tiled=True)
                     for g, dim in zip(grads, dims))

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(PartitionSpec(AXIS, *s.spec)
                                                         for s in params),
                         out_specs=tuple(s.spec for s in moments), check_vma=False)


def _split_by_mesh(param: NamedSharding) -> bool:
    """Whether other mesh axes split this parameter (so its gradient does too)."""
    return any(entry is not None for entry in param.spec)


def reduce_once(grad_fn, mesh: Mesh, param_shardings, optimizer_shardings=None):
    """grad_fn(params, batch) -> ((objective, metrics), grads) run per data-parallel rank on
    its rows, reduced over `data` once. With `optimizer_shardings` (ZeRO-2) the gradients come
    back reduce-scattered like them: a gradient no other axis splits is scattered right where
    it is summed; one split over fsdp or tensor leaves the data-manual region unreduced, one
    [1, ...] block per rank, and is scattered in a fully manual shard_map."""
    n = mesh.shape[AXIS]
    # Delayed fp8 scaling's observed amaxes are reduced by max and never scattered.
    histories = [fp8.is_history(path) for path, _ in jax.tree_util.tree_flatten_with_path(
        param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))[0]]
    manual = []
    if optimizer_shardings is None:
        plans = [("max",) if history else ("all",) for history in histories]
    else:
        params, moments = _leaves(param_shardings), _leaves(optimizer_shardings)
        plans = [("max",) if history else ("all",) if _scatter_dim(o) is None else
                 ("manual",) if _split_by_mesh(p) else ("here", _scatter_dim(o))
                 for p, o, history in zip(params, moments, histories, strict=True)]
        manual = [i for i, plan in enumerate(plans) if plan[0] == "manual"]
        scatter = _manual_scatter(mesh, [params[i] for i in manual], [moments[i] for i in manual])

    def reduce(g, plan):
        if plan[0] == "max":
            return jax.lax.pmax(g, AXIS)
        if plan[0] == "all":
            return jax.lax.psum(g, AXIS) / n
        if plan[0] == "here":
            return jax.lax.psum_scatter(g, AXIS, scatter_dimension=plan[1], tiled=True) / n
        return g[None]  # unreduced: scattered outside

    def out_spec(plan):
        if plan[0] == "here":
            return PartitionSpec(*([None] * plan[1]), AXIS)
        return PartitionSpec(AXIS) if plan[0] == "manual" else PartitionSpec()

    def body(params, batch):
        with without_mesh_axis(AXIS):
            (objective, metrics), grads = grad_fn(params, batch)
        objective, metrics = jax.lax.pmean((objective, metrics), AXIS)
        leaves, treedef = jax.tree.flatten(grads)
        return (objective, metrics), treedef.unflatten(
            [reduce(g, plan) for g, plan in zip(leaves, plans, strict=True)])

    def fn(params, batch):
        specs = jax.tree.structure(params).unflatten([out_spec(p) for p in plans])
        mapped = jax.shard_map(body, mesh=mesh, axis_names={AXIS},
                               in_specs=(PartitionSpec(), PartitionSpec(AXIS)),
                               out_specs=(PartitionSpec(), specs), check_vma=False)
        out, grads = mapped(params, batch)
        if not manual:
            return out, grads
        leaves, treedef = jax.tree.flatten(grads)
        scattered = iter(scatter(*[leaves[i] for i in manual]))
        leaves = [next(scattered) / n if i in manual else g for i, g in enumerate(leaves)]
        return out, treedef.unflatten(leaves)

    return fn
