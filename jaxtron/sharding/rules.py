"""Logical axis names -> mesh axes: one table for parameters, one for activations.

In scaling-book notation the defaults are

    W_q[D_fsdp, H_tensor, K]   W_o[H_tensor, K, D_fsdp]   W_in[D_fsdp, F_tensor]
    W_out[F_tensor, D_fsdp]    E[V_tensor, D_fsdp]         x[B_(data,fsdp,expert), L_sequence, D]   W_experts[E_expert, D_fsdp, F_tensor]

so `fsdp` shards every weight (ZeRO-3: GSPMD gathers each layer's weights just before use and
reduce-scatters its gradients), `tensor` gives Megatron's column-then-row split with one reduction
per block, and the batch is split over both data axes and the expert axis (outside the
experts, expert-parallel ranks are data-parallel ranks). There are no fallbacks that depend on
order: every name has exactly one rule, checked when the rules are built.

Multi-head latent attention (`models/mla.py`) adds one name, `latent`, never split:
W_dkv[D_fsdp, latent] and W_ukv[latent, H_tensor, K], so every tensor rank computes the small
shared latent and decompresses only its own heads.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtron.config.schema import Config
from jaxtron.errors import ConfigError

LOGICAL_AXES = ("batch", "seq", "residual_seq", "embed", "heads", "kv_heads", "head_dim", "mlp",
                "vocab", "expert", "layers", "stage", "latent")

Rules = dict[str, tuple[str, ...]]


def param_rules(config: Config) -> Rules:
    del config  # the same placement serves every layout; absent mesh axes have size 1
    return {"batch": (), "seq": (), "residual_seq": (), "embed": ("fsdp",),
            "heads": ("tensor",), "kv_heads": ("tensor",), "head_dim": (), "mlp": ("tensor",),
            "vocab": ("tensor",), "expert": ("expert",), "layers": (), "stage": ("stage",),
            "latent": ()}


def optimizer_rules(config: Config) -> Rules:
    """Adam moments: like their parameters, plus ZeRO-1/2 sharding of `embed` over `data`."""
    rules = param_rules(config)
    if config.optim.zero_stage >= 1:
        rules["embed"] = ("fsdp", "data")
    return rules


def activation_rules(config: Config) -> Rules:
    """`residual_seq` is the sequence axis outside tensor-parallel regions (residual stream,
    norms): Megatron sequence parallelism shards it over `tensor` too, which turns each block's
    all-reduce into a reduce-scatter after the row-parallel matmul and an all-gather before the
    next column-parallel one."""
    sp = ("tensor",) if config.mesh.sequence_parallel else ()
    return {"batch": ("data", "fsdp", "expert"), "seq": ("sequence",),
            "residual_seq": ("sequence", *sp),
            "embed": (), "heads": ("tensor",), "kv_heads": ("tensor",), "head_dim": (),
            "mlp": ("tensor",), "vocab": ("tensor",), "expert": ("expert",), "layers": (),
            "stage": ("stage",), "latent": ()}


# Logical axes that fall back to replication when their size does not divide the mesh axes:
# grouped-query attention with fewer kv heads than the tensor degree keeps whole kv heads on
# every tensor rank (Megatron does the same). Any other mismatch is a config error.
REPLICATE_IF_INDIVISIBLE = frozenset({"kv_heads"})


def check_rules(rules: Rules) -> None:
    missing = [name for name in LOGICAL_AXES if name not in rules]
    unknown = [name for name in rules if name not in LOGICAL_AXES]
    if missing or unknown:
        raise ConfigError(f"sharding rules must cover exactly the logical axes {LOGICAL_AXES}; "
                          f"missing {missing}, unknown {unknown}.")


def spec_for(names: Sequence[str | None], rules: Rules, mesh: Mesh,
             shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry `names` (None = replicated)."""
    used: dict[str, str] = {}
    entries = []
    for dim, name in enumerate(names):
        if name is None:
            entries.append(None)
            continue
        if name not in rules:
            raise ConfigError(f"logical axis {name!r} has no sharding rule; known axes are "
                              f"{', '.join(LOGICAL_AXES)}; use one of them in the parameter's "
                              "axis names.")
        axes = tuple(a for a in rules[name] if mesh.shape.get(a, 1) > 1)
        for axis in axes:
            if axis in used:
                raise ConfigError(f"mesh axis {axis!r} would shard both {used[axis]!r} and "
                                  f"{name!r} of one array; change the sharding rules so each "
                                  "mesh axis appears once per array.")
            used[axis] = name
        if shape is not None and axes:
            size = math.prod(mesh.shape[a] for a in axes)
            if shape[dim] % size:
                if name in REPLICATE_IF_INDIVISIBLE:
                    entries.append(None)
                    continue
                raise ConfigError(f"dimension {name!r} of size {shape[dim]} cannot be split "
                                  f"{size} ways over mesh axes {axes}; choose mesh degrees that "
                                  f"divide it (see the model.* size behind {name!r}).")
        entries.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*entries)


