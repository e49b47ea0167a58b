"""Multi-token prediction: the losses equal DeepSeek-V3's formulation written in numpy, sequences
cut; sharded, context-parallel and pipelined runs equal one device.

The numpy reference (float64) uses the model's parameter arrays and nothing else of it. Its
conventions, from DeepSeek-V3 sec. 2.2 (arXiv:2412.19437) and `jaxtron/models/mtp.py`:
  * h_0 is the main model's last hidden state, before the head's final norm;
  * depth k (1..D) runs on the first L - k positions only: h_k[i] = Block_k(
    W_k [RMSNorm_hidden(h_{k-1}[i]); RMSNorm_embedded(Emb(t[i + k]))]), the hidden half first,
    W_k the [2D, D] `proj`, each half with its own RMSNorm scale, Emb the shared table;
  * its logits come from the shared head (final RMSNorm, then the output projection), scored
    by cross-entropy against t[i + k + 1], averaged over the L - k positions;
  * `mtp_loss` is the mean over the D depths, and the objective adds mtp_loss_coef x it.
A block is Llama's pre-norm block (x + attention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))),
attention causal with RoPE rotating pairs (i, i + K/2) at positions 0, 1, ... of the cut
sequence, and kv head g serving query heads g R to g R + R - 1.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtron.errors import ConfigError
from jaxtron.models.transformer import Transformer
from jaxtron.training.trainer import Trainer

from attention_oracle import attention
from conftest import (
    first_batch_objective_metrics_grads,
    initial_state,
    make_config,
    one_device_reference,
)

# --- a numpy Llama trunk, MTP modules and head, from the parameter arrays ---------------------

def rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rotate(x_BxLxHxK, theta):
    """RoPE: pair (i, i + K/2) turned by position x theta^(-2i / K) radians."""
    length, width = x_BxLxHxK.shape[1], x_BxLxHxK.shape[-1]
    angle_LxK2 = np.arange(length)[:, None] * theta ** (-np.arange(0, width, 2) / width)
    cos, sin = np.cos(angle_LxK2)[:, None], np.sin(angle_LxK2)[:, None]
    x1, x2 = np.split(x_BxLxHxK, 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def block(p, x_BxLxD, cfg):
    """A pre-norm Llama block on one (cut) sequence of length L."""
    length = x_BxLxD.shape[1]
    a = rms_norm(x_BxLxD, p["attn_norm"]["scale"], cfg.norm_eps)
    q = rotate(np.einsum("bld,dhk->blhk", a, p["attn"]["wq"]), cfg.rope_theta)
    k = rotate(np.einsum("bld,dgk->blgk", a, p["attn"]["wk"]), cfg.rope_theta)
    v = np.einsum("bld,dgk->blgk", a, p["attn"]["wv"])
    out = attention(q, k, v, np.tril(np.ones((length, length), bool)))
    x_BxLxD = x_BxLxD + np.einsum("blhk,hkd->bld", out, p["attn"]["wo"])
    a = rms_norm(x_BxLxD, p["mlp_norm"]["scale"], cfg.norm_eps)
    gate, up = a @ p["mlp"]["w_gate"], a @ p["mlp"]["w_up"]
    return x_BxLxD + (gate / (1.0 + np.exp(-gate)) * up) @ p["mlp"]["w_down"]


def cross_entropy(p, h_BxLxD, targets_BxL, cfg):
    """Mean -log softmax(head(h))[target], the head being the final RMSNorm and lm_head."""
    logits = rms_norm(h_BxLxD, p["head"]["final_norm"]["scale"], cfg.norm_eps) @ p["head"][
        "lm_head"]
    logits = logits - logits.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(logits).sum(axis=-1))
    return float(np.mean(log_z - np.take_along_axis(logits, targets_BxL[..., None], -1)[..., 0]))


def numpy_losses(p, cfg, tokens_BxT, *, embedded_first=False, target_lead=1):
    """-> (main loss, [loss of depth 1, ..., depth D]) as the module docstring defines them.
    `embedded_first` and `target_lead` (depth k at i scored against t[i + k + lead]) exist
    only to show that the comparison notices either convention broken."""
    inputs_BxL, table = tokens_BxT[:, :-1], p["embedder"]["embed"]
    length = inputs_BxL.shape[1]
    h = table[inputs_BxL]
    for n in range(cfg.num_layers):
        h = block(jax.tree.map(lambda a: a[n], p["blocks"]), h, cfg)
    main = cross_entropy(p, h, tokens_BxT[:, 1:], cfg)
    losses = []
    modules = p["mtp"]["modules"]
    for k, module in enumerate((modules[i] for i in sorted(modules)), start=1):
        halves = [rms_norm(h[:, :length - k], module["norm_hidden"]["scale"], cfg.norm_eps),
                  rms_norm(table[inputs_BxL[:, k:]], module["norm_embedded"]["scale"],
                           cfg.norm_eps)]
        both = np.concatenate(halves[::-1] if embedded_first else halves, axis=-1)
        h = block(module["block"], both @ module["proj"], cfg)
        targets = tokens_BxT[:, k + target_lead:k + target_lead + length - k]
        losses.append(cross_entropy(p, h, targets, cfg))
    return main, losses


def randomised(model, seed=0):
    """Every parameter random, norm scales about 1 and the rest about 0.1 (the initial scales
    of ones and logits near zero would let a misplaced norm or a shifted target pass unseen)
    -> the parameters as a float64 numpy tree."""
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)

    def draw(path, a):
        scale = jax.tree_util.keystr(path).endswith("['scale']")
        return np.asarray(rng.normal(1.0 if scale else 0.0, 0.2 if scale else 0.1, a.shape),
                          np.float32)

    pure = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return jax.tree.map(lambda a: np.asarray(a, np.float64), pure)


def test_losses_equal_the_numpy_deepseek_v3_formulation():
    """The model's loss, mtp_loss and weighted MTP term equal the reference's; the same
    comparison fails with the two halves swapped or the target one token off."""
    config = make_config(model={"mtp_depth": 2, "mtp_loss_coef": 0.5})
    model = Transformer(config.model, rngs=nnx.Rngs(0))
    params = randomised(model)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 33)).astype(np.int32)
    loss, aux = nnx.jit(lambda m, t: m.loss(t[:, :-1], t[:, 1:]))(model, jnp.asarray(tokens))
    main, depths = numpy_losses(params, config.model, tokens)
    np.testing.assert_allclose(loss, main, rtol=1e-5)  # the main prediction is unchanged
    np.testing.assert_allclose(aux["mtp_loss"], np.mean(depths), rtol=1e-5)
    np.testing.assert_allclose(aux["weighted_terms"][-1], 0.5 * np.mean(depths), rtol=1e-5)
    for mistake in ({"embedded_first": True}, {"target_lead": 0}):
        _, wrong = numpy_losses(params, config.model, tokens, **mistake)
        with pytest.raises(AssertionError):
            np.testing.assert_allclose(aux["mtp_loss"], np.mean(wrong), rtol=1e-5)


def test_sharded_mtp_equals_one_device():
    def run(mesh, devices):
        config = make_config(model={"mtp_depth": 1}, mesh=mesh)
        trainer = Trainer(config, devices=jax.devices()[:devices])
        state = initial_state(trainer)
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
    if devices == 1:  # both layouts compare with it
        return one_device_reference(config)
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
