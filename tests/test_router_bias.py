"""Auxiliary-loss-free balancing: a routing bias that chooses experts, moved by expert loads."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.checkpoint.manager import Checkpointer
from jaxtron.data.pipeline import open_dataset, train_batches
from jaxtron.models.moe import route, update_router_bias
from jaxtron.training.trainer import Trainer

from conftest import initial_state, make_config


def test_the_bias_moves_the_choice_but_not_the_weights():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 6)).astype(np.float32)
    bias = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 10.0], np.float32)  # expert 5 always chosen
    for score in ("softmax", "sigmoid"):
        weights, experts, _ = route(jnp.asarray(logits), 2, "topk_then_softmax", score=score,
                                    bias_E=jnp.asarray(bias))
        assert (np.asarray(experts)[..., 0] == 5).all()
        s = 1 / (1 + np.exp(-logits)) if score == "sigmoid" else logits
        chosen = np.take_along_axis(s, np.asarray(experts), -1)
        want = (chosen / chosen.sum(-1, keepdims=True) if score == "sigmoid" else
                np.exp(chosen) / np.exp(chosen).sum(-1, keepdims=True))
        np.testing.assert_allclose(weights, want, rtol=1e-5)


def test_bias_update_is_the_sign_of_each_experts_load_error():
    load = np.array([[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]], np.float32)
    params = nnx.State({"blocks": {"mlp": {"router_bias": nnx.Param(jnp.zeros((2, 4))),
                                           "router": nnx.Param(jnp.ones((2, 3, 4)))}}})
    moved = update_router_bias(params, jnp.asarray(load), 0.1)
    np.testing.assert_allclose(moved["blocks"]["mlp"]["router_bias"][...],
                               [[-0.1, 0.0, 0.0, 0.1], [0.0, 0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(moved["blocks"]["mlp"]["router"][...], np.ones((2, 3, 4)))


def moe_config(rate, optim=None, **extra):
    return make_config(moe={"num_experts": 8, "top_k": 2, "mode": "dropless",
                            "aux_loss_coef": 0.0, "z_loss_coef": 0.0, "bias_update_rate": rate},
                       model={"num_layers": 2}, train={"batch_size": 8, "steps": 100},
                       optim={"lr": 3e-3, **(optim or {})}, **extra)


def max_loads(rate, steps=100):
    config = moe_config(rate)
    trainer = Trainer(config, devices=jax.devices()[:1])
    state = initial_state(trainer)
    batches = train_batches(config, open_dataset(config))
    loads = []
    for _ in range(steps):
        state, metrics = trainer.step(state, trainer.put_batch(next(batches)))
        loads.append(float(metrics["moe_max_load"]))
    return np.array(loads), trainer, state


def test_bias_lowers_the_max_expert_load_and_resumes_bitwise(tmp_path):
    without, _, _ = max_loads(0.0)
    with_bias, trainer, state = max_loads(1e-2)
    late = slice(50, None)
    # max_load is E x the busiest expert's share (1 = perfect balance).
    print(f"max load over steps 50-100: without bias {without[late].mean():.3f}, "
          f"with bias {with_bias[late].mean():.3f}")
    assert with_bias[late].mean() < without[late].mean() - 0.1
    bias = trainer.to_model_params(state.params)["blocks"]["mlp"]["router_bias"][...]
    assert np.abs(np.asarray(bias)).max() > 0  # moved, and not by the optimizer alone

    checkpoints = Checkpointer(tmp_path, keep=1)
    checkpoints.save(100, trainer.canonical_state(state), {"next_index": 0}, trainer.config)
    checkpoints.wait()
    restored, _ = checkpoints.restore(100, trainer.abstract_canonical_state(), trainer.config)
    np.testing.assert_array_equal(
        restored.params["blocks"]["mlp"]["router_bias"][...], np.asarray(bias))
    checkpoints.close()


def test_bias_moves_alike_on_a_pipeline_and_one_device():
    def bias_after_steps(devices, **sections):
        config = moe_config(0.01, **sections)
        trainer = Trainer(config, devices=jax.devices()[:devices])
        state = initial_state(trainer)
        batches = train_batches(config, open_dataset(config))
        for _ in range(3):  # an odd number of +-rate moves: never back to exactly 0
            state, _ = trainer.step(state, trainer.put_batch(next(batches)))
        params = trainer.to_model_params(state.params)
        return np.asarray(params["blocks"]["mlp"]["router_bias"][...])

    want = bias_after_steps(1, optim={"grad_accum": 2})
    got = bias_after_steps(4, mesh={"stage": 2, "data": 2}, pipeline={"microbatches": 2})
    assert np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)
