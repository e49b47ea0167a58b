"""Decoder-only transformer with stacked, scanned blocks.

The N blocks are created once under `nnx.vmap`, so every block parameter has a leading `layers`
axis, and applied with `jax.lax.scan`: compile time does not grow with depth. `scan_layers=False`
runs the same stacked parameters in a Python loop (used to test that scan changes nothing).
The remat policy wraps the block body: `full` recomputes the whole block in the backward pass,
`save_dots` keeps matmul outputs and recomputes the cheap elementwise work.

Llama: RMSNorm, RoPE, SwiGLU, grouped-query attention, untied embeddings (Touvron et al. 2023).
GPT-2: LayerNorm, learned positions, GELU, tied embeddings (Radford et al. 2019).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.models.layers import Block, make_norm, normal, param
from jaxtron.sharding.rules import constrain

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.param_dtype
        self.embed = param(rngs, normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                           ("vocab", "embed"), pd)
        if cfg.type == "gpt2":
            self.pos_embed = param(rngs, normal(cfg.init_std), (cfg.max_seq_len, cfg.d_model),
                                   (None, "embed"), pd)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = make_norm(cfg, rngs)
        if not cfg.tied_embeddings:
            self.lm_head = param(rngs, normal(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                                 ("embed", "vocab"), pd)

    def __call__(self, tokens_BxL):
        """Token ids -> logits_BxLxV in the compute dtype."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        length = tokens_BxL.shape[1]
        positions_L = jnp.arange(length)
        # In the compute layout (activation rules) the table is split by vocabulary only: a
        # vocab-parallel lookup whose partial rows are summed across the tensor axis.
        table_VxD = constrain(self.embed[...], ("vocab", "embed"))
        x_BxLxD = jnp.take(table_VxD, tokens_BxL, axis=0).astype(dt)
        if cfg.type == "gpt2":
            x_BxLxD = x_BxLxD + self.pos_embed[:length].astype(dt)
        x_BxLxD = constrain(x_BxLxD, ("batch", "residual_seq", "embed"))
        x_BxLxD = self._run_blocks(x_BxLxD, positions_L)
        x_BxLxD = self.final_norm(x_BxLxD)
        head_DxV = self.embed[...].T if cfg.tied_embeddings else self.lm_head[...]
        logits_BxLxV = x_BxLxD @ head_DxV.astype(dt)
        return constrain(logits_BxLxV, ("batch", "seq", "vocab"))

    def _run_blocks(self, x_BxLxD, positions_L):
        graphdef, stacked = nnx.split(self.blocks)

        def body(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, positions_L), None

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat],
                                  prevent_cse=not self.cfg.scan_layers)
        if self.cfg.scan_layers:
            x_BxLxD, _ = jax.lax.scan(body, x_BxLxD, stacked)
            return x_BxLxD
        for i in range(self.cfg.num_layers):
            x_BxLxD, _ = body(x_BxLxD, jax.tree.map(lambda a: a[i], stacked))
        return x_BxLxD


def cross_entropy_loss(logits_BxLxV, targets_BxL, weights_BxL=None):
    """Mean next-token cross-entropy in fp32, whatever dtype the logits were computed in.

    Written as logsumexp minus the target logit so that, with logits sharded over the vocabulary,
    each device reduces its own slice and only [B, L] partial sums cross devices.
    """
    logits = logits_BxLxV.astype(jnp.float32)
    log_z_BxL = jax.nn.logsumexp(logits, axis=-1)
    vocab = logits.shape[-1]
    target_logit_BxL = jnp.sum(logits * jax.nn.one_hot(targets_BxL, vocab, dtype=logits.dtype),
                               axis=-1)
    nll_BxL = log_z_BxL - target_logit_BxL
    if weights_BxL is None:
        return jnp.mean(nll_BxL)
    return jnp.sum(nll_BxL * weights_BxL) / jnp.maximum(jnp.sum(weights_BxL), 1.0)
