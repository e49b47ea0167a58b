"""The blockwise causal attention (the `xla` path) equals the reference in value and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.kernels.blockwise import blockwise_causal_attention, chunk_count
from jaxtron.kernels.reference import reference_attention


@pytest.mark.parametrize("heads, kv_heads, length, chunks, segments", [
    (4, 4, 128, None, False), (4, 2, 128, 4, False), (6, 2, 96, 3, True), (4, 1, 64, 2, True),
    (2, 2, 30, None, False),
])
def test_values_and_gradients_equal_the_reference(heads, kv_heads, length, chunks, segments):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, length, heads, 16))
    k, v = (jax.random.normal(x, (2, length, kv_heads, 16)) for x in keys[1:3])
    seg = None
    if segments:  # two packed documents per row, cut at different places
        seg = (jnp.arange(length)[None] >= jnp.array([[length // 3], [length // 2]])).astype(int)
    d_out = jax.random.normal(keys[3], q.shape)

    def run(fn):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v), q, k, v)
        return out, vjp(d_out)

    expected = run(lambda q, k, v: reference_attention(q, k, v, causal=True, segment_ids=seg))
    got = run(lambda q, k, v: blockwise_causal_attention(q, k, v, segment_ids=seg,
                                                         chunks=chunks))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_chunking_kicks_in_for_longer_sequences():
    assert chunk_count(30) == 1 and chunk_count(64) == 1 and chunk_count(256) == 4