def logical_names(variable: nnx.Variable) -> tuple[str | None, ...]:
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names is not None else (None,) * len(variable.shape)


def variable_shardings(tree, rules: Rules, mesh: Mesh):
    """NamedSharding for every nnx.Variable in `tree` (params, or optimizer moments that keep the
    parameters' metadata); any other array leaf is replicated."""

    def one(leaf):
        if isinstance(leaf, nnx.Variable):
            if not hasattr(leaf.get_value(), "shape"):  # a masked-out entry (optax.partition)
                return leaf
            spec = spec_for(logical_names(leaf), rules, mesh, leaf.shape)
            return leaf.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


# ---------------------------------------------------------------------------------------------
# Activation constraints. Models call `constrain(x, names)`; it is the identity unless a train
# step is being traced inside `activation_sharding(...)`, so models stay free of mesh code.

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "jaxtron_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules) -> Iterator[None]:
    check_rules(rules)
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def without_mesh_axis(axis: str) -> Iterator[None]:
    """Inside a shard_map that makes `axis` manual, constraints must not name it again: the
    arrays there are already one rank's part along it."""
    active = _ACTIVE.get()
    if active is None:
        yield
        return
    mesh, rules = active
    token = _ACTIVE.set((mesh, {name: tuple(a for a in axes if a != axis)
                                for name, axes in rules.items()}))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_mesh() -> Mesh | None:
    """The mesh of the step being traced, for kernels that shard_map over it."""
    active = _ACTIVE.get()
    return active[0] if active else None


def manual_axes() -> set[str]:
    """Mesh axes an enclosing shard_map has made manual already (none outside one)."""
    context = jax.sharding.get_abstract_mesh()
    return set() if context.empty else set(context.manual_axes)


# Mesh axes the batch may be split over: inside a shard_map that makes some of them manual (the
# data-parallel reduction, the pipeline's replicas), each rank sees only its own rows.
BATCH_MESH_AXES = ("data", "fsdp", "expert")


def mean_over_batch_shards(x: jax.Array) -> jax.Array:
    """`x` (a mean over this rank's rows) averaged over the ranks holding the other rows of the
    batch where an enclosing shard_map made batch axes manual: the mean over the whole batch.
    Elsewhere GSPMD already computes batch-wide means, and `x` is returned as it is."""
    axes = tuple(a for a in BATCH_MESH_AXES if a in manual_axes())
    return jax.lax.pmean(x, axes) if axes else x


def shard_map_mesh(mesh: Mesh):
    """The mesh to give a shard_map: inside another shard_map (the data-parallel reduction's
    over `data`, the pipeline's over `stage`) JAX wants the context mesh, whose axes record
    which of them are manual already."""
    context = jax.sharding.get_abstract_mesh()
    return mesh if context.empty else context


def active_spec(names: Sequence[str | None], shape=None) -> PartitionSpec | None:
    active = _ACTIVE.get()
    return spec_for(names, active[1], active[0], shape) if active else None


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = spec_for(names, rules, mesh, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
