"""Mixture of experts: routing semantics, auxiliary losses, and expert parallelism."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtron.config.loading import config_from_dict, load_config
from jaxtron.data.pipeline import open_dataset, train_batches
from jaxtron.errors import ConfigError
from jaxtron.models.moe import MoE, capacity, capacity_slots, load_balancing_loss, route, top_k
from jaxtron.training.flops import matmul_params
from jaxtron.training.trainer import Trainer

from conftest import initial_state, long_run_env, make_config, metric_records


def moe_layer(**moe):
    config = make_config(moe={"num_experts": 4, "top_k": 2, **moe})
    return MoE(config.model, config.moe, nnx.Rngs(3)), config


# --- routing and the dense mixture in numpy (float64), written from docs/moe.md ---------------

def numpy_routing(logits_TxE, moe):
    """-> (ranked_TxE, weights_TxK): each token's experts best first (ranked[:, :k] are the
    chosen ones) and their combine weights.

    score=softmax: p = softmax(logits); topk_then_softmax renormalises the k chosen p to sum 1
    (the same as a softmax over the chosen logits), softmax_then_topk keeps them as they are.
    score=sigmoid: s = sigmoid(logits), the k chosen s renormalised when k > 1. With
    route_groups G the experts form G equal consecutive groups, a group scores the sum of its
    two best, and only the experts of the route_top_groups best groups may be chosen. Ties go
    to the lower index; every weight is multiplied by route_scale."""
    k = moe.top_k
    if moe.score == "sigmoid":
        scores_TxE = 1.0 / (1.0 + np.exp(-logits_TxE))
    else:
        scores_TxE = np.exp(logits_TxE - logits_TxE.max(axis=-1, keepdims=True))
        scores_TxE /= scores_TxE.sum(axis=-1, keepdims=True)
    allowed_TxE = allowed_experts(scores_TxE, moe.route_groups, moe.route_top_groups)
    ranked_TxE = np.argsort(-np.where(allowed_TxE, scores_TxE, -np.inf), axis=-1,
                            kind="stable")
    chosen_TxK = np.take_along_axis(scores_TxE, ranked_TxE[:, :k], axis=-1)
    renormalise = k > 1 if moe.score == "sigmoid" else moe.router == "topk_then_softmax"
    if renormalise:
        chosen_TxK = chosen_TxK / chosen_TxK.sum(axis=-1, keepdims=True)
    return ranked_TxE, chosen_TxK * moe.route_scale


def allowed_experts(scores_TxE, groups, top_groups):
    """The experts of each token's best groups (every expert when groups == 1): bool [T, E]."""
    tokens, experts = scores_TxE.shape
    per_group = experts // groups
    best_first_TxGxS = -np.sort(-scores_TxE.reshape(tokens, groups, per_group), axis=-1)
    group_score_TxG = best_first_TxGxS[..., :2].sum(axis=-1)
    best_groups = np.argsort(-group_score_TxG, axis=-1, kind="stable")[:, :top_groups]
    allowed_TxG = np.zeros((tokens, groups), bool)
    np.put_along_axis(allowed_TxG, best_groups, True, axis=-1)
    return np.repeat(allowed_TxG, per_group, axis=-1)


def numpy_mixture(layer, x_TxD, experts_TxK, weights_TxK, kept_TxK=None):
    """Each token's sum over its kept assignments of weight x SwiGLU expert, silu(x W_gate) *
    (x W_up) W_down, computed densely: every expert on every token, combined through a [T, E]
    gate that is zero off the routing."""
    w_gate, w_up, w_down = (np.asarray(w[...], np.float64)
                            for w in (layer.w_gate, layer.w_up, layer.w_down))
    kept_TxK = np.ones(experts_TxK.shape, bool) if kept_TxK is None else kept_TxK
    gate_TxE = np.zeros((x_TxD.shape[0], w_gate.shape[0]))
    rows_TxK = np.broadcast_to(np.arange(x_TxD.shape[0])[:, None], experts_TxK.shape)
    np.add.at(gate_TxE, (rows_TxK, experts_TxK), np.where(kept_TxK, weights_TxK, 0.0))
    g_ExTxF = np.einsum("td,edf->etf", x_TxD, w_gate)
    h_ExTxF = g_ExTxF / (1.0 + np.exp(-g_ExTxF)) * np.einsum("td,edf->etf", x_TxD, w_up)
    return np.einsum("te,etf,efd->td", gate_TxE, h_ExTxF, w_down)


