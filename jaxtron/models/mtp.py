"""Multi-token prediction (DeepSeek-V3, sec. 2.2): D extra modules, the k-th predicting token
i + k + 1 from position i, sharing the model's embedding and output head.

Module k combines the previous depth's hidden state at position i with the embedding of token
i + k (each RMS-normalised, concatenated, projected from 2D back to D), runs one transformer
block over the result, and scores the next-next token with the shared head:

    h_k[i] = Block_k(W_k [norm(h_{k-1}[i]); norm(Emb(t[i + k]))])     loss_k = CE(head(h_k[i]), t[i + k + 1])

with h_0 the main model's last hidden state (before its final norm). The objective adds
`model.mtp_loss_coef` x the mean of the D losses; the main prediction is unchanged, and the
modules can be dropped at inference. Shapes stay [B, L]: the last k positions of depth k have no
target and are masked out of its loss instead of cut off (causal attention keeps them from
influencing earlier positions), so every depth runs at the sequence length the kernels and
shardings expect. A prediction whose target lies in another packed document is masked too.
Under context parallelism the row arrives in zig-zag order (`TokenPositions.order`): the shift is
taken in natural order, so the modules run sharded like every other block. On a pipeline they
run on the last stage, which receives the embedding table for them.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxtron.config.schema import ModelConfig
from jaxtron.models.blocks import Block
from jaxtron.models.layers import RMSNorm, normal, param
from jaxtron.models.token_positions import TokenPositions


class MTPModule(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.norm_hidden = RMSNorm(cfg, rngs)
        self.norm_embedded = RMSNorm(cfg, rngs)
        self.proj = param(rngs, normal(cfg.init_std), (2 * cfg.d_model, cfg.d_model),
                          (None, "embed"), cfg.param_dtype)
        self.block = Block(cfg, rngs)

    def __call__(self, h_BxLxD, embedded_BxLxD, token_pos: TokenPositions):
        both = jnp.concatenate([self.norm_hidden(h_BxLxD), self.norm_embedded(embedded_BxLxD)],
                               axis=-1)
        x_BxLxD = both @ self.proj[...].astype(both.dtype)
        return self.block(x_BxLxD, token_pos)[0]


class MultiTokenPrediction(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.modules = nnx.List([MTPModule(cfg, rngs) for _ in range(cfg.mtp_depth)])

    def mean_loss(self, h_BxLxD, inputs_BxL, targets_BxL, embed, head_loss,
                  token_pos: TokenPositions, weights_BxL=None):
        """The mean over depths of each depth's mean loss, in fp32. `embed(tokens_BxL)` is the
        model's embedding and `head_loss(h, targets, weights)` its head's weighted mean loss
        over B x L."""
        length = inputs_BxL.shape[1]
        # Each position's index in the row's natural order (context parallelism permutes the
        # row): "k tokens ahead" means k ahead in that order, found by a gather of [B, L] ids.
        natural_L = jnp.arange(length) if token_pos.order is None else jnp.asarray(token_pos.order)
        slot_of_natural = jnp.argsort(natural_L)
        losses = []
        for k, module in enumerate(self.modules, start=1):
            ahead_L = slot_of_natural[jnp.minimum(natural_L + k, length - 1)]
            exists_L = natural_L < length - k
            ahead = lambda a, fill=0: jnp.where(  # noqa: E731
                exists_L[None, :], jnp.take(a, ahead_L, axis=1), fill)
            h_BxLxD = module(h_BxLxD, embed(ahead(inputs_BxL)), token_pos)
            valid = exists_L.astype(jnp.float32)[None, :]
            if token_pos.segment_ids is not None:  # the target must be in the same document
                valid = valid * (token_pos.segment_ids == ahead(token_pos.segment_ids, -1))
            if weights_BxL is None:  # the mean over the L - k predictions that exist
                weights = valid * (length / (length - k))
            else:
                weights = ahead(weights_BxL) * valid
            losses.append(head_loss(h_BxLxD, ahead(targets_BxL), weights))
        return (sum(losses) / len(losses)).astype(jnp.float32)
