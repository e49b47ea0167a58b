"""GPU and TPU code checked on this CPU machine: lowered for `cuda`, `rocm` and `tpu`.

`jax.jit(f).trace(...).lower(lowering_platforms=(p,))` needs no device of platform p. The
lowered module names the kernels chosen: `__gpu$xla.gpu.triton` custom calls carry each Pallas
kernel's name and launch parameters; splash attention becomes `tpu_custom_call`s. A kernel that
Triton or Mosaic cannot take (the wrong Pallas backend, illegal TPU block shapes) raises here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.kernels.attention import attention
from jaxtron.kernels.choice import Kernel, configured_kernel
from jaxtron.kernels.flash import flash_attention
from jaxtron.training.trainer import Trainer

from attention_oracle import reference_attention
from conftest import make_config

TRITON = "__gpu$xla.gpu.triton"
TPU_KERNEL = "tpu_custom_call"
FLASH_KERNELS = ("flash_attention_forward", "flash_attention_dq", "flash_attention_dkdv")
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def lowered_text(fn, *args, platform: str) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def forward_and_backward(kernel, causal, segments):
    """sum(out) and its gradients: the forward and both backward kernels in one program."""
    def loss(q, k, v):
        seg = None
        if segments:
            seg = jnp.broadcast_to((jnp.arange(q.shape[1]) >= q.shape[1] // 3).astype(jnp.int32),
                                   q.shape[:2])
        return kernel(q, k, v, causal=causal, segment_ids=seg).astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


def shapes(head_dim, dtype, length=256, heads=8, kv_heads=2):
    return (jax.ShapeDtypeStruct((2, length, heads, head_dim), dtype),
            jax.ShapeDtypeStruct((2, length, kv_heads, head_dim), dtype),
            jax.ShapeDtypeStruct((2, length, kv_heads, head_dim), dtype))


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_flash_lowers_to_triton_kernels_for_gpus(platform, dtype):
    """Head dims 64, 96 (padded to 128 for Triton) and 128, grouped-query attention (8 query
    heads on 2 kv heads), causal or not, with or without packed segments: forward and backward
    lower to the three Triton kernels with explicit launch parameters, never Mosaic GPU."""
    for head_dim in (64, 96, 128):
        for causal in (True, False):
            for segments in (False, True):
                grads = forward_and_backward(flash_attention, causal, segments)
                text = lowered_text(grads, *shapes(head_dim, dtype), platform=platform)
                case = f"{platform} {jnp.dtype(dtype).name} d={head_dim} causal={causal}"
                assert text.count(TRITON) == 3, case
                for name in FLASH_KERNELS:
                    assert f'name = "{name}"' in text, (case, name)
                warps = 4 if head_dim <= 64 else 8
                assert f"num_warps = {warps} : i32" in text, case
                assert "mosaic_gpu" not in text, case


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_pallas_attention_lowers_to_splash_for_tpu(dtype):
    """On TPU `pallas` (and `auto`) run JAX's splash attention: forward, dq and dkv kernels."""
    for head_dim in (64, 96, 128):
        for causal in (True, False):
            for segments in (False, True):
                def kernel(q, k, v, **kw):
                    return attention(q, k, v, impl="pallas", **kw)
                grads = forward_and_backward(kernel, causal, segments)
                # 200 tokens: padded to a whole 256 block inside the wrapper.
                text = lowered_text(grads, *shapes(head_dim, dtype, length=200), platform="tpu")
                assert text.count(TPU_KERNEL) == 3, (head_dim, causal, segments)
                assert TRITON not in text


def test_one_jitted_attention_lowers_to_each_platforms_kernel():
    """Outside a Trainer the platform is decided at lowering: the same traced function becomes
    blockwise XLA on CPU (and still computes attention), Triton on CUDA and ROCm (cuDNN is
    absent on this machine) and splash on TPU."""
    q, k, v = (jax.random.normal(key, s.shape, jnp.float32) for key, s in
               zip(jax.random.split(jax.random.key(0), 3), shapes(64, jnp.float32, length=128)))
    traced = jax.jit(lambda q, k, v: attention(q, k, v, impl="auto")).trace(q, k, v)
    texts = {p: traced.lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "cuda",
                                                                          "rocm", "tpu")}
    assert TRITON not in texts["cpu"] and TPU_KERNEL not in texts["cpu"]
    assert TRITON in texts["cuda"] and TRITON in texts["rocm"]
    assert TPU_KERNEL in texts["tpu"] and TRITON not in texts["tpu"]
    out = traced.lower(lowering_platforms=("cpu",)).compile()(q, k, v)
    np.testing.assert_allclose(out, reference_attention(q, k, v, causal=True), rtol=1e-5,
                               atol=1e-5)


