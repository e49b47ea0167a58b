"""Pallas flash attention (interpret mode on CPU) against the references, forward and backward;
with fewer queries than keys, against the numpy oracle of `attention_oracle.py`."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_kernels import naive_attention

from jaxtron.data.pipeline import open_dataset, train_batches
from jaxtron.kernels.attention import attention
from jaxtron.kernels.flash import flash_attention
from jaxtron.kernels.flash_backward import Tiling, k_block_end, q_block_start
from jaxtron.sharding.mesh import build_mesh
from jaxtron.sharding.rules import activation_rules, activation_sharding
from jaxtron.training.trainer import Trainer

from attention_oracle import assert_bottom_right_not_top_left, reference_attention
from conftest import make_config


def inputs(heads=4, kv_heads=2, length=32, kv_length=None, batch=2, dim=8, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 4)
    kv_shape = (batch, kv_length or length, kv_heads, dim)
    q = jax.random.normal(ks[0], (batch, length, heads, dim)).astype(dtype)
    k = jax.random.normal(ks[1], kv_shape).astype(dtype)
    v = jax.random.normal(ks[2], kv_shape).astype(dtype)
    return q, k, v, jax.random.normal(ks[3], q.shape)


def packed(batch, length):
    """Two rows of documents: boundaries inside a block, on a block edge, in the padded last
    block, and a one-token document at the end."""
    cuts = [(5, 16, length - 3), (length // 2, length - 1, length)]
    positions = np.arange(length)
    return jnp.asarray([np.searchsorted(c, positions, side="right") for c in cuts][:batch],
                       jnp.int32)


def output_and_grads(fn, q, k, v, cotangent):
    """One jitted pass giving the output and d(sum(out * cotangent))/d(q, k, v)."""
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def check(q, k, v, cotangent, *, causal, segment_ids=None, tol=1e-5, window=None, **blocks):
    got = output_and_grads(lambda *a: flash_attention(*a, causal=causal, segment_ids=segment_ids,
                                                      window=window, **blocks),
                           q, k, v, cotangent)
    # The reference sees fp32 copies of the same (possibly bf16-rounded) inputs: the comparison
    # then measures only the kernel's own rounding.
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = output_and_grads(lambda *a: reference_attention(*a, causal=causal,
                                                           segment_ids=segment_ids,
                                                           window=window), *f32, cotangent)
    assert got[0].dtype == q.dtype
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1])):
        assert g.shape == w.shape, name
        scale = float(jnp.abs(w).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=tol, atol=tol * scale,
                                   err_msg=name)
    return got[0]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # H/G = 1, 2, 4
def test_matches_reference_fp32(causal, kv_heads):
    q, k, v, cotangent = inputs(kv_heads=kv_heads)
    out = check(q, k, v, cotangent, causal=causal)
    # And against textbook attention on explicitly repeated k/v, independent of any GQA fold.
    np.testing.assert_allclose(out, naive_attention(q, k, v, causal), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_and_odd_length(causal):
    # 40 = 2.5 blocks of 16: the wrapper pads to 48 and the kernels mask the padded keys.
    q, k, v, cotangent = inputs(length=40)
    check(q, k, v, cotangent, causal=causal, segment_ids=packed(2, 40))


def test_odd_length_without_segments_and_unequal_blocks():
    # Diagonal key blocks that span two query blocks (the next test has the converse).
    q, k, v, cotangent = inputs(length=40, kv_heads=1)
    check(q, k, v, cotangent, causal=True, block_q=8, block_k=16)


def test_fewer_queries_than_keys_is_bottom_right_causal():
    # Query blocks that span several key blocks, one of them half padding.
    q, k, v, cotangent = inputs(length=16, kv_length=40)
    flash = functools.partial(flash_attention, causal=True, block_q=16, block_k=8)
    got = output_and_grads(flash, q, k, v, cotangent)
    assert_bottom_right_not_top_left(got, q, k, v, cotangent)


def test_shapes_it_cannot_serve_are_refused():
    q, k, v, _ = inputs(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="G dividing H"):
        flash_attention(q, k, v, causal=False)
    q, k, v, _ = inputs(length=40, kv_length=16)
    with pytest.raises(ValueError, match="no key to attend to"):
        flash_attention(q, k, v, causal=True)


@pytest.mark.parametrize("causal,segments", [(True, False), (False, True)])
def test_matches_reference_bf16(causal, segments):
    # bf16 keeps 8 significant bits, so each rounding costs up to 2^-8 ~ 0.4% relative. The
    # kernel rounds p to bf16 before p @ v (and ds before ds @ k, ds^T @ q) and the output once
    # more, as cuDNN and the reference itself do; a few such roundings stay within 5 * 2^-8 ~ 2%
    # of the largest entry. (The fp32 accumulators keep errors from growing with the length.)
    q, k, v, cotangent = inputs(length=40, dim=16, dtype=jnp.bfloat16)
    check(q, k, v, cotangent, causal=causal, tol=2e-2,
          segment_ids=packed(2, 40) if segments else None)


def test_causal_loops_stop_at_the_diagonal_block():
    t = Tiling(block_q=16, block_k=8, q_len=64, kv_len=64, q_padded=64, kv_padded=64,
               causal=True, segments=False, scale=1.0, interpret=True)
    # Query block i (rows 16i..16i+15) needs key blocks 0..2i+1; key block j starts at row 8j.
    assert [int(k_block_end(t, i)) for i in range(4)] == [2, 4, 6, 8]
    assert [int(q_block_start(t, j)) for j in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert k_block_end(dataclasses.replace(t, causal=False), 0) == 8


def test_dispatch_and_jit_free_call():
    q, k, v, _ = inputs(length=16)
    np.testing.assert_allclose(attention(q, k, v, causal=True, impl="pallas"),
                               reference_attention(q, k, v, causal=True), rtol=1e-5, atol=1e-5)


def test_training_with_pallas_matches_xla():
    def trainer(impl):
        # warmup 1 with lr 1e-2: step 0 has lr 0, so 3 steps give 2 updates the losses can see.
        return Trainer(make_config({"model.attention_impl": impl, "mesh.data": 1,
                                    "train.batch_size": 2, "optim.warmup_steps": 1,
                                    "optim.lr": 1e-2}), devices=jax.devices()[:1])

    def train(trainer, state):
        batches = train_batches(trainer.config, open_dataset(trainer.config))
        losses = []
        for _ in range(3):
            state, metrics = trainer.step(state, trainer.put_batch(next(batches)))
            losses.append(float(metrics["loss"]))
        return losses, jax.device_get(nnx.to_pure_dict(state.params))

    xla, pallas = trainer("xla"), trainer("pallas")
    state = xla.init_state()  # the impl does not change the parameters: initialise once
    got_losses, got_params = train(pallas, jax.tree.map(jnp.copy, state))  # step donates
    want_losses, want_params = train(xla, state)
    assert len(set(want_losses)) == 3, want_losses  # the updates did change the loss
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, layout", [
    (4, 2, {"mesh.data": 2, "mesh.tensor": 2}),  # kv heads split with their query heads
    (4, 1, {"mesh.data": 2, "mesh.tensor": 2}),  # kv < tensor: the one kv head replicated
    (6, 3, {"mesh.data": 2, "mesh.tensor": 2}),  # kv replicated; rank 1: heads 3-5 -> kv 1, 2, 2
    (8, 2, {"mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 4}),  # rank 2: heads 4, 5 -> kv 1
])
def test_pallas_under_a_mesh_runs_per_shard_and_matches_reference(heads, kv_heads, layout):
    """On a mesh, impl="pallas" runs the kernel inside a shard_map (a Pallas call has no SPMD
    rule), and with grouped-query attention each rank's query heads still read their own kv
    heads, in value and gradient."""
    q, k, v, cotangent = inputs(heads=heads, kv_heads=kv_heads, length=40)
    segments = packed(2, 40)
    config = make_config(layout)
    size = config.mesh.data * config.mesh.fsdp * config.mesh.tensor
    mesh = build_mesh(config.mesh, jax.devices()[:size])
    with activation_sharding(mesh, activation_rules(config)):
        fn = lambda *a: attention(*a, causal=True, segment_ids=segments, impl="pallas")  # noqa
        assert "shard_map" in str(jax.make_jaxpr(fn)(q, k, v))
        got = output_and_grads(fn, q, k, v, cotangent)
    want = output_and_grads(lambda *a: reference_attention(*a, causal=True,
                                                           segment_ids=segments),
                            q, k, v, cotangent)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1])):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max()),
                                   err_msg=name)
