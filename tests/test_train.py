"""Training works: it overfits, learns the corpus, and shards without changing the numbers."""

import re
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtron.data.pipeline import open_dataset, train_batches
from jaxtron.training.step import accumulated_grads, plain_grads
from jaxtron.training.trainer import Trainer

from conftest import initial_state, long_run_env, make_config, metric_records


def test_overfits_one_batch():
    config = make_config({"train.steps": 150, "optim.lr": 3e-3, "optim.warmup_steps": 10,
                          "optim.weight_decay": 0.0}, mesh={"data": 1})
    trainer = Trainer(config, devices=jax.devices()[:1])
    batch = trainer.put_batch(next(train_batches(config, open_dataset(config))))
    state = trainer.init_state()
    losses = []
    for _ in range(config.train.steps):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[0] > 5.0 and losses[-1] < 0.05, losses[::25]


def test_gradient_accumulation_equals_one_big_batch():
    config = make_config()
    trainer = Trainer(config, devices=jax.devices()[:1])
    params = trainer.init_state().params
    batch = {"tokens": next(train_batches(config, open_dataset(config)))["tokens"]}
    (loss_full, _), grads_full = jax.jit(plain_grads(trainer.loss_fn))(params, batch)
    (loss_acc, _), grads_acc = jax.jit(accumulated_grads(plain_grads(trainer.loss_fn), 4))(
        params, batch)
    np.testing.assert_allclose(loss_full, loss_acc, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_full), jax.tree.leaves(grads_acc), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("layout", [
    {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "optim.zero_stage": 2,
     "optim.grad_accum": 2},
    {"mesh.stage": 2, "mesh.data": 2, "mesh.tensor": 2, "pipeline.microbatches": 2}],
    ids=["zero2", "pipeline"])
