"""The communication counter against closed-form collectives, and the data-parallel promises
measured with it on the compiled train step: one gradient reduction per step under gradient
accumulation, and a reduce-scatter (not an all-reduce) under ZeRO-2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtron.sharding.collectives import _replica_groups, count_collectives
from jaxtron.training.trainer import Trainer

from conftest import make_config

N = 8
ROWS, COLS = 64, 32  # fp32 [64, 32]: 8 KiB
S = ROWS * COLS * 4


def mesh_2x4():
    return jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)


def compiled_traffic(body, mesh, in_spec, out_spec, trips=1):
    """count_collectives of `body` run `trips` times in a fori_loop inside a shard_map."""
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                           check_vma=False)

    def f(x):
        return jax.lax.fori_loop(0, trips, lambda i, y: mapped(y) * 0.5, x)

    x = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32, sharding=NamedSharding(mesh, in_spec))
    compiled = jax.jit(f).lower(x).compile()
    return count_collectives(compiled.as_text(), mesh)


@pytest.mark.parametrize("trips", [1, 3])
def test_all_reduce_over_one_axis_counts_each_loop_trip(trips):
    mesh = mesh_2x4()
    traffic = compiled_traffic(lambda x: jax.lax.psum(x, "tensor"), mesh, P(), P(), trips)
    assert traffic.count("all-reduce", ("tensor",)) == trips
    assert traffic.sent("all-reduce", ("tensor",)) == pytest.approx(2 * S * 3 / 4 * trips)
    assert traffic.sent(axes=("data",)) == 0


def test_all_gather_reduce_scatter_permute_and_all_to_all_match_ring_formulas():
    mesh = mesh_2x4()
    local = S // 4  # each tensor rank's block of a [64, 32] array split 4 ways

    gather = compiled_traffic(lambda x: jax.lax.all_gather(x, "tensor", tiled=True)[:16],
                              mesh, P("tensor"), P("tensor"))
    assert gather.sent("all-gather", ("tensor",)) == pytest.approx(S * 3 / 4)

    scatter = compiled_traffic(
        lambda x: jnp.tile(jax.lax.psum_scatter(x, "data", tiled=True), (2, 1)), mesh, P(),
        P())
    assert scatter.sent("reduce-scatter", ("data",)) == pytest.approx(S / 2)

    permute = compiled_traffic(
        lambda x: jax.lax.ppermute(x, "tensor", [(i, (i + 1) % 4) for i in range(4)]), mesh,
        P("tensor"), P("tensor"))
    assert permute.sent("collective-permute", ("tensor",)) == pytest.approx(local)

    exchange = compiled_traffic(
        lambda x: jax.lax.all_to_all(x, "tensor", 1, 0, tiled=True).reshape(x.shape), mesh,
        P("tensor"), P("tensor"))
    assert exchange.sent("all-to-all", ("tensor",)) == pytest.approx(local * 3 / 4)


def test_replica_group_formats_name_the_same_groups():
    expected = [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _replica_groups("{{0,4},{1,5},{2,6},{3,7}}", N) == expected
    assert _replica_groups("[4,2]<=[2,4]T(1,0)", N) == expected
    assert _replica_groups("mesh['a'=2,'b'=4] {'a'}", N) == expected
    assert _replica_groups("mesh['a'=2,'b'=4]", N) == [list(range(N))]
    # the mesh's devices in another order: [0, 4, 1, 5, ...] laid out as a=4 x b=2
    assert _replica_groups("mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'b'}", N) == expected
    assert _replica_groups("mesh['a'=4,'b'=2], device_ids=(0,4,1,5,2,6,3,7) {'b'}",
                           N) == expected


def step_traffic(overrides):
    config = make_config(overrides, train={"batch_size": 32})
    trainer = Trainer(config)
    compiled = trainer.compile_step(trainer.abstract_state(), trainer.abstract_batch())
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_state()
                                                                    .params))
    return count_collectives(compiled.as_text(), trainer.mesh), params


@pytest.mark.parametrize("mesh", [{"mesh.data": N}, {"mesh.data": 4, "mesh.sequence": 2},
                                  {"mesh.data": 4, "mesh.tensor": 2}])
def test_gradient_accumulation_reduces_gradients_once_per_step(mesh):
    once, params = step_traffic(mesh)
    accumulated, _ = step_traffic({**mesh, "optim.grad_accum": 4})
    n = mesh["mesh.data"]
    per_device = params / mesh.get("mesh.tensor", 1)  # norms replicated: within 5%
    ring = 2 * per_device * (n - 1) / n
    assert once.sent("all-reduce", ("data",)) == pytest.approx(ring, rel=0.05)
    np.testing.assert_allclose(accumulated.sent("all-reduce", ("data",)),
                               once.sent("all-reduce", ("data",)), rtol=0.1)


def test_zero2_reduce_scatters_gradients_instead_of_all_reducing_them():
    traffic, params = step_traffic({"mesh.data": N, "optim.zero_stage": 2,
                                    "optim.grad_accum": 2})
    assert traffic.sent("all-reduce", ("data",)) < 0.01 * params  # only scalar metrics
    # gradients reduce-scattered, parameters all-gathered after the sharded update
    assert traffic.sent("reduce-scatter", ("data",)) == pytest.approx(params * (N - 1) / N,
                                                                      rel=0.02)
    assert traffic.sent("all-gather", ("data",)) == pytest.approx(params * (N - 1) / N,
                                                                  rel=0.02)


def test_expert_parallelism_moves_only_the_dispatched_slots():
    """data=2 x expert=4: each device starts the expert all-to-all from the rows it holds, so
    the only MoE traffic is 4 all-to-alls per layer (dispatch and combine, forward and
    backward) of its [B, E, C, D] slots: nothing re-lays or gathers the batch."""
    layers, experts, top_k, factor, seq, batch, d = 2, 4, 2, 1.25, 32, 32, 64
    config = make_config({"mesh.data": 2, "mesh.expert": 4}, train={"batch_size": batch},
                         moe={"num_experts": experts, "top_k": top_k,
                              "capacity_factor": factor})
    trainer = Trainer(config)
    compiled = trainer.compile_step(trainer.abstract_state(), trainer.abstract_batch())
    traffic = count_collectives(compiled.as_text(), trainer.mesh)
    slots = int(np.ceil(factor * seq * top_k / experts))
    dispatched = 4 * (batch // 8) * experts * slots * d  # fp32 [B/8, E, C, D]
    assert traffic.sent("all-to-all", ("expert",)) == pytest.approx(
        4 * layers * dispatched * 3 / 4)
    assert traffic.count("collective-permute") == 0
    assert traffic.sent("all-gather") == 0
