"""TPU splash attention, run by Pallas' TPU interpreter on CPU, against the reference.

The kernel is JAX's; what is ours is the adapter (`kernels/splash.py`): layout, scaling,
padding to 128-wide tiles, bottom-right causal masks, grouped-query heads and packed segments.
Each case compares the output and the gradients of q, k and v; the fewer-queries-than-keys case
against the numpy oracle of `attention_oracle.py`.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from test_flash import inputs, output_and_grads, packed

from jaxtron.kernels.splash import splash_attention

from attention_oracle import assert_bottom_right_not_top_left, reference_attention


def check(q, k, v, cotangent, *, causal, segment_ids=None, tol=1e-5, max_block=128):
    got = output_and_grads(lambda *a: splash_attention(
        *a, causal=causal, segment_ids=segment_ids, interpret=True, max_block=max_block),
        q, k, v, cotangent)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = output_and_grads(lambda *a: reference_attention(*a, causal=causal,
                                                           segment_ids=segment_ids),
                            *f32, cotangent)
    assert got[0].dtype == q.dtype
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1])):
        scale = float(jnp.abs(w).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=tol, atol=tol * scale,
                                   err_msg=name)


@pytest.mark.parametrize("causal", [True, False])
def test_grouped_query_heads_over_several_blocks(causal):
    # 300 tokens: three 128-wide blocks, the last one padded (masked by causality, or by the
    # padding segment when attention is not causal); 4 query heads on 2 kv heads.
    q, k, v, cotangent = inputs(length=300, dim=32)
    check(q, k, v, cotangent, causal=causal)


def test_packed_documents():
    q, k, v, cotangent = inputs(length=200, kv_heads=1, dim=32)
    check(q, k, v, cotangent, causal=True, segment_ids=packed(2, 200))


def test_fewer_queries_than_keys_is_bottom_right_causal():
    q, k, v, cotangent = inputs(length=100, kv_length=260, dim=32)
    splash = functools.partial(splash_attention, causal=True, interpret=True, max_block=128)
    got = output_and_grads(splash, q, k, v, cotangent)
    assert_bottom_right_not_top_left(got, q, k, v, cotangent)


def test_bf16():
    q, k, v, cotangent = inputs(length=128, dim=64, dtype=jnp.bfloat16)
    check(q, k, v, cotangent, causal=True, tol=2e-2)
