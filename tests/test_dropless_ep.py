"""Dropless expert parallelism by ragged all-to-all (jaxtron/kernels/dropless_experts.py).

The exchange's CPU form is checked against a numpy model of `jax.lax.ragged_all_to_all` written
from its docstring; the dispatch, with and without a receive bound, against numpy experts and a
numpy count of what the bound drops (whole layouts against one device: tests/test_moe.py); the
real collective by lowering for cuda and tpu, with buffers of the rows that are sent (T k), not
E x L slots.
"""

import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxtron.kernels.dropless_experts import dropless_expert_ffn, receive_rows
from jaxtron.kernels.ragged_exchange import dense_ragged_all_to_all
from jaxtron.training.trainer import Trainer

from conftest import make_config


def numpy_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets):
    """Rank s's slice j (rows input_offsets[s][j] .. + send_sizes[s][j]) lands on rank j at
    output_offsets[s][j]; every other output row keeps its value."""
    results = [np.array(o) for o in outputs]
    for s, operand in enumerate(operands):
        for j in range(len(operands)):
            start, size, at = input_offsets[s][j], send_sizes[s][j], output_offsets[s][j]
            results[j][at:at + size] = operand[start:start + size]
    return results


def test_the_dense_exchange_has_ragged_all_to_alls_semantics():
    rng = np.random.default_rng(0)
    n, rows, out_rows, width = 4, 10, 14, 3
    sizes = rng.integers(0, 3, (n, n))  # [source, destination]
    gaps = rng.integers(0, 2, (n, n))  # slices need not be packed, on either side
    input_offsets = np.cumsum(sizes + gaps, axis=1) - sizes
    output_offsets = np.cumsum(sizes + gaps, axis=0) - sizes
    assert (input_offsets + sizes <= rows).all() and (output_offsets + sizes <= out_rows).all()
    operands = rng.normal(size=(n, rows, width)).astype(np.float32)
    outputs = np.full((n, out_rows, width), -1.0, np.float32)
    want = numpy_ragged_all_to_all(operands, outputs, input_offsets, sizes, output_offsets)

    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])

    def per_rank(operand, output, ins, send, outs, recv):
        return dense_ragged_all_to_all(operand[0], output[0], ins[0], send[0], outs[0], recv[0],
                                       axis_name="x")[None]

    by_rank = NamedSharding(mesh, PartitionSpec("x"))
    args = [operands, outputs, *(np.asarray(a, np.int32) for a in (
        input_offsets, sizes, output_offsets, sizes.T))]
    got = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=PartitionSpec("x"),
                                out_specs=PartitionSpec("x")))(
        *(jax.device_put(a, by_rank) for a in args))
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))


def numpy_dispatch(experts_TxK, ranks, local, buffer):
    """Which assignments a bounded dispatch keeps, in the documented order: each rank sorts its
    assignments by expert (stable, token-major); a destination takes its sources in rank order,
    each source's block in that sorted order, until `buffer` rows are full."""
    per_rank = np.split(experts_TxK, ranks)  # the batch is split over the ranks
    kept = [np.zeros(e.shape, bool) for e in per_rank]
    filled = np.zeros(ranks, int)
    for s, experts in enumerate(per_rank):
        flat = experts.reshape(-1)
        for a in np.argsort(flat, kind="stable"):
            j = flat[a] // local
            if filled[j] < buffer:
                kept[s].reshape(-1)[a] = True
                filled[j] += 1
    return np.concatenate(kept)


def numpy_experts(x_TxD, experts_TxK, w_gate, w_up, w_down):
    """Every assignment's SwiGLU expert output, float64: [T, K, D]."""
    x, g, u, d = (np.asarray(a, np.float64) for a in (x_TxD, w_gate, w_up, w_down))
    gate = np.einsum("td,tkdf->tkf", x, g[experts_TxK])
    up = np.einsum("td,tkdf->tkf", x, u[experts_TxK])
    return np.einsum("tkf,tkfd->tkd", gate / (1 + np.exp(-gate)) * up, d[experts_TxK])