def router_logits(layer, x_BxLxD):
    """(x as [T, D], the router's logits [T, E]), in float64."""
    x_TxD = np.asarray(x_BxLxD, np.float64).reshape(-1, x_BxLxD.shape[-1])
    return x_TxD, x_TxD @ np.asarray(layer.router[...], np.float64)


def dense_reference(layer, x_BxLxD, kept_BxLxK=None):
    """-> (y_BxLxD, experts_BxLxK) from the numpy routing and mixture: of the layer, only its
    parameters are used."""
    b, length, d = x_BxLxD.shape
    k = layer.moe.top_k
    x_TxD, logits_TxE = router_logits(layer, x_BxLxD)
    ranked_TxE, weights_TxK = numpy_routing(logits_TxE, layer.moe)
    kept_TxK = None if kept_BxLxK is None else np.asarray(kept_BxLxK).reshape(-1, k)
    y_TxD = numpy_mixture(layer, x_TxD, ranked_TxE[:, :k], weights_TxK, kept_TxK)
    return y_TxD.reshape(b, length, d), ranked_TxE[:, :k].reshape(b, length, k)


def assert_close(got, want):
    """The float32 layer against the float64 reference, the tolerance scaled to the output."""
    scale = float(np.abs(want).max())
    assert scale > 1e-4, scale  # not a comparison between near-zero numbers
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-5 * scale)


def tokens_x(b=2, length=16, d=64, seed=0):
    return jax.random.normal(jax.random.key(seed), (b, length, d))


def next_expert_for_token_0(moe, logits_TxE):
    """A mistake: token 0's k-th choice replaced by its (k+1)-th best expert, same weights."""
    ranked_TxE, weights_TxK = numpy_routing(logits_TxE, moe)
    experts_TxK = ranked_TxE[:, :moe.top_k].copy()
    experts_TxK[0, -1] = ranked_TxE[0, moe.top_k]
    return experts_TxK, weights_TxK


def other_router_order(moe, logits_TxE):
    """A mistake: the chosen probabilities renormalised where they should not be, or kept
    where they should be renormalised."""
    flipped = {"topk_then_softmax": "softmax_then_topk",
               "softmax_then_topk": "topk_then_softmax"}[moe.router]
    ranked_TxE, weights_TxK = numpy_routing(logits_TxE, dataclasses.replace(moe, router=flipped))
    return ranked_TxE[:, :moe.top_k], weights_TxK


def groups_ignored(moe, logits_TxE):
    """A mistake: the top-k taken over every expert, not only those of the best groups."""
    ranked_TxE, weights_TxK = numpy_routing(logits_TxE, dataclasses.replace(moe, route_groups=1))
    return ranked_TxE[:, :moe.top_k], weights_TxK


