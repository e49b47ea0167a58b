"""Attention implementations against independent references, forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxtron.kernels import attention
from jaxtron.kernels.reference import reference_attention
from jaxtron.kernels.ring import from_zigzag, ring_attention, to_zigzag


def naive_attention(q, k, v, causal):
    """Textbook softmax(q k^T / sqrt(d)) v with k/v heads repeated: independent of the GQA fold."""
    repeat = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    logits = jnp.einsum("blhk,bshk->bhls", q, k) / np.sqrt(q.shape[-1])
    if causal:
        length = q.shape[1]
        logits = jnp.where(np.tril(np.ones((length, length), bool)), logits, -np.inf)
    return jnp.einsum("bhls,bshk->blhk", jax.nn.softmax(logits, axis=-1), v)


def qkv(heads=4, kv_heads=2, length=32, batch=2, dim=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (batch, length, heads, dim)),
            jax.random.normal(ks[1], (batch, length, kv_heads, dim)),
            jax.random.normal(ks[2], (batch, length, kv_heads, dim)))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_reference_matches_naive_attention(causal, kv_heads):
    q, k, v = qkv(kv_heads=kv_heads)
    np.testing.assert_allclose(attention(q, k, v, causal=causal, impl="xla"),
                               naive_attention(q, k, v, causal), rtol=1e-5, atol=1e-5)


def test_segment_ids_block_attention_across_documents():
    q, k, v = qkv(length=16)
    segments = jnp.array([[0] * 6 + [1] * 10] * 2)
    out = reference_attention(q, k, v, causal=True, segment_ids=segments)
    second = reference_attention(q[:, 6:], k[:, 6:], v[:, 6:], causal=True)
    np.testing.assert_allclose(out[:, 6:], second, rtol=1e-5, atol=1e-6)


def test_zigzag_places_chunks_i_and_2n_minus_1_minus_i_together():
    x = jnp.arange(16)[None]
    np.testing.assert_array_equal(to_zigzag(x, 4)[0], [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10,
                                                       11, 6, 7, 8, 9])
    np.testing.assert_array_equal(from_zigzag(to_zigzag(x, 4), 4), x)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 4), (1, 8)])
def test_ring_attention_matches_reference_forward_and_backward(causal, shape):
    mesh = jax.make_mesh(shape, ("data", "sequence"), axis_types=(AxisType.Auto,) * 2)
    q, k, v = qkv()
    sharded = [jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", "sequence")))
               for x in (q, k, v)]

    def ring_loss(q, k, v):
        return jnp.sum(ring_attention(q, k, v, mesh=mesh, causal=causal) ** 2)

    def ref_loss(q, k, v):
        return jnp.sum(naive_attention(q, k, v, causal) ** 2)

    np.testing.assert_allclose(jax.jit(lambda *a: ring_attention(*a, mesh=mesh, causal=causal))(
        *sharded), naive_attention(q, k, v, causal), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(ring_loss, argnums=(0, 1, 2)))(*sharded)
    want = jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
