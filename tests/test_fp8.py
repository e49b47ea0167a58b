"""FP8 matmuls (`model.fp8: tensorwise`): the custom gradient equals the derivative of the
quantised product written out in numpy, training tracks fp32, shardings equal one device, and
a step lowered for CUDA multiplies fp8 operands."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.kernels.fp8 import E4M3, E5M2, fp8_einsum
from jaxtron.trainer import Trainer

from conftest import make_config


def numpy_quantize(x, dtype):
    scale = np.abs(x).max() / float(jnp.finfo(dtype).max)
    return np.asarray(jnp.asarray(x / scale, jnp.float32).astype(dtype).astype(jnp.float32),
                      np.float64), scale


def test_forward_and_gradients_equal_the_quantised_products():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 16)).astype(np.float32)
    w = rng.normal(size=(16, 4, 8)).astype(np.float32)
    g = rng.normal(size=(2, 5, 4, 8)).astype(np.float32)
    y, vjp = jax.vjp(lambda a, b: fp8_einsum("bld,dhk->blhk", a, b), x, w)
    dx, dw = vjp(jnp.asarray(g))
    xq, sx = numpy_quantize(x, E4M3)
    wq, sw = numpy_quantize(w, E4M3)
    gq, sg = numpy_quantize(g, E5M2)
    np.testing.assert_allclose(y, np.einsum("bld,dhk->blhk", xq, wq) * sx * sw, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(dx, np.einsum("blhk,dhk->bld", gq, wq) * sg * sw, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(dw, np.einsum("bld,blhk->dhk", xq, gq) * sx * sg, rtol=1e-5,
                               atol=1e-5)
    exact = np.einsum("bld,dhk->blhk", x, w)
    error = np.abs(np.asarray(y) - exact).max() / np.abs(exact).max()
    assert 1e-4 < error < 0.1  # quantised, not exact, and not wrong


def losses(fp8, steps, mesh=None, devices=1, moe=None):
    config = make_config({"train.steps": steps}, model={"fp8": fp8}, moe=moe or {},
                         mesh=mesh or {"data": 1}, optim={"warmup_steps": 5})
    trainer = Trainer(config, devices=jax.devices()[:devices])
    state = trainer.init_state()
    tokens = np.random.default_rng(2).integers(0, 256, (8, 33)).astype(np.int32)
    out = []
    for _ in range(steps):
        state, metrics = trainer.step(state, trainer.put_batch({"tokens": tokens}))
        out.append(float(metrics["loss"]))
    return out


def test_fp8_training_tracks_fp32():
    plain, fp8 = losses("none", 40), losses("tensorwise", 40)
    assert fp8[-1] < fp8[0] - 1.0  # it learns
    assert abs(fp8[-1] - plain[-1]) / plain[-1] < 0.02


@pytest.mark.parametrize("mesh, moe", [
    ({"data": 2, "fsdp": 2, "tensor": 2}, None),
    # experts in fp8 inside the all-to-all shard_map: amax over the whole tensor, and the
    # weight gradients summed over the batch axes
    ({"data": 2, "expert": 2}, {"num_experts": 4, "top_k": 2}),
])
def test_sharded_fp8_equals_one_device(mesh, moe):
    want = losses("tensorwise", 3, moe=moe)
    got = losses("tensorwise", 3, mesh=mesh, devices=int(np.prod(list(mesh.values()))),
                 moe=moe)
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_a_cuda_lowered_step_multiplies_fp8():
    trainer = Trainer(make_config(model={"fp8": "tensorwise"}), platform="cuda")
    text = trainer.lower_step().as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert any("f8E4M3FN" in line for line in dots)
    assert any("f8E5M2" in line for line in dots)  # the gradients' format
