"""The pipeline composes: MoE blocks (experts split inside stages) and context parallelism.

The reference is one device with gradient accumulation over the same microbatches (a pipeline's
microbatch i takes rows i, i + m, ..., as accumulation does): the language-model loss, the MoE
auxiliary losses and statistics, and every gradient must agree.
"""

import jax
import numpy as np
import pytest

from jaxtron.data.pipeline import open_dataset, train_batches
from jaxtron.training.trainer import Trainer

from conftest import (
    first_batch_objective_metrics_grads,
    initial_state,
    make_config,
    one_device_reference,
)

MOE = {"num_experts": 4, "top_k": 2}


def objective_metrics_grads(mesh, *, moe, pipeline=None, optim=None, layers=4, devices=1):
    config = make_config(mesh=mesh, moe={**MOE, **moe}, pipeline=pipeline or {},
                         optim=optim or {}, model={"num_layers": layers})
    if devices == 1:  # cases with the same model and microbatches share it
        return one_device_reference(config)
    return first_batch_objective_metrics_grads(config, devices)


CASES = {
    "capacity_stage2_expert2_data2": (
        {"stage": 2, "expert": 2, "data": 2}, {}, {"microbatches": 2}, 4),
    "dropless_every2_uneven_stage2_expert2_data2": (
        {"stage": 2, "expert": 2, "data": 2}, {"mode": "dropless", "every": 2},
        {"microbatches": 2, "layers_per_stage": [2, 6]}, 8),
    "capacity_stage2_expert2_tensor2": (
        {"stage": 2, "expert": 2, "tensor": 2, "data": 1}, {}, {"microbatches": 2}, 4),
    # DeepSeek-V3's dense first layers run on the first stage, after the embedding.
    "dense_first_stage2_expert2_data2": (
        {"stage": 2, "expert": 2, "data": 2}, {"first_dense_layers": 1},
        {"microbatches": 2, "layers_per_stage": [2, 2]}, 4),
    "zb_h1_dropless_every2_uneven_stage2_expert2_data2": (
        {"stage": 2, "expert": 2, "data": 2}, {"mode": "dropless", "every": 2},
        {"microbatches": 2, "layers_per_stage": [2, 6], "schedule": "zb-h1"}, 8),
    "zbv_dropless_stage2_expert2_data2": (
        {"stage": 2, "expert": 2, "data": 2}, {"mode": "dropless"},
        {"microbatches": 2, "schedule": "zbv", "virtual_stages": 2}, 4),
    "stored_zb_h1_dropless_stage2_expert2_data2": (
        {"stage": 2, "expert": 2, "data": 2}, {"mode": "dropless"},
        {"microbatches": 2, "schedule": "zb-h1", "recompute": False}, 4),
    "interleaved_stage2_data2": (
        {"stage": 2, "data": 2}, {}, {"microbatches": 2, "schedule": "interleaved",
                                      "virtual_stages": 2}, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_pipeline_equals_one_device(name):
    mesh, moe, pipeline, layers = CASES[name]
    devices = int(np.prod(list(mesh.values())))
    want = objective_metrics_grads({"data": 1}, moe=moe, layers=layers,
                                   optim={"grad_accum": pipeline["microbatches"]})
    got = objective_metrics_grads(mesh, moe=moe, pipeline=pipeline, layers=layers,
                                  devices=devices)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert set(got[1]) == set(want[1]) >= {"loss", "moe_balance", "moe_z", "moe_max_load"}
    for key in want[1]:
        np.testing.assert_allclose(got[1][key], want[1][key], rtol=1e-5, err_msg=key)
    assert got[1]["moe_balance"] > 0 and want[0] > float(want[1]["loss"])  # aux terms count
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-7)


@pytest.mark.parametrize("packed", [False, True])
def test_context_parallel_pipeline_equals_one_device(packed):
    data = {"packing": "documents", "eod_mask_loss": True} if packed else {}

    def run(mesh, pipeline=None, optim=None, devices=1):
        config = make_config(mesh=mesh, pipeline=pipeline or {}, optim=optim or {},
                             model={"num_layers": 4}, data=data)
        trainer = Trainer(config, devices=jax.devices()[:devices])
        state = initial_state(trainer)
        batch = trainer.put_batch(next(train_batches(config, open_dataset(config))))
        objective, grads = trainer.loss_and_grads(state.params, batch)
        return float(objective), trainer.to_model_params(jax.device_get(grads))

    want = run({"data": 1}, optim={"grad_accum": 2})
    got = run({"stage": 2, "sequence": 2, "data": 2}, pipeline={"microbatches": 2}, devices=8)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-7)


@pytest.mark.parametrize("layout, model", [
    ({"data.packing": "documents", "mesh.sequence": 2, "data.seq_len": 64}, {}),
    ({"model.fp8": "tensorwise"}, {"tie_embeddings": True, "mtp_depth": 1})])
def test_zb_h1_and_stored_residuals_equal_one_device_with_every_stage_feature(layout, model):
    """The split backward changes only when weight gradients are formed, stored residuals
    only what the backward recomputes: the objective and every gradient equal one device's
    (two accumulated microbatches, as the pipeline's two) with packed documents and context
    parallelism inside stages, fp8 matmuls, tied embeddings and multi-token prediction."""
    one_device = make_config({**layout, "mesh.data": 1, "mesh.sequence": 1,
                              "optim.grad_accum": 2}, model=model)
    results = [first_batch_objective_metrics_grads(one_device, 1)]
    for schedule, recompute in (("zb-h1", True), ("1f1b", False)):
        config = make_config({"mesh.data": 1, "mesh.stage": 2, "pipeline.microbatches": 2,
                              "pipeline.schedule": schedule, "pipeline.recompute": recompute,
                              **layout}, model=model)
        results.append(first_batch_objective_metrics_grads(config, 2 * config.mesh.sequence))
    (objective, _, grads), *others = results
    for other_objective, _, other_grads in others:
        np.testing.assert_allclose(other_objective, objective, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
