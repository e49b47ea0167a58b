"""Multi-token prediction: each depth's loss equals DeepSeek-V3's formulation, sequences cut."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtron.errors import ConfigError
from jaxtron.models.token_positions import PLAIN
from jaxtron.models.transformer import Transformer
from jaxtron.training.trainer import Trainer

from conftest import first_batch_objective_metrics_grads, make_config


def cut_losses(model, tokens):
    """DeepSeek-V3 as written: depth k runs on the first L - k positions only, h_k[i] from
    h_{k-1}[i] and Emb(t[i + k]), scored against t[i + k + 1]; plain means, no masks."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    h = model._trunk(inputs, PLAIN)[0]
    length, losses = inputs.shape[1], []
    table = model.embedder.embed[...]
    for k, module in enumerate(model.mtp.modules, start=1):
        h = module(h[:, :length - k], model.embedder(inputs[:, k:]), PLAIN)
        logits = model.head(h, table).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[:, k:, None], axis=-1)[..., 0]
        losses.append(float(nll.mean()))
    return losses


def test_each_depth_equals_the_cut_sequence_formulation():
    config = make_config(model={"mtp_depth": 2, "mtp_loss_coef": 0.5})
    model = Transformer(config.model, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 33)), jnp.int32)
    loss, aux = model.loss(tokens[:, :-1], tokens[:, 1:])
    want = cut_losses(model, tokens)
    np.testing.assert_allclose(aux["mtp_loss"], np.mean(want), rtol=1e-5)
    # the main prediction is the model's without the modules
    plain = Transformer(make_config().model, rngs=nnx.Rngs(0))
    nnx.update(plain, nnx.state(model, lambda path, _: path[0] != "mtp"))
    np.testing.assert_allclose(loss, plain.loss(tokens[:, :-1], tokens[:, 1:])[0], rtol=1e-6)
    assert aux["weighted_terms"][-1] == pytest.approx(0.5 * float(aux["mtp_loss"]))


def test_sharded_mtp_equals_one_device():
    def run(mesh, devices):
        config = make_config(model={"mtp_depth": 1}, mesh=mesh)
        trainer = Trainer(config, devices=jax.devices()[:devices])
        state = trainer.init_state()
        tokens = np.random.default_rng(1).integers(0, 256, (8, 33)).astype(np.int32)
        objective, grads = trainer.loss_and_grads(state.params, trainer.put_batch(
            {"tokens": tokens}))
        return float(objective), jax.device_get(grads)

    want = run({"data": 1}, 1)
    got = run({"data": 2, "tensor": 2}, 4)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    mtp_grads = [g for path, g in jax.tree_util.tree_flatten_with_path(want[1])[0]
                 if "mtp" in jax.tree_util.keystr(path)]
    assert mtp_grads and all(np.abs(g).max() > 0 for g in mtp_grads)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def objective_metrics_grads(mesh, devices, pipeline=None, optim=None):
    config = make_config(model={"mtp_depth": 2, "num_layers": 4}, mesh=mesh,
                         pipeline=pipeline or {}, optim=optim or {},
                         data={"packing": "documents", "eod_mask_loss": True})
    return first_batch_objective_metrics_grads(config, devices)


@pytest.mark.parametrize("mesh,pipeline", [
    ({"sequence": 2, "data": 2}, None),  # zig-zag order: the shift taken in natural order
    ({"stage": 2, "sequence": 2, "data": 2}, {"microbatches": 2}),  # on the last stage
])
def test_mtp_with_context_parallelism_and_pipelines_equals_one_device(mesh, pipeline):
    """Packed documents, masked end-of-document targets: the modules' weights, shifts and
    segment masks must all survive the permuted row and the stage split."""
    want = objective_metrics_grads({"data": 1}, 1, optim={"grad_accum": 2})
    got = objective_metrics_grads(mesh, int(np.prod(list(mesh.values()))), pipeline,
                                  optim=None if pipeline else {"grad_accum": 2})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1]["mtp_loss"], want[1]["mtp_loss"], rtol=1e-5)
    np.testing.assert_allclose(got[1]["loss"], want[1]["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-7)


def test_mtp_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="model.mtp_depth=40 must be 0"):
        make_config(model={"mtp_depth": 40})
