"""`model.remat: offload`: each block's input and attention's output and log-sum-exp wait in
pinned host memory between the forward and the backward. XLA:CPU has one memory, so here the
numbers are checked (those of no remat, on one device, in a pipeline too), the step's program
is checked to place the residuals on the host (its jaxpr), and the program lowered for CUDA to
carry the host placements XLA turns into device-to-host copies. The planner keeps them out of
device memory and charges the host link. `optim.host_moments` keeps the optimizer state in
pinned host memory between steps: bitwise the same training, resumable, host memory in the
CUDA program."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from jaxtron import train
from jaxtron.data.pipeline import open_dataset, train_batches
from jaxtron.planner.cost import host_seconds
from jaxtron.planner.hardware import HARDWARE
from jaxtron.planner.layout import Layout
from jaxtron.planner.memory import offloaded_bytes, predict
from jaxtron.training.trainer import Trainer

from conftest import losses_by_step, make_config
from test_ring import assert_same_loss_and_grads

PIPELINE = {"mesh.stage": 2, "mesh.data": 4, "pipeline.microbatches": 2}


@pytest.mark.parametrize("layout", [{"mesh.data": 2, "mesh.sequence": 2, "mesh.tensor": 2},
                                    PIPELINE], ids=["data_sequence_tensor", "pipeline"])
def test_offload_equals_one_device_without_remat(layout):
    assert_same_loss_and_grads(make_config(layout, model={"remat": "offload"},
                                           train={"batch_size": 8}),
                               make_config({"mesh.data": 1}, train={"batch_size": 8}))


def step_jaxpr(config) -> str:
    trainer = Trainer(config)
    with trainer._tracing():
        return str(trainer._step.trace(trainer.abstract_state(), trainer.abstract_batch()).jaxpr)


def host_arrays(text: str) -> set[str]:
    return set(re.findall(r"\w+<host>\[[\d,]*\]", text))


def test_the_block_inputs_and_attention_outputs_are_placed_in_host_memory():
    """Stacked over the 2 layers: the block inputs [L, B, S, D] and attention's outputs
    [L, B, S, H, K]; `full` keeps everything on the device."""
    config = make_config({"mesh.data": 8}, model={"remat": "offload"}, train={"batch_size": 8})
    held = host_arrays(step_jaxpr(config))
    assert {"f32<host>[2,8,32,64]", "f32<host>[2,8,32,4,16]"} <= held, held
    full = dataclasses.replace(config, model=dataclasses.replace(config.model, remat="full"))
    assert not host_arrays(step_jaxpr(full))


@pytest.mark.parametrize("layout", [{"mesh.data": 8}, PIPELINE], ids=["data", "pipeline"])
def test_the_cuda_program_moves_them_to_pinned_host_memory(layout):
    """Lowered for CUDA from this machine: the block input, attention's output and its
    log-sum-exp annotated for pinned host memory in the forward, and back to the device."""
    def placements(remat):
        config = make_config(layout, model={"remat": remat, "dtype": "bfloat16"},
                             train={"batch_size": 8})
        text = Trainer(config, platform="cuda").lower_step().as_text()
        return (text.count('_xla_buffer_placement = "pinned_host"'),
                text.count('_xla_buffer_placement = "device"'))

    to_host, to_device = placements("offload")
    assert to_host == 3 and to_device >= 3, (to_host, to_device)
    assert placements("full") == (0, 0)


def test_the_planner_keeps_offloaded_activations_off_the_device_and_charges_the_host_link():
    config = make_config({"mesh.data": 1}, model={"num_layers": 8, "d_model": 256,
                                                  "num_heads": 8, "num_kv_heads": 8,
                                                  "max_seq_len": 1024},
                         data={"seq_len": 1024}, train={"batch_size": 8})
    full, offload = Layout(data=8, remat="full"), Layout(data=8, remat="offload")
    kept = predict(config, full).total - predict(config, offload).total
    # full keeps each layer's block input on the device: 1024 tokens x D, fp32, 8 layers
    assert kept == pytest.approx(8 * 1024 * 256 * 4, rel=0.01)
    per_layer = 1024 * (256 * 4 + 8 * 32 * 4 + 8 * 4)  # input, attention out, log-sum-exp
    assert offloaded_bytes(config, offload) == per_layer
    assert host_seconds(config, offload, HARDWARE["h100"]) == pytest.approx(
        2 * per_layer * 8 / 50e9)


# --- optimizer state in host memory (`optim.host_moments`) -----------------------------------


def three_steps(overrides: dict):
    config = make_config(overrides, optim={"warmup_steps": 1}, train={"batch_size": 8})
    trainer = Trainer(config)
    state = trainer.init_state()
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state)}
    batches = train_batches(config, open_dataset(config))
    losses = []
    for _ in range(3):
        state, metrics = trainer.step(state, trainer.put_batch(next(batches)))
        losses.append(float(metrics["loss"]))
    kinds |= {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state)}
    return kinds, losses, jax.device_get(jax.tree.leaves(state.params))


@pytest.mark.parametrize("layout", [{"mesh.data": 4, "mesh.fsdp": 2, "optim.zero_stage": 1},
                                    PIPELINE], ids=["zero1_fsdp", "pipeline"])
def test_host_moments_stay_in_host_memory_and_train_bitwise_alike(layout):
    kinds, losses, params = three_steps({**layout, "optim.host_moments": True})
    assert kinds == {"pinned_host"}
    want_kinds, want_losses, want_params = three_steps(layout)
    assert want_kinds == {"device"}
    assert losses == want_losses
    for got, want in zip(params, want_params, strict=True):
        np.testing.assert_array_equal(got, want)


def test_host_moments_resume_from_a_checkpoint_like_an_uninterrupted_run(tmp_path):
    """The command line: saved from host memory (with its fingerprints), restored into it."""
    args = ["--config", "configs/tiny.yaml", "optim.host_moments=true", "train.log_every=1",
            "model.num_layers=1", "checkpoint.every=2", "data.builtin_max_bytes=400000",
            "train.eval_every=0"]
    assert train.main([*args, "train.steps=2", f"train.run_dir={tmp_path / 'a'}"]) == 0
    assert train.main([*args, "train.steps=4", f"train.run_dir={tmp_path / 'a'}"]) == 0
    assert train.main([*args, "train.steps=4", f"train.run_dir={tmp_path / 'b'}"]) == 0
    assert losses_by_step(tmp_path / "a") == losses_by_step(tmp_path / "b")


def test_the_cuda_program_keeps_the_moments_in_pinned_host_memory():
    config = make_config({"mesh.data": 8, "optim.host_moments": True},
                         model={"dtype": "bfloat16"}, train={"batch_size": 8})
    text = Trainer(config, platform="cuda").lower_step().as_text()
    assert text.count('mhlo.memory_kind = "pinned_host"') >= 2 * 9  # mu, nu in and out


def test_the_planner_counts_host_moments_only_where_the_update_peaks_above_the_backward():
    config = make_config({"mesh.data": 1}, train={"batch_size": 8})
    plain = predict(config, Layout(data=8))
    hosted = predict(dataclasses.replace(
        config, optim=dataclasses.replace(config.optim, host_moments=True)), Layout(data=8))
    assert hosted.optimizer == max(0, plain.optimizer - plain.activations - plain.logits)
    assert hosted.total < plain.total


def test_the_host_link_can_be_given_on_the_command_line(capsys):
    """`plan --host-bw` replaces the hardware's host link, as the other link flags do: a slower
    link makes the offloaded layouts' steps slower."""
    from jaxtron import plan

    args = ["--config", "configs/llama3-8b.yaml", "--devices", "8", "data.seq_len=131072",
            "model.max_seq_len=131072", "train.batch_size=8", "optim.grad_accum=1", "--top",
            "1", "--compare",
            "mesh.fsdp=2 mesh.tensor=4 model.remat=offload"]
    steps = []
    for link in ([], ["--host-bw", "5"]):
        assert plan.main([*args, *link]) == 0
        given = capsys.readouterr().out.splitlines()[-1]
        steps.append(float(re.search(r"step ([\d.]+) s", given).group(1)))
    assert steps[1] > steps[0], steps