def test_the_step_returns_the_gradients_of_the_separate_pass_and_updates_as_the_step(layout):
    """What the layout-equivalence tests read from `step_and_grads`: its objective and
    gradients are the gradient pass's (`loss_and_grads`), and its update and metrics are the
    plain step's."""
    config = make_config(layout, optim={"warmup_steps": 1, "lr": 1e-2})
    trainer = Trainer(config, devices=jax.devices())
    batch = trainer.put_batch(next(train_batches(config, open_dataset(config))))
    objective, grads = trainer.loss_and_grads(trainer.init_state().params, batch)
    stepped, metrics = trainer.step(trainer.init_state(), batch)
    got_state, got_metrics, got_objective, got_grads = trainer.step_and_grads(
        trainer.init_state(), batch)
    np.testing.assert_allclose(got_objective, objective, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
    for key in metrics:
        np.testing.assert_allclose(got_metrics[key], metrics[key], rtol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(stepped), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


MOE = {"num_experts": 4, "top_k": 2}
MLA = {"attention": "mla", "num_kv_heads": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
       "qk_rope_head_dim": 8, "v_head_dim": 16}


@pytest.mark.parametrize("layout, model, moe", [
    ({"mesh.data": 8, "optim.zero_stage": 1}, {}, {}),
    ({"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "optim.zero_stage": 2}, {}, {}),
    ({"mesh.data": 2, "mesh.expert": 4}, {}, {**MOE, "mode": "dropless", "shared_experts": 1}),
    ({"mesh.data": 2, "mesh.sequence": 2, "mesh.tensor": 2}, {**MLA, "mtp_depth": 1}, {}),
    ({"mesh.stage": 2, "mesh.fsdp": 2, "mesh.data": 2, "pipeline.microbatches": 2,
      "pipeline.layers_per_stage": [1, 3]},
     {"tie_embeddings": True, "mtp_depth": 1, "fp8": "tensorwise"}, {}),
    ({"mesh.stage": 2, "mesh.tensor": 2, "mesh.data": 2, "pipeline.microbatches": 4,
      "pipeline.schedule": "interleaved", "pipeline.virtual_stages": 2,
      "optim.host_moments": True}, {}, {}),
    ({"mesh.stage": 2, "mesh.expert": 2, "mesh.data": 2, "pipeline.microbatches": 2,
      "pipeline.schedule": "zbv", "pipeline.virtual_stages": 2},
     {"num_layers": 5}, {**MOE, "first_dense_layers": 1}),
    ({"mesh.data": 1, "mesh.tensor": 8, "model.vocab_size": 384},
     {"num_heads": 8, "num_kv_heads": 2, "d_model": 64, "mlp_dim": 128}, {}),
    ({"mesh.data": 2, "mesh.sequence": 4, "mesh.context_parallel": "hybrid",
      "mesh.all_to_all_group": 2}, {}, {}),
    ({"mesh.data": 1, "mesh.expert": 8}, {}, {"num_experts": 8, "top_k": 2}),
    ({"mesh.data": 2, "mesh.stage": 4, "pipeline.microbatches": 2, "optim.zero_stage": 1},
     {"type": "gpt2", "num_kv_heads": None, "vocab_size": 258, "num_layers": 5}, {})],
    ids=["zero1", "fsdp_tensor_zero2", "expert", "mla_mtp_sequence_tensor",
         "uneven_stages_tied_mtp_fp8", "interleaved_host_moments", "zbv_moe", "tensor8",
         "hybrid_context", "expert8", "gpt2_padded_ends_four_stages_zero1"])
def test_init_state_has_the_one_device_values_on_every_layout(layout, model, moe):
    """What the layout tests start from (`initial_state`: one initialisation per model on one
    device, placed onto the layout) is what `init_state` creates on the mesh itself: the same
    step, parameters and optimizer state, of the same dtypes."""
    config = make_config(layout, model={"num_layers": 4, **model}, moe=moe)
    trainer = Trainer(config, devices=jax.devices())
    got, want = trainer.init_state(), initial_state(trainer)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)
    other_seed = Trainer(make_config({**layout, "train.seed": 1}, model={"num_layers": 4,
                                                                          **model}, moe=moe),
                         devices=jax.devices())
    with pytest.raises(AssertionError):  # the comparison sees a different initialisation
        for a, b in zip(jax.tree.leaves(initial_state(other_seed).params),
                        jax.tree.leaves(got.params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def run_steps(config, devices, steps=3):
    trainer = Trainer(config, devices=devices)
    batches = train_batches(config, open_dataset(config))
    state = trainer.init_state()
    losses = []
    for _ in range(steps):
        state, metrics = trainer.step(state, trainer.put_batch(next(batches)))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(nnx.to_pure_dict(state.params))


def test_data_parallel_matches_one_device_with_accumulation():
    single = run_steps(make_config({"mesh.data": 1}), jax.devices()[:1])
    sharded = run_steps(make_config({"mesh.data": 8, "train.batch_size": 16,
                                     "optim.grad_accum": 2}), jax.devices())
    reference = run_steps(make_config({"mesh.data": 1, "train.batch_size": 16}),
                          jax.devices()[:1])
    np.testing.assert_allclose(sharded[0], reference[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(sharded[1]), jax.tree.leaves(reference[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert single[0][0] != reference[0][0]  # different batch size, different first loss


# configs/tiny.yaml by hand: 4 layers of q, o (128 x 128), k, v (128 x 64) and a 3-matrix MLP
# (128 x 384), a 128 x 256 head: 819,200 weights at 6 FLOPs each per token, plus the 128-token
# causal attention, 4 layers x 2 matmuls x 2 x 4 heads x 32 x (128 + 1) / 2 keys, 3 x forward.
TINY_FLOPS_PER_TOKEN = 6 * 819_200 + 3 * 4 * 2 * 2 * 4 * 32 * (128 + 1) / 2


def test_cli_trains_tiny_config_and_writes_metrics(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "jaxtron.train", "--config", "configs/tiny.yaml",
         "train.steps=60", "train.log_every=10", "train.eval_every=30",
         f"train.run_dir={run_dir}", "data.builtin_max_bytes=400000", "train.tensorboard=true",
         "train.profile_steps=[40,41]"],
        capture_output=True, text=True, timeout=600, env=long_run_env())
    assert result.returncode == 0, result.stderr[-3000:]
    records = metric_records(run_dir)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    peak_gflops = float(re.search(r"peak ([\d,.]+) GFLOP/s", result.stdout)[1].replace(",", ""))
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= r.keys()
        # MFU is the model's FLOPs at the logged token rate over the printed peak
        implied_peak = TINY_FLOPS_PER_TOKEN * r["tokens_per_s"] / r["mfu"] / 1e9
        assert implied_peak == pytest.approx(peak_gflops, abs=0.05 + 1e-6 * peak_gflops), r
    assert "eval_loss" in records[2] and "eval_loss" in records[-1]
    # An untrained byte model sits at ln(256) = 5.55; 60 steps must get well below it.
    assert records[-1]["loss"] < 3.2 and records[-1]["loss"] < records[0]["loss"] - 0.5
    assert records[-1]["eval_loss"] < records[2]["eval_loss"]
    assert "done: 60 steps" in result.stdout
    assert "steps: 60" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "profile").rglob("*.xplane.pb"))  # the trace of steps 40-41
    scalars = read_event_scalars(run_dir / "tensorboard")
    assert scalars["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in records]
    assert [s for s, _ in scalars["eval/loss"]] == [30, 60]


def read_event_scalars(folder):
    """{tag: [(step, value)]} from TFRecord event files, read without TensorBoard: each record is
    a little-endian u64 length, a u32 CRC, the serialized Event, a u32 CRC."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_chunked_cross_entropy_in_the_model_matches_the_plain_loss():
    def loss_and_grads(impl):
        config = make_config({"model.cross_entropy": impl, "model.loss_chunk_tokens": 48,
                              "mesh.data": 2, "mesh.tensor": 4})
        trainer = Trainer(config)
        state = trainer.init_state()
        batch = trainer.put_batch(next(train_batches(config, open_dataset(config))))
        loss, grads = trainer.loss_and_grads(state.params, batch)
        return float(loss), jax.device_get(nnx.to_pure_dict(grads))

    plain, chunked = loss_and_grads("plain"), loss_and_grads("chunked")
    np.testing.assert_allclose(chunked[0], plain[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(chunked[1]), jax.tree.leaves(plain[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
