"""Attention written out in numpy (float64) with an explicitly built mask: the oracle that the
kernels' fewer-queries-than-keys cases are compared against, in value and gradient.

With L queries and S >= L keys, causal masking is bottom-right aligned: query i stands at key
position i + (S - L) and sees keys j <= i + S - L (the last query sees every key), as when new
tokens attend to a cache of earlier ones. Top-left alignment (j <= i) is the other convention;
the tests show the oracle tells the two apart.
"""

import jax
import numpy as np
import pytest

from jaxtron.kernels import reference

# jaxtron's reference attention, compiled once per shape: run op by op, its forward and gradient
# would compile a hundred one-operation programs for each new shape.
reference_attention = jax.jit(reference.reference_attention, static_argnames=("causal", "window"))


def bottom_right_causal(q_len: int, kv_len: int):
    """LxS bool: query i sees keys j <= i + (S - L)."""
    return np.tril(np.ones((q_len, kv_len), bool), k=kv_len - q_len)


def top_left_causal(q_len: int, kv_len: int):
    """LxS bool: query i sees keys j <= i, whatever S is."""
    return np.tril(np.ones((q_len, kv_len), bool), k=0)


def probabilities(q_BxLxHxK, k_BxSxHxK, mask_LxS):
    """softmax over the visible keys of q k^T / sqrt(K): BxHxLxS, float64."""
    s_BxHxLxS = np.einsum("blhk,bshk->bhls", q_BxLxHxK, k_BxSxHxK) / np.sqrt(q_BxLxHxK.shape[-1])
    s_BxHxLxS = np.where(mask_LxS, s_BxHxLxS, -np.inf)
    p_BxHxLxS = np.exp(s_BxHxLxS - s_BxHxLxS.max(axis=-1, keepdims=True))
    return p_BxHxLxS / p_BxHxLxS.sum(axis=-1, keepdims=True)


def attention(q, k, v, mask_LxS):
    """The forward alone: q_BxLxHxK, k/v_BxSxGxK -> out_BxLxHxK, float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    repeat = q.shape[2] // k.shape[2]
    p_BxHxLxS = probabilities(q, np.repeat(k, repeat, axis=2), mask_LxS)
    return np.einsum("bhls,bshk->blhk", p_BxHxLxS, np.repeat(v, repeat, axis=2))


def attention_and_grads(q, k, v, d_out, mask_LxS):
    """softmax(q k^T / sqrt(K)) v under the mask, kv head g serving query heads g R to
    g R + R - 1 (R = H / G), and the gradients of sum(out * d_out) by the textbook formulas
    dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO * O)), dQ = dS K / sqrt(K),
    dK = dS^T Q / sqrt(K). q_BxLxHxK, k/v_BxSxGxK -> (out, dq, dk, dv), float64."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    batch, kv_len, groups, dim = k.shape
    repeat = q.shape[2] // groups
    k_BxSxHxK, v_BxSxHxK = np.repeat(k, repeat, axis=2), np.repeat(v, repeat, axis=2)
    scale = 1.0 / np.sqrt(dim)
    p_BxHxLxS = probabilities(q, k_BxSxHxK, mask_LxS)
    out = np.einsum("bhls,bshk->blhk", p_BxHxLxS, v_BxSxHxK)
    dp_BxHxLxS = np.einsum("blhk,bshk->bhls", d_out, v_BxSxHxK)
    row_BxHxL = np.einsum("blhk,blhk->bhl", d_out, out)
    ds_BxHxLxS = p_BxHxLxS * (dp_BxHxLxS - row_BxHxL[..., None])
    dq = np.einsum("bhls,bshk->blhk", ds_BxHxLxS, k_BxSxHxK) * scale
    dk_BxSxHxK = np.einsum("bhls,blhk->bshk", ds_BxHxLxS, q) * scale
    dv_BxSxHxK = np.einsum("bhls,blhk->bshk", p_BxHxLxS, d_out)

    def per_kv_head(x_BxSxHxK):  # the R query heads of a group add up on their kv head
        return x_BxSxHxK.reshape(batch, kv_len, groups, repeat, dim).sum(axis=3)

    return out, dq, per_kv_head(dk_BxSxHxK), per_kv_head(dv_BxSxHxK)


def assert_matches(got, want, tol=1e-5):
    """(out, (dq, dk, dv)) of an implementation against the oracle's (out, dq, dk, dv), each
    within `tol` of its largest entry."""
    out, grads = got
    for name, g, w in zip(("out", "dq", "dk", "dv"), (out, *grads), want, strict=True):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tol,
                                   atol=tol * float(np.abs(w).max()), err_msg=name)


def assert_bottom_right_not_top_left(got, q, k, v, d_out, tol=1e-5):
    """`got`, an implementation's (out, (dq, dk, dv)) for fewer queries than keys, matches the
    oracle under the bottom-right causal mask; the same comparison against the top-left mask
    fails, so it does tell the two alignments apart."""
    q_len, kv_len = q.shape[1], k.shape[1]
    assert q_len < kv_len  # with as many queries as keys the two masks are one
    assert_matches(got, attention_and_grads(q, k, v, d_out, bottom_right_causal(q_len, kv_len)),
                   tol)
    with pytest.raises(AssertionError):
        assert_matches(got, attention_and_grads(q, k, v, d_out, top_left_causal(q_len, kv_len)),
                       tol)
