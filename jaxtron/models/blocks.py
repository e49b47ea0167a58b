"""Transformer blocks: attention plus a dense or mixture-of-experts feed-forward."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxtron.config.schema import ModelConfig, MoEConfig
from jaxtron.models.layers import MLP, Attention, make_norm
from jaxtron.models.mla import MLAttention
from jaxtron.models.moe import MoE
from jaxtron.models.token_positions import PLAIN, TokenPositions
from jaxtron.sharding.rules import constrain

MOE_STATS = ("balance", "z", "dropped", "max_load")


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + ffn(norm(x)).

    The feed-forward is the dense MLP, or a mixture of experts when `moe` is given. Returns the
    new residual stream and the MoE statistics (zeros for a dense block)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: MoEConfig | None = None):
        self.attn_norm = make_norm(cfg, rngs)
        self.attn = MLAttention(cfg, rngs) if cfg.attention == "mla" else Attention(cfg, rngs)
        self.mlp_norm = make_norm(cfg, rngs)
        self.mlp = MoE(cfg, moe, rngs) if moe is not None else MLP(cfg, rngs)
        self.is_moe = moe is not None

    def __call__(self, x_BxLxD, token_pos: TokenPositions = PLAIN):
        x_BxLxD = constrain(x_BxLxD, ("batch", "residual_seq", "embed"))
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), token_pos)
        if self.is_moe:
            y_BxLxD, stats = self.mlp(self.mlp_norm(x_BxLxD), token_pos.order)
        else:
            y_BxLxD = self.mlp(self.mlp_norm(x_BxLxD))
            stats = {name: jnp.zeros((), jnp.float32) for name in MOE_STATS}
        return constrain(x_BxLxD + y_BxLxD, ("batch", "residual_seq", "embed")), stats


class BlockGroup(nnx.Module):
    """`moe.every` blocks in a row, the last one a mixture of experts: the unit that is stacked
    and scanned when MoE layers are interleaved with dense ones."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, rngs: nnx.Rngs):
        self.dense = nnx.data([Block(cfg, rngs) for _ in range(moe.every - 1)])
        self.sparse = Block(cfg, rngs, moe)

    def __call__(self, x_BxLxD, token_pos: TokenPositions = PLAIN):
        for block in self.dense:
            x_BxLxD, _ = block(x_BxLxD, token_pos)
        return self.sparse(x_BxLxD, token_pos)
