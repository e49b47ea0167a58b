"""The core contract: every layout trains to the same numbers as one device, using the memory
the layout promises."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtron.data.pipeline import open_dataset, train_batches
from jaxtron.errors import ConfigError
from jaxtron.sharding.mesh import resolve_degrees
from jaxtron.sharding.report import shard_bytes
from jaxtron.training.trainer import Trainer

from conftest import USERS_CODEGEN, initial_state, make_config, run_in_process

# 8 query heads over 2 kv heads: tensor=8 splits queries and replicates the kv heads.
MODEL = {"num_heads": 8, "num_kv_heads": 2, "d_model": 64, "mlp_dim": 128}
GPT2 = {"type": "gpt2", "num_heads": 8, "num_kv_heads": None, "d_model": 64, "mlp_dim": 128}
STEPS = 2


def run(layout: dict, devices, model=MODEL):
    config = make_config(layout, model=model, train={"batch_size": 8},
                         optim={"warmup_steps": 1, "lr": 1e-2})
    trainer = Trainer(config, devices=devices)
    batches = train_batches(config, open_dataset(config))
    state = initial_state(trainer)
    losses, batch = [], trainer.put_batch(next(batches))
    for step in range(STEPS):  # the first step's objective and gradients are compared too
        state, metrics, objective, grads = trainer.step_and_grads(state, batch)
        if step == 0:
            loss0, grads0 = objective, grads
        losses.append(float(metrics["loss"]))
        batch = trainer.put_batch(next(batches))
    return {"loss0": float(loss0), "grads": jax.device_get(nnx.to_pure_dict(grads0)),
            "losses": losses, "params": jax.device_get(nnx.to_pure_dict(state.params))}


@functools.cache
def single_device(name):
    """The one-device reference runs, once per process whatever order the tests run in."""
    return run({"mesh.data": 1}, jax.devices()[:1], GPT2 if name == "gpt2" else MODEL)


LAYOUTS = {
    "data8": {"mesh.data": 8},
    "fsdp8": {"mesh.data": 1, "mesh.fsdp": 8},
    "tensor8": {"mesh.data": 1, "mesh.tensor": 8},
    "tensor4_sp": {"mesh.data": 2, "mesh.tensor": 4, "mesh.sequence_parallel": True},
    "data2_fsdp2_tensor2": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
    "sequence4_ring": {"mesh.data": 2, "mesh.sequence": 4},
    "sequence2_tensor2_sp": {"mesh.data": 2, "mesh.sequence": 2, "mesh.tensor": 2,
                             "mesh.sequence_parallel": True},
    "zero1": {"mesh.data": 8, "optim.zero_stage": 1},
    "data4_accum": {"mesh.data": 4, "mesh.tensor": 2, "optim.grad_accum": 2},
    "zero2_accum": {"mesh.data": 4, "mesh.tensor": 2, "optim.zero_stage": 2,
                    "optim.grad_accum": 2},
    "ring_zero2_accum": {"mesh.data": 4, "mesh.sequence": 2, "optim.zero_stage": 2,
                         "optim.grad_accum": 2},
}


def assert_matches(result, reference):
    np.testing.assert_allclose(result["loss0"], reference["loss0"], rtol=1e-5)
    np.testing.assert_allclose(result["losses"], reference["losses"], rtol=1e-5)
    for got, want in zip(jax.tree.leaves(result["grads"]), jax.tree.leaves(reference["grads"]),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    for got, want in zip(jax.tree.leaves(result["params"]),
                         jax.tree.leaves(reference["params"]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_device(name):
    assert_matches(run(LAYOUTS[name], jax.devices()), single_device("llama"))


def test_gpt2_hybrid_layout_matches_single_device():
    layout = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "mesh.sequence_parallel": True}
    assert_matches(run(layout, jax.devices(), GPT2), single_device("gpt2"))


def state_bytes(layout):
    """(params, Adam moments, replicated scalars) bytes on one device, from array shards."""
    state = Trainer(make_config(layout, model=MODEL)).abstract_state()
    scalars = sum(leaf.dtype.itemsize for leaf in jax.tree.leaves(state.opt_state)
                  if leaf.ndim == 0)
    return shard_bytes(state.params), shard_bytes(state.opt_state) - scalars, scalars


def test_fsdp_and_zero_shrink_per_device_state_as_promised():
    params_rep, moments_rep, scalars = state_bytes({"mesh.data": 8})
    assert moments_rep == 2 * params_rep  # mu and nu, besides the scalar counters
    params_fsdp, moments_fsdp, _ = state_bytes({"mesh.data": 1, "mesh.fsdp": 8})
    # Every parameter has an `embed` axis, split 8 ways: exactly 1/8 of the replicated bytes.
    assert params_fsdp * 8 == params_rep and moments_fsdp * 8 == moments_rep
    params_z1, moments_z1, _ = state_bytes({"mesh.data": 8, "optim.zero_stage": 1})
    assert params_z1 == params_rep and moments_z1 * 8 == moments_rep


def test_real_array_shards_follow_the_layout():
    config = make_config({"mesh.data": 1, "mesh.fsdp": 8}, model=MODEL)
    state = Trainer(config).init_state()
    wq = state.params["blocks"]["attn"]["wq"][...]
    assert wq.addressable_shards[0].data.shape == (2, 8, 8, 8)  # N, D/8, H, K
    mu = state.opt_state.inner_state[1][0].mu["blocks"]["attn"]["wq"][...]
    assert mu.addressable_shards[0].data.shape == (2, 8, 8, 8)


def test_zero1_keeps_parameters_whole_and_splits_moments():
    config = make_config({"mesh.data": 8, "optim.zero_stage": 1}, model=MODEL)
    state = Trainer(config).init_state()
    wq = state.params["blocks"]["attn"]["wq"][...]
    mu = state.opt_state.inner_state[1][0].mu["blocks"]["attn"]["wq"][...]
    assert wq.addressable_shards[0].data.shape == (2, 64, 8, 8)
    assert mu.addressable_shards[0].data.shape == (2, 8, 8, 8)


def test_vocab_parallel_loss_never_gathers_full_logits():
    config = make_config({"mesh.data": 1, "mesh.tensor": 8, "model.vocab_size": 384},
                         model=MODEL)
    trainer = Trainer(config)
    hlo = trainer.compile_step(trainer.abstract_state(), trainer.abstract_batch()).as_text()
    collectives = [line for line in hlo.splitlines()
                   if any(op in line for op in ("all-gather(", "all-reduce(", "all-to-all("))]
    assert collectives
    # Full logits would be f32[8,32,384]; per device they are [8,32,48] and only [8,32]
    # statistics (max, sum, target logit) and [8,32,64] activations cross devices.
    assert not [line for line in collectives if ",384]" in line.split("=")[1].split("(")[0]]


def test_sequence_parallel_cuts_activation_memory():
    def temp_bytes(layout):
        trainer = Trainer(make_config(layout, model={**MODEL, "num_kv_heads": 8}))
        compiled = trainer.compile_step(trainer.abstract_state(), trainer.abstract_batch(),
                                        USERS_CODEGEN)
        return compiled.memory_analysis().temp_size_in_bytes
    plain = temp_bytes({"mesh.data": 2, "mesh.tensor": 4})
    sp = temp_bytes({"mesh.data": 2, "mesh.tensor": 4, "mesh.sequence_parallel": True})
    assert sp < 0.9 * plain, (sp, plain)


@pytest.mark.parametrize("layout, fragment", [
    ({"mesh.data": 3}, "multiply to 3, but 8 devices are visible"),
    ({"mesh.data": -1, "mesh.tensor": 3}, "does not divide the 8 devices"),
    ({"mesh.data": 1, "mesh.tensor": 8, "model.num_heads": 4, "model.num_kv_heads": 2},
     "mesh.tensor=8 must divide model.num_heads=4"),
    ({"mesh.data": 8, "train.batch_size": 4}, "make train.batch_size a multiple of 8"),
    ({"mesh.data": 2, "mesh.sequence": 4, "data.seq_len": 36},
     "data.seq_len=36 must be a multiple of 2 x mesh.sequence = 8"),
    ({"mesh.data": 8, "mesh.dcn_data": 2}, "run one process per host"),
    ({"mesh.data": 4, "mesh.dcn_data": 3}, "mesh.dcn_data=3 must divide mesh.data=4"),
])
def test_bad_layouts_are_explained(layout, fragment):
    with pytest.raises(ConfigError) as err:
        Trainer(make_config(layout))
    assert fragment in str(err.value)


def test_minus_one_takes_the_rest():
    config = make_config({"mesh.data": -1, "mesh.tensor": 2, "mesh.fsdp": 2})
    assert resolve_degrees(config.mesh, 8)["data"] == 2


def test_dry_run_prints_mesh_shardings_memory_and_communication():
    result = run_in_process("jaxtron.train", "--config", "configs/tiny.yaml", "--dry-run",
                            "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "optim.zero_stage=1")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "mesh: 8 devices (data=2, fsdp=2, tensor=2)" in out
    assert "blocks/attn/wq" in out and "(None, 'fsdp', 'tensor', None)" in out
    assert "per-device memory: parameters" in out and "peak temporaries" in out
    assert "communication per step" in out
    for kind_and_axis in ("all-reduce          over data+fsdp ",  # gradients, ZeRO-3 on CPU
                          "all-gather          over fsdp ",       # weights before use
                          "all-gather          over data ",       # ZeRO-1: updated weights
                          "all-reduce          over tensor "):    # Megatron's per-block sums
        assert kind_and_axis in out, out