ROUTINGS = {  # settings, and mistakes the comparison must notice
    "mixtral": ({"router": "topk_then_softmax"}, (next_expert_for_token_0, other_router_order)),
    "switch": ({"router": "softmax_then_topk"}, (next_expert_for_token_0, other_router_order)),
    "deepseek_v3": ({"score": "sigmoid", "num_experts": 8, "route_groups": 4,
                     "route_top_groups": 2, "route_scale": 2.5},
                    (next_expert_for_token_0, groups_ignored)),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_dropless_equals_the_dense_reference(routing):
    """The layer equals the numpy reference; the same comparison fails on a routing with one
    deliberate mistake."""
    settings, mistakes = ROUTINGS[routing]
    layer, _ = moe_layer(mode="dropless", **settings)
    x = tokens_x()
    y, stats = layer(x)
    want, _ = dense_reference(layer, x)
    assert_close(y, want)
    assert float(stats["dropped"]) == 0.0
    x_TxD, logits_TxE = router_logits(layer, x)
    for mistake in mistakes:
        wrong_TxD = numpy_mixture(layer, x_TxD, *mistake(layer.moe, logits_TxE))
        with pytest.raises(AssertionError):
            assert_close(y, wrong_TxD.reshape(y.shape))


def test_top_k_equals_lax_top_k_with_ties_and_gradients():
    x = jnp.round(jax.random.normal(jax.random.key(1), (3, 5, 8)) * 2) / 2  # many ties
    got, want = top_k(x, 3), jax.lax.top_k(x, 3)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    cotangent = jax.random.normal(jax.random.key(2), (3, 5, 3))
    grad = jax.grad(lambda x, f: jnp.sum(f(x, 3)[0] * cotangent), argnums=0)
    np.testing.assert_array_equal(grad(x, top_k), grad(x, jax.lax.top_k))


def test_routing_stays_on_the_devices_that_hold_the_tokens():
    """XLA gathers a TopK's operand onto every device; routing by sort must not."""
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    logits = jax.device_put(tokens_x(b=8, d=4), sharding)
    for order in ("topk_then_softmax", "softmax_then_topk"):
        hlo = jax.jit(lambda x: route(x, 2, order)).lower(logits).compile().as_text()
        assert "all-gather" not in hlo, order


def predicted_keep(experts_BxLxK, num_experts, slots):
    """The rule, written as a loop: first choices in position order, then second choices."""
    b, length, k = experts_BxLxK.shape
    keep = np.zeros(experts_BxLxK.shape, bool)
    for i in range(b):
        used = [0] * num_experts
        for j in range(k):
            for t in range(length):
                e = experts_BxLxK[i, t, j]
                if used[e] < slots:
                    keep[i, t, j] = True
                    used[e] += 1
    return keep


def test_tiny_capacity_drops_exactly_the_predicted_assignments():
    layer, config = moe_layer(mode="capacity", capacity_factor=0.25)
    x = tokens_x()
    slots = capacity(16, 2, 4, 0.25)
    assert slots == 2
    _, experts = dense_reference(layer, x)
    keep = predicted_keep(experts, 4, slots)
    _, got_keep = capacity_slots(jnp.asarray(experts), 4, slots)
    np.testing.assert_array_equal(got_keep, keep)
    y, stats = layer(x)
    want, _ = dense_reference(layer, x, keep)
    assert_close(y, want)
    assert float(stats["dropped"]) == pytest.approx(1 - keep.mean())
    assert 0.5 < float(stats["dropped"]) < 1


def test_generous_capacity_drops_nothing_and_matches_dropless():
    x = tokens_x()
    capped, _ = moe_layer(mode="capacity", capacity_factor=2.0)  # C = 16 = L
    y, stats = capped(x)
    want, _ = dense_reference(capped, x)
    assert_close(y, want)
    assert float(stats["dropped"]) == 0.0


def test_load_balancing_loss_matches_the_switch_formula_by_hand():
    # 4 tokens, 2 experts, top-1. Tokens 0-2 go to expert 0, token 3 to expert 1.
    probs = jnp.array([[[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]]])
    experts = jnp.array([[[0], [0], [0], [1]]])
    loss, fraction = load_balancing_loss(probs, experts)
    # f = (3/4, 1/4), P = (2.6/4, 1.4/4): 2 * (0.75 * 0.65 + 0.25 * 0.35) = 1.15
    np.testing.assert_allclose(fraction, [0.75, 0.25])
    assert float(loss) == pytest.approx(1.15)


def grads_of(layout, moe, devices):
    config = make_config(layout, moe=moe, train={"batch_size": 8})
    trainer = Trainer(config, devices=devices)
    state = initial_state(trainer)
    batch = trainer.put_batch(next(train_batches(config, open_dataset(config))))
    objective, grads = trainer.loss_and_grads(state.params, batch)
    return float(objective), jax.device_get(nnx.to_pure_dict(grads)), trainer, state, batch


@pytest.mark.parametrize("moe", [
    {"num_experts": 4, "capacity_factor": 0.5},  # capacity with drops
    {"num_experts": 4, "mode": "dropless"},
    {"num_experts": 8, "every": 2, "shared_experts": 1, "router": "softmax_then_topk"},
])
def test_expert_parallel_matches_single_device(moe):
    ref = grads_of({"mesh.data": 1}, moe, jax.devices()[:1])
    got = grads_of({"mesh.data": 2, "mesh.expert": 4}, moe, jax.devices())
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layout", [
    {"mesh.data": 8}, {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
    # under expert parallelism: the ragged exchange (tests/test_dropless_ep.py)
    {"mesh.data": 1, "mesh.fsdp": 2, "mesh.expert": 4},
    {"mesh.data": 2, "mesh.expert": 2, "mesh.tensor": 2}])
def test_dropless_layouts_match_single_device(layout):
    moe = {"num_experts": 4, "mode": "dropless"}
    ref = grads_of({"mesh.data": 1}, moe, jax.devices()[:1])
    got = grads_of(layout, moe, jax.devices())
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def step_flops(overrides, devices):
    config = load_config("configs/tiny.yaml", [
        "model.num_layers=2", "model.d_model=64", "model.mlp_dim=128", "moe.num_experts=4",
        "moe.top_k=2", "moe.mode=dropless", "data.seq_len=32", "train.batch_size=16",
        "data.builtin_max_bytes=400000", *overrides])
    trainer = Trainer(config, devices=devices)
    compiled = trainer.compile_step(trainer.abstract_state(), trainer.abstract_batch())
    return compiled.cost_analysis()["flops"]


