"""The blockwise causal attention (the `xla` path) equals the reference in value and gradient;
with fewer queries than keys, where the `xla` path runs the reference itself (blockwise takes
self-attention only), that equals the numpy oracle's bottom-right causal attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.kernels.attention import attention
from jaxtron.kernels.blockwise import blockwise_causal_attention, chunk_count
from jaxtron.kernels.reference import reference_attention

from attention_oracle import assert_bottom_right_not_top_left


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
        @jax.jit
        def value_and_vjp(q, k, v, d_out):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(d_out)
        return value_and_vjp(q, k, v, d_out)

    expected = run(lambda q, k, v: reference_attention(q, k, v, causal=True, segment_ids=seg))
    got = run(lambda q, k, v: blockwise_causal_attention(q, k, v, segment_ids=seg,
                                                         chunks=chunks))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_xla_path_with_fewer_queries_than_keys_is_bottom_right_causal():
    keys = jax.random.split(jax.random.key(4), 4)
    q = jax.random.normal(keys[0], (2, 16, 4, 8))
    k, v = (jax.random.normal(x, (2, 40, 2, 8)) for x in keys[1:3])
    d_out = jax.random.normal(keys[3], q.shape)

    @jax.jit
    def output_and_grads(q, k, v, d_out):
        out, vjp = jax.vjp(lambda *a: attention(*a, causal=True, impl="xla"), q, k, v)
        return out, vjp(d_out)

    assert_bottom_right_not_top_left(output_and_grads(q, k, v, d_out), q, k, v, d_out)


def test_chunking_kicks_in_for_longer_sequences():
    assert chunk_count(30) == 1 and chunk_count(64) == 1 and chunk_count(256) == 4


def test_bf16_matches_the_fp32_reference():
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (2, 128, 4, 16))
    k, v = (jax.random.normal(x, (2, 128, 2, 16)) for x in keys[1:3])
    d_out = jax.random.normal(keys[3], q.shape)

    @jax.jit(static_argnums=0)
    def run(fn, *args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(d_out.astype(out.dtype))

    expected = run(lambda q, k, v: reference_attention(q, k, v, causal=True), q, k, v)
    got = run(blockwise_causal_attention, *(x.astype(jnp.bfloat16) for x in (q, k, v)))
    # bf16 keeps 8 mantissa bits (relative step 2^-8 = 0.004); inputs are rounded once and the
    # matmul operands (probabilities, d-logits) once more, with fp32 accumulation: a few steps.
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0.05, atol=0.05)


def test_backward_keeps_no_scores_and_save_dots_keeps_the_output():
    """Flash-style residuals: nothing [L, L] is saved, and the save_dots policy keeps the
    named output and log-sum-exp, so the backward needs no second attention forward."""
    from jax._src.ad_checkpoint import saved_residuals

    from jaxtron.models.transformer import REMAT_POLICIES

    length = 128
    x = jax.random.normal(jax.random.key(2), (2, length, 4, 16))
    w = jax.random.normal(jax.random.key(3), (16, 16))

    def block(x, w):
        h = x @ w
        return jnp.sum(jnp.tanh(blockwise_causal_attention(h, h, h)))

    shapes = [aval.shape for aval, _ in saved_residuals(block, x, w)]
    # Scores or probabilities would be [B, G, rows, keys]: two long axes after the first two.
    assert all(sum(d >= 32 for d in s[2:]) < 2 for s in shapes), shapes
    kept = [where for _, where in saved_residuals(
        jax.checkpoint(block, policy=REMAT_POLICIES["save_dots"]), x, w)]
    assert any("attention_out" in w for w in kept) and any("attention_lse" in w for w in kept)
