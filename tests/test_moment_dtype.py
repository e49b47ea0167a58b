"""Adam moments stored in bf16: half the optimizer state, the same training to bf16 precision.

The reference is optax's own AdamW in fp32 with the same schedule and mask: after a few steps
the bf16-moment run's parameters must match it to the moments' rounding, and its state must
really be bf16 (the planner counts 2 bytes per moment element from the same field).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.training.optimizers import moments_stored_as
from jaxtron.training.trainer import Trainer

from conftest import make_config


def test_bf16_moments_are_stored_in_bf16_and_track_fp32_adam():
    import optax

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)}
    grads = [{"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)} for _ in range(5)]
    fp32 = optax.adamw(1e-2, b1=0.9, b2=0.95)
    bf16 = moments_stored_as(optax.adamw(1e-2, b1=0.9, b2=0.95), "bfloat16")
    p32, s32, p16, s16 = params, fp32.init(params), params, bf16.init(params)
    for g in grads:
        u32, s32 = fp32.update(g, s32, p32)
        p32 = optax.apply_updates(p32, u32)
        u16, s16 = bf16.update(g, s16, p16)
        p16 = optax.apply_updates(p16, u16)
    floats = [a for a in jax.tree.leaves(s16) if jnp.issubdtype(a.dtype, jnp.floating)]
    assert floats and all(a.dtype == jnp.bfloat16 for a in floats)
    assert any(a.dtype == jnp.int32 for a in jax.tree.leaves(s16))  # the step count stays int
    step = np.abs(np.asarray(p32["w"] - params["w"])).mean()
    gap = np.abs(np.asarray(p16["w"] - p32["w"])).max()
    assert 0 < gap < 0.02 * step * 5  # rounding of the moments, not a different optimizer
    mu32, mu16 = s32[0].mu["w"], s16[0].mu["w"]
    np.testing.assert_allclose(np.asarray(mu16, np.float32), mu32, rtol=2e-2, atol=3e-3)


def test_a_run_with_bf16_moments_trains_and_halves_the_state():
    def state_bytes(moments):
        trainer = Trainer(make_config(optim={"moment_dtype": moments}),
                          devices=jax.devices()[:1])
        state = trainer.abstract_state()
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state.opt_state)
                   if jnp.issubdtype(a.dtype, jnp.floating))

    assert state_bytes("bfloat16") * 2 == state_bytes("float32")
    trainer = Trainer(make_config(optim={"moment_dtype": "bfloat16"}),
                      devices=jax.devices()[:2])
    state = trainer.init_state()
    tokens = np.random.default_rng(1).integers(0, 256, (8, 33)).astype(np.int32)
    batch = trainer.put_batch({"tokens": tokens})
    losses = []
    for _ in range(4):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
