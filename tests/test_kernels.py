"""Attention implementations against independent references, forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.kernels.attention import attention

from attention_oracle import reference_attention


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
