"""Checks that need a GPU: the kernels compiled by Triton and cuDNN, and bf16 training on them.

Run by `python -m jaxtron.gpu_check` or `pytest -m gpu` (the GPU is then JAX's platform). Without a GPU
every test here skips with the reason; on CPU, `test_lowering.py` lowers the same code for
`cuda` and `rocm` and the interpret-mode tests check the kernels' numbers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_flash import check, inputs, output_and_grads, packed

from jaxtron.config.platforms import local_platform
from jaxtron.data.pipeline import open_dataset, train_batches
from jaxtron.kernels.attention import attention
from jaxtron.kernels.reference import reference_attention
from jaxtron.training.trainer import Trainer

from conftest import make_config

GPU = local_platform() in ("cuda", "rocm")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not GPU, reason=f"needs a GPU; this machine runs JAX on "
                                                 f"{local_platform()}")]
BF16_TOL = 2e-2  # a few bf16 roundings of 2^-8 each, as in test_flash.test_matches_reference_bf16


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal,segments", [(True, False), (False, False), (True, True)])
def test_triton_flash_matches_reference_bf16(head_dim, causal, segments):
    # 1000 tokens: 16 tiles of 64, the last one part padding; 8 query heads on 2 kv heads.
    q, k, v, cotangent = inputs(heads=8, kv_heads=2, length=1000, dim=head_dim,
                                dtype=jnp.bfloat16)
    check(q, k, v, cotangent, causal=causal, tol=BF16_TOL,
          segment_ids=packed(2, 1000) if segments else None)


def test_triton_flash_fp32_uses_the_same_kernels():
    q, k, v, cotangent = inputs(heads=4, kv_heads=4, length=256, dim=64)
    # Triton's fp32 dots may use TF32 (10-bit mantissas): bf16-class tolerance.
    check(q, k, v, cotangent, causal=True, tol=BF16_TOL)


@pytest.mark.skipif(local_platform() != "cuda", reason="cuDNN needs an NVIDIA GPU")
def test_cudnn_matches_reference_bf16():
    q, k, v, cotangent = inputs(heads=8, kv_heads=2, length=1024, dim=128, dtype=jnp.bfloat16)
    got = output_and_grads(lambda *a: attention(*a, causal=True, impl="cudnn"), q, k, v,
                           cotangent)
    want = output_and_grads(lambda *a: reference_attention(*a, causal=True),
                            *[x.astype(jnp.float32) for x in (q, k, v)], cotangent)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1])):
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=BF16_TOL,
                                   atol=BF16_TOL * float(jnp.abs(w).max()), err_msg=name)


@pytest.mark.parametrize("segments", [False, True])
def test_triton_flash_with_a_sliding_window_matches_reference_bf16(segments):
    # A 200-key window over 1000 tokens: the band crosses tile edges and skips whole tiles.
    q, k, v, cotangent = inputs(heads=8, kv_heads=2, length=1000, dim=128, dtype=jnp.bfloat16)
    check(q, k, v, cotangent, causal=True, window=200, tol=BF16_TOL,
          segment_ids=packed(2, 1000) if segments else None)


@pytest.mark.skipif(local_platform() != "cuda", reason="cuDNN needs an NVIDIA GPU")
def test_cudnn_with_a_sliding_window_matches_reference_bf16():
    q, k, v, cotangent = inputs(heads=8, kv_heads=2, length=1024, dim=128, dtype=jnp.bfloat16)
    got = output_and_grads(lambda *a: attention(*a, causal=True, impl="cudnn", window=256),
                           q, k, v, cotangent)
    want = output_and_grads(lambda *a: reference_attention(*a, causal=True, window=256),
                            *[x.astype(jnp.float32) for x in (q, k, v)], cotangent)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1])):
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=BF16_TOL,
                                   atol=BF16_TOL * float(jnp.abs(w).max()), err_msg=name)


def train(overrides: dict, steps: int = 3, devices=None):
    config = make_config({"optim.lr": 1e-2, "optim.warmup_steps": 1, **overrides},
                         model={"num_layers": 4, "d_model": 256, "num_heads": 4,
                                "num_kv_heads": 2, "mlp_dim": 512},
                         data={"seq_len": 256})
    devices = devices or jax.devices()[:1]
    trainer = Trainer(config, devices=devices)
    batches = train_batches(config, open_dataset(config))
    state, losses = trainer.init_state(), []
    for _ in range(steps):
        state, metrics = trainer.step(state, trainer.put_batch(next(batches)))
        losses.append(float(metrics["loss"]))
    return trainer, losses, jax.device_get(nnx.to_pure_dict(trainer.to_model_params(
        state.params)))


@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_bf16_train_step_tracks_the_fp32_step(impl):
    """`model.dtype: auto` is bf16 on a GPU; its losses follow the fp32 run's to bf16 precision
    over three updates, with the attention kernel `impl` picks (cuDNN or Triton)."""
    trainer, bf16, _ = train({"model.attention_impl": impl, "mesh.data": 1})
    assert trainer.config.model.dtype == "bfloat16"
    _, fp32, _ = train({"model.attention_impl": "xla", "model.dtype": "float32",
                        "mesh.data": 1})
    assert len(set(fp32)) == 3, fp32  # the updates changed the loss
    np.testing.assert_allclose(bf16, fp32, rtol=BF16_TOL)


@pytest.mark.parametrize("mode", ["tensorwise", "delayed"])
def test_fp8_train_steps_track_the_bf16_steps(mode):
    """fp8 matmuls (cuBLASLt fp8 GEMMs on Hopper) against bf16 over three updates: within a
    few percent, as the CPU run of tests/test_fp8.py is after 40 steps. At this model's usual
    rate (1e-2) the third update falls steeply and amplifies any rounding (delayed scaling ends
    6% off on an H200, 1.5% on CPU), so the rate here is 3e-3: all modes within 0.8% on CPU."""
    smooth = {"mesh.data": 1, "optim.lr": 3e-3}
    _, fp8, _ = train({"model.fp8": mode, **smooth})
    _, bf16, _ = train(smooth)
    assert len(set(bf16)) == 3, bf16  # the updates changed the loss
    np.testing.assert_allclose(fp8, bf16, rtol=0.03)


@pytest.mark.skipif(len([d for d in jax.devices() if d.platform != "cpu"]) < 2,
                    reason="1F1B needs at least 2 GPUs")
def test_1f1b_on_two_gpus_matches_one_gpu():
    devices = jax.devices()[:2]
    _, piped, piped_params = train({"mesh.data": 1, "mesh.stage": 2,
                                    "pipeline.microbatches": 2, "model.dtype": "float32"},
                                   devices=devices)
    _, single, single_params = train({"mesh.data": 1, "model.dtype": "float32"})
    np.testing.assert_allclose(piped, single, rtol=1e-4)
    for got, want in zip(jax.tree.leaves(piped_params), jax.tree.leaves(single_params),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)
