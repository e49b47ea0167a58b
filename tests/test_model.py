"""Model invariants: causality, scan == loop, remat changes nothing, mixed precision."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtron.models.transformer import Transformer, cross_entropy_loss
from jaxtron.sharding.rules import logical_names

from conftest import first_batch_objective_metrics_grads, make_config


def build(**model):
    cfg = make_config(model=model).model
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    return cfg, graphdef, params


def tokens(batch=2, length=24, seed=0):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, 256)


def loss_and_grads(graphdef, params, toks):
    def loss(p):
        return cross_entropy_loss(nnx.merge(graphdef, p)(toks[:, :-1]), toks[:, 1:])
    return jax.jit(jax.value_and_grad(loss))(params)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(model_type):
    kv = None if model_type == "gpt2" else 2
    _, graphdef, params = build(type=model_type, num_kv_heads=kv)
    apply = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    toks = tokens()
    changed = toks.at[:, 12].set((toks[:, 12] + 7) % 256)
    a, b = apply(params, toks), apply(params, changed)
    np.testing.assert_array_equal(np.asarray(a[:, :12]), np.asarray(b[:, :12]))
    assert not np.allclose(np.asarray(a[:, 12:]), np.asarray(b[:, 12:]))


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_scan_equals_unrolled_loop(model_type):
    kv = None if model_type == "gpt2" else 2
    _, scanned, params = build(type=model_type, num_kv_heads=kv, num_layers=3)
    _, unrolled, params_u = build(type=model_type, num_kv_heads=kv, num_layers=3,
                                  scan_layers=False)
    assert_trees_close(params, params_u, 0, 0)
    toks = tokens()
    loss_s, grads_s = loss_and_grads(scanned, params, toks)
    loss_u, grads_u = loss_and_grads(unrolled, params, toks)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
    assert_trees_close(grads_s, grads_u)


@pytest.mark.parametrize("policy", ["full", "save_dots"])
def test_remat_leaves_loss_and_gradients_unchanged(policy):
    _, plain, params = build()
    _, remat, _ = build(remat=policy)
    toks = tokens()
    loss_p, grads_p = loss_and_grads(plain, params, toks)
    loss_r, grads_r = loss_and_grads(remat, params, toks)
    np.testing.assert_allclose(loss_p, loss_r, rtol=1e-6)
    assert_trees_close(grads_p, grads_r)


def test_every_parameter_has_logical_axis_names():
    _, _, params = build()
    allowed = {"embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", None}
    for path, var in nnx.to_flat_state(params):
        names = logical_names(var)
        assert len(names) == var.ndim, path
        assert set(names) <= allowed, path
        if path[0] == "blocks":
            assert names[0] == "layers", path


def test_llama_and_gpt2_variants_have_their_parameters():
    llama = dict(nnx.to_flat_state(build()[2]))
    gpt2 = dict(nnx.to_flat_state(build(type="gpt2", num_kv_heads=None)[2]))
    assert ("head", "lm_head") in llama and ("head", "lm_head") not in gpt2  # gpt2 ties embeddings
    assert ("embedder", "pos_embed") in gpt2 and ("embedder", "pos_embed") not in llama
    assert ("blocks", "mlp", "w_gate") in llama and ("blocks", "attn", "bq") in gpt2
    assert llama[("blocks", "attn", "wk")].shape == (2, 64, 2, 16)  # N, D, G, K


BF16_ROUNDING = 2.0**-9  # bf16 keeps 8 significant bits: round-to-nearest is within 2^-9


def _bf16_roundings(cfg) -> int:
    """Roundings to bf16 on the way from tokens to logits: the embedding, then per layer
    q/k/v, the attention output, its projection, gate/up and down, then the head."""
    return 6 * cfg.num_layers + 2


def rms(x) -> float:
    return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def _trained_fp32(steps=5, lr=0.5):
    """Parameters after a few SGD steps on one batch, so that the logits differ by more than
    init's near-uniform guess (whose loss is ln V whatever the hidden states are)."""
    _, graph32, params = build()
    toks = tokens(batch=4, length=64)
    first = None
    for _ in range(steps):
        loss, grads = loss_and_grads(graph32, params, toks)
        first = first if first is not None else float(loss)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    assert float(loss) < first - 0.5  # it trained
    return graph32, params, toks


def _bf16_forward_error(params, graph32, toks, graph16, params16=None) -> float:
    """rms(bf16 logits - fp32 logits) relative to the spread of the fp32 logits; the bf16
    forward runs `params16` when given (a perturbed copy)."""
    def apply(graph, p):
        return np.asarray(jax.jit(lambda p: nnx.merge(graph, p)(toks[:, :-1]))(p), np.float32)
    want = apply(graph32, params)
    got = apply(graph16, params if params16 is None else params16)
    return rms(got - want) / rms(want - want.mean(-1, keepdims=True))


def test_bf16_compute_keeps_fp32_params_grads_and_loss_within_bf16_rounding():
    """Each bf16 rounding errs by at most 2^-9, independently: after n roundings the logits'
    rms error is within 2^-9 sqrt(n) of their spread; the backward rounds as often again."""
    graph32, params, toks = _trained_fp32()
    cfg16, graph16, _ = build(dtype="bfloat16")
    logits = jax.jit(lambda p: nnx.merge(graph16, p)(toks))(params)
    assert logits.dtype == jnp.bfloat16
    n = _bf16_roundings(cfg16)
    assert _bf16_forward_error(params, graph32, toks, graph16) <= BF16_ROUNDING * np.sqrt(n)
    loss16, grads16 = loss_and_grads(graph16, params, toks)
    loss32, grads32 = loss_and_grads(graph32, params, toks)
    assert loss16.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads16))
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])  # noqa: E731
    assert rms(flat(grads16) - flat(grads32)) <= BF16_ROUNDING * np.sqrt(2 * n) * rms(
        flat(grads32))