@pytest.mark.parametrize("buffer_factor", [None, 0.6])
def test_dispatch_computes_each_kept_assignment_and_drops_past_the_bound(buffer_factor):
    """8 ranks' worth of rows over data=2 x expert=4, 8 experts (2 per rank), top-2 of skewed
    choices, so that a bound of 0.6 x T k rows per rank drops on the busiest ranks."""
    config = make_config({"mesh.data": 2, "mesh.expert": 4}, moe={"num_experts": 8,
                                                                  "mode": "dropless"})
    trainer = Trainer(config)
    b, length, d, f, e, k = 8, 6, 16, 8, 8, 2
    rng = np.random.default_rng(1)
    x = rng.normal(size=(b, length, d)).astype(np.float32)
    experts = np.stack([rng.choice(e, k, replace=False, p=np.linspace(3, 1, e) / 16)
                        for _ in range(b * length)]).reshape(b, length, k).astype(np.int32)
    w_gate, w_up = (rng.normal(size=(e, d, f)).astype(np.float32) / 4 for _ in range(2))
    w_down = rng.normal(size=(e, f, d)).astype(np.float32) / 3
    rows = NamedSharding(trainer.mesh, PartitionSpec(("data", "expert")))
    by_expert = NamedSharding(trainer.mesh, PartitionSpec("expert"))
    with trainer._tracing():
        y, kept = jax.jit(lambda *a: dropless_expert_ffn(*a, buffer_factor=buffer_factor))(
            jax.device_put(x, rows), jax.device_put(experts, rows),
            *(jax.device_put(w, by_expert) for w in (w_gate, w_up, w_down)))
    # each data rank's 4 expert ranks (one sequence each) dispatch among themselves
    tokens = b * length // 8
    buffer = receive_rows(tokens, k, 4, e // 4, buffer_factor)
    want_kept = np.concatenate([numpy_dispatch(group, 4, e // 4, buffer)
                                for group in np.split(experts.reshape(-1, k), 2)])
    np.testing.assert_array_equal(np.asarray(kept).reshape(-1, k), want_kept)
    assert want_kept.all() == (buffer_factor is None)  # the bound of 0.6 did drop
    want = numpy_experts(x.reshape(-1, d), experts.reshape(-1, k), w_gate, w_up, w_down)
    want = np.where(want_kept[..., None], want, 0.0)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, k, d), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_step_lowers_with_ragged_all_to_all_and_buffers_of_the_sent_rows(platform):
    """The lowered step exchanges with the real collective, through receive buffers of
    factor x T k rows (T a rank's tokens), where the slot layout it replaces held E x L per
    sequence."""
    config = make_config({"mesh.data": 2, "mesh.expert": 4, "moe.ep_buffer_factor": 1.5},
                         moe={"num_experts": 8, "mode": "dropless"})
    text = Trainer(config, platform=platform).lower_step().as_text()
    assert text.count("ragged_all_to_all") >= 4  # 2 exchanges forward, 2 back, per layer
    assert text.count("chlo.ragged_dot") >= 9  # 3 grouped matmuls forward, 6 backward
    tokens = config.train.batch_size // 8 * config.data.seq_len
    want = receive_rows(tokens, config.moe.top_k, 4, 2, 1.5)
    assert want == int(1.5 * tokens * config.moe.top_k) < 8 * config.data.seq_len
    assert f"tensor<{want}x{config.model.d_model}x" in text
    # Plain all-to-alls carry only the backward's 4 offsets per rank, never the slot layout's
    # [B, E, L, D] rows.
    moved = re.findall(r'"stablehlo.all_to_all".*?: \((tensor<[^>]*>)\)', text)
    assert moved and set(moved) == {"tensor<4xi32>"}, set(moved)


def test_the_dry_run_reports_the_exchange_for_a_gpu(capsys):
    from jaxtron import train

    assert train.main(["--config", "configs/tiny.yaml", "--dry-run", "--target", "cuda",
                       "mesh.data=2", "mesh.expert=4", "moe.num_experts=8", "moe.top_k=2",
                       "moe.mode=dropless", "moe.ep_buffer_factor=1.5"]) == 0
    out = capsys.readouterr().out
    assert "dropless expert exchange: " in out and "ragged_all_to_all calls" in out
    sent = out.split("sent per device per step (planner's estimate): ")[1].splitlines()[0]
    assert "expert" in sent and "data" in sent
