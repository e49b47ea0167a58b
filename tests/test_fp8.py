"""FP8 matmuls (`model.fp8: tensorwise | delayed`): the custom gradient equals the derivative
of the quantised product written out in numpy, delayed scales come from the amax history and
the step writes this step's amaxes into it, training tracks fp32, shardings (and accumulation)
equal one device, the history survives a checkpoint bitwise, and a step lowered for CUDA
multiplies fp8 operands."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtron.checkpoint.manager import Checkpointer, CheckpointError
from jaxtron.checkpoint.params import save_params
from jaxtron.config.loading import config_from_dict, config_to_dict
from jaxtron.kernels.fp8 import E4M3, E5M2, fp8_delayed_einsum, fp8_einsum, fp8_grouped_matmul
from jaxtron.training.trainer import Trainer

from conftest import initial_state, make_config


def numpy_quantize(x, dtype, amax=None):
    largest = float(jnp.finfo(dtype).max)
    scale = (np.abs(x).max() if amax is None else amax) / largest
    scaled = np.clip(x / scale, -largest, largest)
    return np.asarray(jnp.asarray(scaled, jnp.float32).astype(dtype).astype(jnp.float32),
                      np.float64), scale


def assert_quantised_products(spec, got, x, w, g):
    """(y, dx, dw) equal the products of the numpy-quantised (value, scale) pairs."""
    (xq, sx), (wq, sw), (gq, sg) = x, w, g
    a, b, out = spec.replace("->", ",").split(",")
    want = (np.einsum(spec, xq, wq) * sx * sw, np.einsum(f"{out},{b}->{a}", gq, wq) * sg * sw,
            np.einsum(f"{a},{out}->{b}", xq, gq) * sx * sg)
    for name, value, expected in zip(("y", "dx", "dw"), got, want):
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5, err_msg=name)


def test_forward_and_gradients_equal_the_quantised_products():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 16)).astype(np.float32)
    w = rng.normal(size=(16, 4, 8)).astype(np.float32)
    g = rng.normal(size=(2, 5, 4, 8)).astype(np.float32)
    y, vjp = jax.vjp(lambda a, b: fp8_einsum("bld,dhk->blhk", a, b), x, w)
    dx, dw = vjp(jnp.asarray(g))
    assert_quantised_products("bld,dhk->blhk", (y, dx, dw), numpy_quantize(x, E4M3),
                              numpy_quantize(w, E4M3), numpy_quantize(g, E5M2))
    exact = np.einsum("bld,dhk->blhk", x, w)
    error = np.abs(np.asarray(y) - exact).max() / np.abs(exact).max()
    assert 1e-4 < error < 0.1  # quantised, not exact, and not wrong


def test_delayed_scales_come_from_the_history_and_the_amaxes_come_back():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 5, 16)).astype(np.float32)
    w = rng.normal(size=(16, 8)).astype(np.float32)
    g = rng.normal(size=(2, 5, 8)).astype(np.float32)
    # Past amaxes below the current ones for x (so it saturates), above for w and g.
    history = np.zeros((4, 3), np.float32)
    history[1:3] = [[1.5, 9.0, 7.0], [2.0, 3.0, 1.0]]
    y, vjp = jax.vjp(lambda a, b, h: fp8_delayed_einsum("bld,df->blf", a, b, h), x, w,
                     jnp.asarray(history))
    dx, dw, observed = vjp(jnp.asarray(g))
    assert_quantised_products("bld,df->blf", (y, dx, dw), numpy_quantize(x, E4M3, amax=2.0),
                              numpy_quantize(w, E4M3, amax=9.0),
                              numpy_quantize(g, E5M2, amax=7.0))
    np.testing.assert_array_equal(observed[0], [np.abs(a).max() for a in (x, w, g)])
    np.testing.assert_array_equal(observed[1:], 0)
    # An empty history (the first step) scales by the current amaxes, as tensorwise does.
    empty = jnp.zeros((4, 3), jnp.float32)
    np.testing.assert_array_equal(fp8_delayed_einsum("bld,df->blf", x, w, empty),
                                  fp8_einsum("bld,df->blf", x, w))


def test_dropless_experts_grouped_matmul_equals_the_quantised_products():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 6, 8)).astype(np.float32)
    w = rng.normal(size=(3, 8, 5)).astype(np.float32)
    g = rng.normal(size=(2, 6, 5)).astype(np.float32)
    sizes = np.array([[2, 1, 3], [0, 4, 2]], np.int32)
    y, vjp = jax.vjp(lambda a, b: fp8_grouped_matmul(a, b, jnp.asarray(sizes)), x, w)
    dx, dw = vjp(jnp.asarray(g))
    (xq, sx), (wq, sw), (gq, sg) = (numpy_quantize(x, E4M3), numpy_quantize(w, E4M3),
                                    numpy_quantize(g, E5M2))
    # Row b's assignments a belong to experts in the order of sizes[b]: a plain loop.
    want_y, want_dx, want_dw = np.zeros(y.shape), np.zeros(x.shape), np.zeros(w.shape)
    for b in range(2):
        expert_of = np.repeat(np.arange(3), sizes[b])
        for a, e in enumerate(expert_of):
            want_y[b, a] = xq[b, a] @ wq[e] * sx * sw
            want_dx[b, a] = wq[e] @ gq[b, a] * sw * sg
            want_dw[e] += np.outer(xq[b, a], gq[b, a]) * sx * sg
    for name, got, want in (("y", y, want_y), ("dx", dx, want_dx), ("dw", dw, want_dw)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


def run(fp8, steps, mesh=None, devices=1, moe=None, **settings):
    config = make_config({"train.steps": steps, **settings},
                         model={"fp8": fp8, "fp8_amax_history": 4}, moe=moe or {},
                         mesh=mesh or {"data": 1}, optim={"warmup_steps": 5})
    trainer = Trainer(config, devices=jax.devices()[:devices])
    state = initial_state(trainer)
    tokens = np.random.default_rng(2).integers(0, 256, (8, 33)).astype(np.int32)
    out = []
    for _ in range(steps):
        state, metrics = trainer.step(state, trainer.put_batch({"tokens": tokens}))
        out.append(float(metrics["loss"]))
    return out, trainer, state


def losses(fp8, steps, **kwargs):
    return run(fp8, steps, **kwargs)[0]


def histories(trainer, state):
    params = nnx.to_pure_dict(trainer.canonical_state(state).params)
    return [np.asarray(block[part]["fp8_amax_history"]) for block in (params["blocks"],)
            for part in ("attn", "mlp")]


def test_fp8_training_tracks_fp32():
    plain = losses("none", 40)
    for mode in ("tensorwise", "delayed"):
        fp8 = losses(mode, 40)
        assert fp8[-1] < fp8[0] - 1.0, mode  # it learns
        assert abs(fp8[-1] - plain[-1]) / plain[-1] < 0.02, mode


@pytest.mark.parametrize("fp8, mesh, moe, settings", [
    ("tensorwise", {"data": 2, "fsdp": 2, "tensor": 2}, None, {}),
    # experts in fp8 inside the all-to-all shard_map: amax over the whole tensor, and the
    # weight gradients summed over the batch axes
    ("tensorwise", {"data": 2, "expert": 2}, {"num_experts": 4, "top_k": 2}, {}),
    # dropless experts: one grouped matmul per sequence, rows split over data and fsdp
    ("tensorwise", {"data": 2, "fsdp": 2}, {"num_experts": 4, "top_k": 2, "mode": "dropless"},
     {}),
    ("delayed", {"data": 2, "fsdp": 2, "tensor": 2}, None, {}),
    # accumulation and one data-parallel reduction per step (ZeRO-2): amaxes reduced by max
    ("delayed", {"data": 2, "fsdp": 2}, None, {"optim.grad_accum": 2, "optim.zero_stage": 2}),
])
def test_sharded_fp8_equals_one_device(fp8, mesh, moe, settings):
    want, one, one_state = run(fp8, 3, moe=moe, **settings)
    got, many, many_state = run(fp8, 3, mesh=mesh, devices=int(np.prod(list(mesh.values()))),
                                moe=moe, **settings)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    if fp8 == "delayed":
        # With accumulation each microbatch quantises its own tensors (the first step by
        # their current amaxes) and the history keeps the largest, gradients per unit of the
        # step's loss: other row groupings give other maxima of the same size, where a sum or
        # a mean over microbatches or ranks would be 2-4x off.
        tol = 0.1 if "optim.grad_accum" in settings else 1e-5
        for a, b in zip(histories(many, many_state), histories(one, one_state), strict=True):
            np.testing.assert_allclose(a, b, rtol=tol)
            assert (a[:, :, :3] > 0).all() and (a[:, :, 3:] == 0).all()  # 3 steps recorded


def test_delayed_scaling_history_round_trips_a_checkpoint_bitwise(tmp_path):
    _, trainer, state = run("delayed", 2)
    checkpoints = Checkpointer(tmp_path, keep=1)
    checkpoints.save(2, trainer.canonical_state(state), {}, trainer.config)
    checkpoints.wait()
    restored, _ = checkpoints.restore(2, trainer.abstract_canonical_state(), trainer.config)
    restored = trainer.from_canonical_state(restored)
    for a, b in zip(histories(trainer, restored), histories(trainer, state), strict=True):
        np.testing.assert_array_equal(a, b)
    pure = jax.device_get(nnx.to_pure_dict(trainer.canonical_state(state).params))
    batch = trainer.put_batch({"tokens": np.ones((8, 33), np.int32)})
    np.testing.assert_array_equal(trainer.step(restored, batch)[1]["loss"],
                                  trainer.step(state, batch)[1]["loss"])
    # Resuming in another mode would drop or invent the histories: refused by name.
    other = config_from_dict(config_to_dict(trainer.config), ["model.fp8=tensorwise"])
    with pytest.raises(CheckpointError, match="model.fp8=delayed"):
        checkpoints.restore(2, Trainer(other, devices=jax.devices()[:1]).abstract_canonical_state(),
                            other)
    # Exports hold weights only; loading one for delayed fp8 starts empty histories.
    save_params(tmp_path / "export", trainer.config, pure)
    loaded = nnx.to_pure_dict(trainer.params_from(tmp_path / "export"))
    assert not np.asarray(loaded["blocks"]["mlp"]["fp8_amax_history"]).any()
    np.testing.assert_array_equal(loaded["blocks"]["mlp"]["w_up"], pure["blocks"]["mlp"]["w_up"])


def test_delayed_fp8_on_a_pipeline_is_refused():
    with pytest.raises(Exception, match="model.fp8=delayed"):
        make_config(model={"fp8": "delayed"}, mesh={"stage": 2})


@pytest.mark.parametrize("mode, moe", [("tensorwise", {}), ("delayed", {}),
                                       ("tensorwise", {"num_experts": 4, "mode": "dropless"})])
def test_a_cuda_lowered_step_multiplies_fp8(mode, moe):
    trainer = Trainer(make_config(model={"fp8": mode}, moe=moe), platform="cuda")
    text = trainer.lower_step().as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert any("f8E4M3FN" in line for line in dots)
    assert any("f8E5M2" in line for line in dots)  # the gradients' format
    if moe:  # the experts' grouped matmuls, forward and both transposes
        grouped = [line for line in text.splitlines() if "ragged_dot" in line]
        assert len(grouped) >= 9 and all("f8E" in line for line in grouped)