def test_dropless_work_divides_over_data_parallel_devices():
    """Each device sorts and multiplies only its own sequences: per-device FLOPs of the train
    step on data=8 are about 1/8 of one device's for the same global batch (a global sort made
    every device do all of it: 0.87)."""
    one = step_flops(["mesh.data=1"], jax.devices()[:1])
    eight = step_flops(["mesh.data=8"], jax.devices())
    assert eight <= 0.2 * one, eight / one


def test_expert_parallel_dispatches_with_all_to_all_and_shards_experts():
    _, _, trainer, state, batch = grads_of({"mesh.data": 1, "mesh.expert": 4, "mesh.tensor": 2},
                                           {"num_experts": 4}, jax.devices())
    w_gate = state.params["blocks"]["mlp"]["w_gate"][...]
    assert w_gate.addressable_shards[0].data.shape == (2, 1, 64, 64)  # N, E/4, D, F/2
    hlo = trainer.compile_step(state, batch).as_text()
    assert "all-to-all" in hlo


def max_load_after_training(aux_coef):
    config = make_config({"moe.aux_loss_coef": aux_coef, "train.steps": 40},
                         moe={"num_experts": 8, "top_k": 1, "mode": "dropless"},
                         mesh={"data": 1}, optim={"lr": 1e-2})
    trainer = Trainer(config, devices=jax.devices()[:1])
    batches = train_batches(config, open_dataset(config))
    state = initial_state(trainer)
    loads = []
    for _ in range(config.train.steps):
        state, metrics = trainer.step(state, trainer.put_batch(next(batches)))
        loads.append(float(metrics["moe_max_load"]))
    return np.mean(loads[-10:])


def test_auxiliary_loss_evens_out_expert_load():
    without, with_aux = max_load_after_training(0.0), max_load_after_training(1.0)
    assert with_aux < 0.8 * without, (with_aux, without)


def test_moe_active_parameter_count():
    m = make_config().model
    moe = make_config(moe={"num_experts": 8, "top_k": 2, "every": 2, "shared_experts": 1}).moe
    dense = matmul_params(m)
    # One MoE layer of two: its 3*D*F MLP becomes (top_k + shared) experts plus the router.
    assert matmul_params(m, moe) == dense - 3 * 64 * 128 + 3 * 3 * 64 * 128 + 64 * 8


@pytest.mark.parametrize("overrides, fragment", [
    (["moe.num_experts=6", "mesh.expert=4"], "must be divisible by mesh.expert=4"),
    (["mesh.expert=2"], "needs a mixture-of-experts model"),
    (["moe.num_experts=4", "moe.top_k=5"], "moe.top_k=5 must lie between 1 and"),
    (["moe.num_experts=4", "moe.every=3"], "moe.every=3 must divide model.num_layers=2"),
    (["moe.num_experts=4", "moe.first_dense_layers=2"],
     "moe.first_dense_layers=2 must lie between 0 and model.num_layers - 1 = 1"),
    (["moe.num_experts=4", "model.num_layers=4", "moe.first_dense_layers=1", "moe.every=2"],
     "moe.every=2 must divide the 3 layers after moe.first_dense_layers=1"),
    (["moe.num_experts=4", "model.num_layers=4", "moe.first_dense_layers=1", "mesh.stage=2",
      "mesh.data=1", "pipeline.layers_per_stage=[1,3]"],
     "after the moe.first_dense_layers=1 dense blocks, which run on the first stage"),
])
def test_bad_moe_settings_are_explained(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        config_from_dict({}, overrides)
    assert fragment in str(err.value)


def test_moe_tiny_trains_with_expert_parallelism(tmp_path):
    assert load_config("configs/mixtral-8x7b.yaml").moe.num_experts == 8
    result = subprocess.run(
        [sys.executable, "-m", "jaxtron.train", "--config", "configs/moe-tiny.yaml",
         "train.steps=30", "train.log_every=10", "train.eval_every=30", "train.batch_size=8",
         "data.seq_len=64", f"train.run_dir={tmp_path}", "data.builtin_max_bytes=400000"],
        capture_output=True, text=True, timeout=600, env=long_run_env())
    assert result.returncode == 0, result.stderr[-3000:]
    records = metric_records(tmp_path)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert {"moe_balance", "moe_z", "moe_dropped", "moe_max_load"} <= records[-1].keys()
    assert "expert=4" in result.stdout
