"""DeepSeek-V3 routing: sigmoid scores, scaled weights and group-limited (node-limited) top-k,
checked against a plain-numpy gate written from the paper (arXiv:2412.19437 eq. 12-16)."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtron.config.loading import config_from_dict
from jaxtron.data.pipeline import open_dataset, train_batches
from jaxtron.errors import ConfigError
from jaxtron.hf.translate import to_hf
from jaxtron.models.moe import MoE, route, top_k
from jaxtron.training.trainer import Trainer

from conftest import initial_state, make_config


def numpy_gate(logits_TxE, k, score, order="topk_then_softmax", groups=1, top_groups=1,
               scale=1.0):
    """One token at a time: -> (experts_TxK, weights_TxK, probs_TxE, groups_TxT)."""
    logits_TxE = np.asarray(logits_TxE, np.float64)
    n, e = logits_TxE.shape
    per_group = e // groups
    experts, weights, probs, chosen_groups = [], [], [], []
    for logit in logits_TxE:
        if score == "sigmoid":
            s = 1 / (1 + np.exp(-logit))
            probs.append(s / s.sum())
        else:
            s = np.exp(logit - logit.max())
            s = s / s.sum()
            probs.append(s)
        group_score = []
        for g in range(groups):
            members = np.sort(s[g * per_group:(g + 1) * per_group])[::-1]
            group_score.append(members[:2].sum() if per_group >= 2 else members[0])
        best = list(np.argsort(-np.array(group_score), kind="stable")[:top_groups])
        allowed = [x for x in range(e) if x // per_group in best]
        chosen = sorted(allowed, key=lambda x: (-s[x], x))[:k]
        if score == "sigmoid":
            w = s[chosen] / s[chosen].sum() if k > 1 else s[chosen]
        elif order == "softmax_then_topk":
            w = s[chosen]
        else:
            w = np.exp(logit[chosen] - logit[chosen].max())
            w = w / w.sum()
        experts.append(chosen)
        weights.append(w * scale)
        chosen_groups.append(best)
    return (np.array(experts), np.array(weights), np.array(probs), np.array(chosen_groups))


def logits_of(b=2, length=24, e=16, seed=0):
    return jax.random.normal(jax.random.key(seed), (b, length, e)) * 2


def old_route(logits_BxLxE, k, order):
    """route() as it was before score/groups/scale existed."""
    probs = jax.nn.softmax(logits_BxLxE, axis=-1)
    if order == "softmax_then_topk":
        weights, experts = top_k(probs, k)
    else:
        top_logits, experts = top_k(logits_BxLxE, k)
        weights = jax.nn.softmax(top_logits, axis=-1)
    return weights, experts, probs


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("score, order, groups, top_groups, k, scale", [
    ("sigmoid", "topk_then_softmax", 1, 1, 4, 1.0),
    ("sigmoid", "topk_then_softmax", 4, 2, 4, 2.5),  # DeepSeek-V3's shape, scaled down
    ("sigmoid", "topk_then_softmax", 8, 3, 3, 1.0),  # 2 experts per group
    ("sigmoid", "topk_then_softmax", 16, 4, 2, 1.0),  # 1 expert per group: its score is the max
    ("sigmoid", "topk_then_softmax", 4, 1, 1, 1.0),  # one expert keeps its raw score
    ("softmax", "topk_then_softmax", 4, 2, 4, 1.0),
    ("softmax", "softmax_then_topk", 4, 2, 3, 2.0),
])
def test_route_equals_the_numpy_deepseek_v3_gate(score, order, groups, top_groups, k, scale,
                                                 use_jit):
    logits = logits_of()
    fn = lambda x: route(x, k, order, score=score, groups=groups, top_groups=top_groups,
                         scale=scale)
    weights, experts, probs = (jax.jit(fn) if use_jit else fn)(logits)
    flat = logits.reshape(-1, 16)
    want_experts, want_weights, want_probs, want_groups = numpy_gate(
        flat, k, score, order, groups, top_groups, scale)
    np.testing.assert_array_equal(np.asarray(experts).reshape(-1, k), want_experts)
    np.testing.assert_allclose(np.asarray(weights).reshape(-1, k), want_weights, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(probs).reshape(-1, 16), want_probs, rtol=1e-5,
                               atol=1e-7)
    per_group = 16 // groups
    for token_experts, token_groups in zip(np.asarray(experts).reshape(-1, k), want_groups):
        assert set(token_experts // per_group) <= set(token_groups)
    if score == "sigmoid" and k > 1:
        np.testing.assert_allclose(np.asarray(weights).sum(-1), scale, rtol=1e-5)
    # The limit changed some tokens' choice, so the test is not vacuous (with one expert per
    # group the k best experts always lie in the k best groups).
    if top_groups < groups and per_group >= 2:
        free, _, _, _ = numpy_gate(flat, k, score, order)
        assert (np.sort(free, -1) != np.sort(want_experts, -1)).any(axis=-1).sum() >= 5


@pytest.mark.parametrize("order", ["topk_then_softmax", "softmax_then_topk"])
def test_defaults_leave_route_bitwise_unchanged(order):
    logits = logits_of(seed=3)
    want = old_route(logits, 2, order)
    for got in (route(logits, 2, order),
                route(logits, 2, order, score="softmax", groups=1, top_groups=1, scale=1.0)):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    # Keeping every group chooses as if there were no groups.
    all_groups = route(logits, 2, order, groups=4, top_groups=4)
    for a, b in zip(all_groups, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_group_limited_routing_stays_on_the_devices_that_hold_the_tokens():
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    logits = jax.device_put(logits_of(b=8, length=4), sharding)
    fn = lambda x: route(x, 4, "topk_then_softmax", score="sigmoid", groups=4, top_groups=2)
    assert "all-gather" not in jax.jit(fn).lower(logits).compile().as_text()


def test_moe_layer_routes_with_the_configured_gate():
    """The layer's output is each token's numpy-gate experts, weighted, looped one by one."""
    config = make_config(moe={"num_experts": 8, "top_k": 3, "mode": "dropless",
                              "score": "sigmoid", "route_groups": 4, "route_top_groups": 2,
                              "route_scale": 2.5})
    layer = MoE(config.model, config.moe, nnx.Rngs(3))
    x_BxLxD = jax.random.normal(jax.random.key(0), (2, 8, 64))
    y_BxLxD, _ = layer(x_BxLxD)
    x_TxD = np.asarray(x_BxLxD).reshape(-1, 64)
    experts, weights, _, _ = numpy_gate(x_TxD @ np.asarray(layer.router[...]), 3, "sigmoid",
                                        groups=4, top_groups=2, scale=2.5)
    w_gate, w_up, w_down = (np.asarray(w[...]) for w in (layer.w_gate, layer.w_up,
                                                          layer.w_down))
    want = np.zeros_like(x_TxD)
    for t, x in enumerate(x_TxD):
        for e, w in zip(experts[t], weights[t]):
            gate = x @ w_gate[e]
            want[t] += w * ((gate / (1 + np.exp(-gate))) * (x @ w_up[e])) @ w_down[e]
    np.testing.assert_allclose(np.asarray(y_BxLxD).reshape(-1, 64), want, rtol=1e-4, atol=1e-5)


V3_MOE = {"num_experts": 4, "top_k": 2, "score": "sigmoid", "route_groups": 2,
          "route_top_groups": 1, "route_scale": 2.5}


def losses(layout, moe, devices, steps=3):
    config = make_config(layout, moe=moe, train={"batch_size": 8})
    trainer = Trainer(config, devices=devices)
    state = initial_state(trainer)
    batches = train_batches(config, open_dataset(config))
    out = []
    for _ in range(steps):
        state, metrics = trainer.step(state, trainer.put_batch(next(batches)))
        out.append(float(metrics["loss"]))
    return out


@pytest.mark.parametrize("mode", ["capacity", "dropless"])
def test_sigmoid_group_routing_trains_and_expert_parallel_matches_one_device(mode):
    moe = {**V3_MOE, "mode": mode}
    one = losses({"mesh.data": 1}, moe, jax.devices()[:1])
    sharded = losses({"mesh.data": 2, "mesh.expert": 2}, moe, jax.devices()[:4])
    assert np.isfinite(one).all() and one[-1] < one[0], one
    np.testing.assert_allclose(sharded, one, rtol=1e-5)


@pytest.mark.parametrize("overrides, fragment", [
    (["moe.route_groups=3"], "moe.route_groups=3 must divide moe.num_experts=8"),
    (["moe.route_groups=0"], "moe.route_groups=0 must divide"),
    (["moe.route_groups=4", "moe.route_top_groups=5"],
     "moe.route_top_groups=5 must lie between 1 and moe.route_groups=4"),
    (["moe.route_top_groups=2"], "moe.route_top_groups=2 must lie between 1 and "
                                 "moe.route_groups=1"),
    (["moe.route_groups=4", "moe.route_top_groups=1", "moe.top_k=3"],
     "moe.top_k=3 exceeds the 2 experts of moe.route_top_groups=1 groups"),
    (["moe.score=sigmoid", "moe.router=softmax_then_topk"],
     "moe.router=softmax_then_topk has no meaning with moe.score=sigmoid"),
    (["moe.route_scale=0"], "moe.route_scale=0.0 must be > 0"),
    (["moe.score=tanh"], "moe.score"),
])
def test_bad_routing_settings_are_explained(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        config_from_dict({}, ["moe.num_experts=8", *overrides])
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("moe, fragment", [
    ({"score": "sigmoid"}, "moe.score=sigmoid cannot be exported"),
    ({"route_groups": 2}, "moe.route_groups=2 cannot be exported"),
    ({"route_scale": 2.5}, "moe.route_scale=2.5 cannot be exported"),
])
def test_deepseek_routing_is_not_exported_as_mixtral(moe, fragment):
    config = make_config(moe={"num_experts": 4, **moe})
    with pytest.raises(ConfigError, match=fragment):
        to_hf(config, {})