# Every layout of the list, on the tiny model (4 query heads of 16 on 2 kv heads).
LAYOUTS = {
    "data": {"mesh.data": 8},
    "fsdp": {"mesh.data": 1, "mesh.fsdp": 8},
    "tensor_sequence_parallel": {"mesh.data": 4, "mesh.tensor": 2,
                                 "mesh.sequence_parallel": True},
    "ring_context_parallel": {"mesh.data": 2, "mesh.sequence": 4},
    "1f1b": {"mesh.data": 4, "mesh.stage": 2, "pipeline.microbatches": 2},
    "interleaved": {"mesh.data": 4, "mesh.stage": 2, "pipeline.schedule": "interleaved",
                    "pipeline.virtual_stages": 2, "pipeline.microbatches": 2,
                    "model.num_layers": 4},
    "zb_h1": {"mesh.data": 4, "mesh.stage": 2, "pipeline.microbatches": 2,
              "pipeline.schedule": "zb-h1"},
    "zbv": {"mesh.data": 4, "mesh.stage": 2, "pipeline.microbatches": 2,
            "pipeline.schedule": "zbv", "pipeline.virtual_stages": 2, "model.num_layers": 4},
    # the backward from the residuals the forward stored, through the flash kernels' rules
    "zb_h1_stored": {"mesh.data": 4, "mesh.stage": 2, "pipeline.microbatches": 2,
                     "pipeline.schedule": "zb-h1", "pipeline.recompute": False},
    "expert_capacity": {"mesh.data": 4, "mesh.expert": 2, "moe.num_experts": 4},
    "expert_dropless": {"mesh.data": 4, "mesh.expert": 2, "moe.num_experts": 4,
                        "moe.mode": "dropless"},
    "dropless": {"mesh.data": 8, "moe.num_experts": 4, "moe.mode": "dropless"},
    "zero2": {"mesh.data": 8, "optim.zero_stage": 2},
    "grad_accum": {"mesh.data": 8, "optim.grad_accum": 2, "train.batch_size": 16},
    # Packed documents: segment ids reach every kernel (cuDNN would fall back to Triton).
    "packed_documents": {"mesh.data": 8, "data.packing": "documents",
                         "data.eod_mask_loss": True},
    "packed_1f1b": {"mesh.data": 4, "mesh.stage": 2, "pipeline.microbatches": 2,
                    "data.packing": "documents"},
}


def lowered_step(overrides: dict, platform: str) -> tuple[Trainer, str]:
    trainer = Trainer(make_config(overrides), platform=platform)
    return trainer, trainer.lower_step().as_text()


@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_train_step_lowers_for_every_layout(layout, platform):
    trainer, text = lowered_step(LAYOUTS[layout], platform)
    assert trainer.config.model.dtype == "bfloat16"  # model.dtype: auto on an accelerator
    assert "bf16" in text
    kernel = configured_kernel(trainer.config, platform, cudnn_traceable=False)
    if layout == "ring_context_parallel":
        assert kernel is Kernel.RING and TRITON not in text and TPU_KERNEL not in text
    elif platform == "tpu":
        assert kernel is Kernel.SPLASH and text.count(TPU_KERNEL) >= 3
    else:
        assert kernel is Kernel.TRITON
        for name in FLASH_KERNELS:
            assert f'name = "{name}"' in text, name


@pytest.mark.parametrize("platform,dtype,kernel", [
    ("cpu", "float32", Kernel.XLA), ("cuda", "bfloat16", Kernel.TRITON),
    ("rocm", "bfloat16", Kernel.TRITON), ("tpu", "bfloat16", Kernel.SPLASH)])
def test_defaults_resolve_to_a_combination_that_lowers(platform, dtype, kernel):
    """`model.dtype: auto` and `model.attention_impl: auto`, nothing else set: bf16 on
    accelerators, fp32 on CPU, and a kernel that lowers (cuDNN would be CUDA's choice where it
    is installed; without it here, Triton)."""
    trainer, text = lowered_step({}, platform)
    assert trainer.config.model.dtype == dtype
    assert configured_kernel(trainer.config, platform, cudnn_traceable=False) is kernel
    assert configured_kernel(make_config({}), "cuda") is Kernel.CUDNN
    if kernel is Kernel.TRITON:
        assert TRITON in text
    elif kernel is Kernel.SPLASH:
        assert TPU_KERNEL in text
    else:
        assert TRITON not in text and TPU_KERNEL not in text


def test_jax_triton_reference_kernel_of_the_benchmark_lowers_for_cuda():
    from jaxtron.kernels.speed import jax_triton_attention

    grads = forward_and_backward(lambda q, k, v, causal, segment_ids: jax_triton_attention(
        q, k, v, causal=causal), True, False)
    assert TRITON in lowered_text(grads, *shapes(128, jnp.bfloat16), platform="cuda")


def test_dry_run_for_a_gpu_from_this_machine(capsys):
    from jaxtron import train

    assert train.main(["--config", "configs/tiny.yaml", "--dry-run", "--target", "cuda",
                       "mesh.data=2", "mesh.tensor=4"]) == 0
    out = capsys.readouterr().out
    assert "dry run for cuda on this cpu machine" in out
    assert "compute bfloat16 (model.dtype=auto)" in out
    assert "auto -> cuDNN flash attention; cuDNN cannot be lowered" in out  # Triton instead
    assert "lowered the train step for cuda" in out and "3 Pallas kernel calls" in out
    assert "planner's estimate" in out


@pytest.mark.parametrize("args, fragment", [
    (["--target", "tpu", "model.attention_impl=cudnn"],
     "model.attention_impl=cudnn needs an NVIDIA GPU (CUDA), but the step is built for tpu"),
    (["--target", "tpu", "model.dtype=float16"], "model.dtype=float16 is not a TPU compute"),
    (["--target", "cuda", "model.attention_impl=cudnn", "model.dtype=float32"],
     "model.attention_impl=cudnn needs bf16 or fp16 compute"),
])
def test_dry_run_refuses_what_the_target_cannot_run(args, fragment, capsys):
    from jaxtron import train

    assert train.main(["--config", "configs/tiny.yaml", "--dry-run", *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_dry_run_simulates_the_devices_of_a_cluster_layout():
    import subprocess
    import sys

    command = [sys.executable, "-m", "jaxtron.train", "--config", "configs/tiny.yaml",
               "--dry-run", "--target", "rocm", "--devices", "32", "mesh.data=4", "mesh.fsdp=2",
               "mesh.tensor=4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "32 devices (data=4, fsdp=2, tensor=4)" in result.stdout
    assert "lowered the train step for rocm" in result.stdout
