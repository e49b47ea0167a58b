"""`model.remat: offload`: each block's input and attention's output and log-sum-exp wait in
pinned host memory between the forward and the backward. XLA:CPU has one memory, so here the
numbers are checked (those of no remat, on one device, in a pipeline too), the step's program
is checked to place the residuals on the host (its jaxpr), and the program lowered for CUDA to
carry the host placements XLA turns into device-to-host copies. The planner keeps them out of
device memory and charges the host link."""

import dataclasses
import re

import pytest

from jaxtron.planner.cost import host_seconds
from jaxtron.planner.hardware import HARDWARE
from jaxtron.planner.layout import Layout
from jaxtron.planner.memory import offloaded_bytes, predict
from jaxtron.training.trainer import Trainer

from conftest import make_config
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