def test_the_bf16_comparison_catches_one_wrong_matmul():
    """The bound above is tight enough to fail on a forward whose one matmul is 10% off
    (the first layer's attention output projection), as a wrong bf16 kernel would be."""
    graph32, params, toks = _trained_fp32()
    cfg16, graph16, _ = build(dtype="bfloat16")
    wrong = jax.tree.map(lambda x: x, params)
    wo = dict(nnx.to_flat_state(wrong))[("blocks", "attn", "wo")]
    noise = np.random.default_rng(0).standard_normal(wo.shape[1:])
    wo[...] = wo[...].at[0].multiply(1 + 0.1 * noise)
    error = _bf16_forward_error(params, graph32, toks, graph16, params16=wrong)
    assert error > BF16_ROUNDING * np.sqrt(_bf16_roundings(cfg16))


def test_cross_entropy_matches_log_softmax_reference():
    logits = jax.random.normal(jax.random.key(1), (2, 5, 11))
    targets = jax.random.randint(jax.random.key(2), (2, 5), 0, 11)
    expected = -np.mean(np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)),
                                           np.asarray(targets)[..., None], -1))
    np.testing.assert_allclose(cross_entropy_loss(logits, targets), expected, rtol=1e-6)


@pytest.mark.parametrize("name", ["swiglu", "gelu_tanh"])
def test_hand_written_activation_derivatives_equal_jaxs(name):
    """The MLP activations' custom VJPs against JAX differentiating the plain formulas, both
    against a float64 numpy oracle (ours as accurate as JAX's own derivative), and what they
    keep for the backward: only their inputs."""
    from jax._src.ad_checkpoint import saved_residuals

    from jaxtron.kernels import activations
    plain = {"swiglu": lambda g, u: jax.nn.silu(g) * u,
             "gelu_tanh": lambda g, u: jax.nn.gelu(g, approximate=True) * u}[name]
    ours = {"swiglu": activations.swiglu,
            "gelu_tanh": lambda g, u: activations.gelu_tanh(g) * u}[name]
    rng = np.random.default_rng(4)
    gate, up = (4 * rng.standard_normal((64, 96), np.float32) for _ in range(2))
    d_out = rng.standard_normal((64, 96), np.float32)
    g, u, d = (a.astype(np.float64) for a in (gate, up, d_out))
    if name == "swiglu":
        sig = 1 / (1 + np.exp(-g))
        act, d_act = g * sig, sig * (1 + g * (1 - sig))
    else:
        c = np.sqrt(2 / np.pi)
        t = np.tanh(c * (g + 0.044715 * g ** 3))
        act = 0.5 * g * (1 + t)
        d_act = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * c * (1 + 3 * 0.044715 * g * g)
    oracle = (act * u, (d * u * d_act, d * act))  # value, (d gate, d up)

    def error(fn):
        value, vjp = jax.vjp(fn, gate, up)
        got = (value, vjp(d_out))
        return [np.max(np.abs(np.asarray(a, np.float64) - b)) for a, b in
                zip(jax.tree.leaves(got), jax.tree.leaves(oracle), strict=True)]

    for ours_error, jax_error in zip(error(ours), error(plain), strict=True):
        assert ours_error <= 1.5 * jax_error + 1e-6, (ours_error, jax_error)
    def kept(fn):
        return [a.shape for a, _ in saved_residuals(lambda g, u: jnp.sum(fn(g, u)), gate, up)]

    # swiglu: gate and up (JAX keeps five arrays); gelu * up: gelu's input, up and the GELU.
    assert kept(ours).count((64, 96)) == {"swiglu": 2, "gelu_tanh": 3}[name]
    assert kept(plain).count((64, 96)) > kept(ours).count((64, 96))


@pytest.mark.parametrize("piece", ["embed", "head_loss"])
def test_a_change_to_a_piece_of_the_model_reaches_the_pipeline_too(monkeypatch, piece):
    """The model is composed once: the whole-model loss and the pipeline's stages call the same
    pieces (the ends: before the pieces, each path had its own). Change one (scale the
    embeddings, shift the loss) and both paths follow, equal to each other and different from
    before. (The stack between them is one function of a run of blocks on both paths.)"""
    from jaxtron.models import transformer

    def objective(layout):
        config = make_config({"mesh.data": 1, **layout}, model={"num_layers": 4},
                             train={"batch_size": 8})
        devices = 2 if "mesh.stage" in layout else 1
        return first_batch_objective_metrics_grads(config, devices)[0]

    pipeline = {"mesh.stage": 2, "pipeline.microbatches": 2}
    before = objective({}), objective(pipeline)
    original = getattr(transformer, piece)

    def changed(*args, **kwargs):
        out = original(*args, **kwargs)
        if piece == "embed":
            return 1.5 * out
        loss, aux = out
        return loss + 0.25, aux

    monkeypatch.setattr(transformer, piece, changed)
    after = objective({}), objective(pipeline)
    np.testing.assert_allclose(before[1], before[0], rtol=1e-5)
    np.testing.assert_allclose(after[1], after[0], rtol=1e-5)
    assert abs(after[0] - before[0]) > 1e-3
