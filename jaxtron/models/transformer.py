"""Decoder-only transformer with stacked, scanned blocks.

The N blocks are created once under `nnx.vmap`, so every block parameter has a leading `layers`
axis, and applied with `jax.lax.scan`: compile time does not grow with depth. `scan_layers=False`
runs the same stacked parameters in a Python loop (used to test that scan changes nothing).
The remat policy wraps the block body: `full` recomputes the whole block in the backward pass,
`save_dots` keeps matmul outputs (and attention's output) and recomputes the cheap elementwise
work, `offload` keeps each block's input and attention's output in pinned host memory and
recomputes the rest.

Llama: RMSNorm, RoPE, SwiGLU, grouped-query attention, untied embeddings (Touvron et al. 2023).
GPT-2: LayerNorm, learned positions, GELU, tied embeddings (Radford et al. 2019).

The model is composed in one place, from three pieces that a pipeline runs on its stages too
(`jaxtron.training.stages`):

    embed       token (and position) embeddings, then the dense prefix (DeepSeek-V3's first
                dense layers): the first end
    run_stack   a run of the stacked blocks, the whole stack or one stage's share, and its
                share of the MoE statistics and auxiliary losses
    head_loss   final norm, output head and loss, plus multi-token prediction: the last end

`Transformer.loss` is head_loss(run_stack(embed(tokens))); a model change written in a piece
reaches both.

Tokens may come with a `TokenPositions` (`token_positions.py`): positions that restart at each
document of a packed row and the segment ids that keep attention inside a document, or the
permutation context parallelism applies once per step (`jaxtron.sharding.zigzag`), which RoPE,
learned positions and the MoE capacity priority follow while attention's causal mask follows
the kernel. The loss may weight its targets (`weights_BxL`, a loss mask scaled by the step so
that the mean over every token of the batch is the mean over the counted ones).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtron.config.schema import ModelConfig, MoEConfig
from jaxtron.kernels.blockwise import ATTENTION_RESIDUALS
from jaxtron.kernels.cross_entropy import chunked_cross_entropy
from jaxtron.models.blocks import MOE_STATS, Block, BlockGroup
from jaxtron.models.layers import make_norm, normal, param
from jaxtron.models.mtp import MultiTokenPrediction
from jaxtron.models.token_positions import PLAIN, TokenPositions
from jaxtron.sharding.rules import constrain

BLOCK_INPUT = "block_input"
REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block
    # The weight matmuls' outputs, and attention's output and log-sum-exp where the kernel
    # names them (blockwise and pallas): its backward then needs no second forward.
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*ATTENTION_RESIDUALS)),
    # Nothing kept on the device: each block's input and attention's output and log-sum-exp
    # go to pinned host memory in the forward and come back for the backward, which then
    # recomputes the block's other work from them (MaxText's offload policies). Every use
    # of the block input reads the named copy, so the device copy is not a residual.
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[BLOCK_INPUT, *ATTENTION_RESIDUALS],
        offload_src="device", offload_dst="pinned_host"),
}


class Embedder(nnx.Module):
    """Token (and, for gpt2, learned position) embeddings; the table doubles as the tied head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                           ("vocab", "embed"), cfg.param_dtype)
        if cfg.type == "gpt2":
            self.pos_embed = param(rngs, normal(cfg.init_std), (cfg.max_seq_len, cfg.d_model),
                                   (None, "embed"), cfg.param_dtype)

    def __call__(self, tokens_BxL, positions=None):
        """`positions` ([L] or [B, L]) picks the learned position embeddings (gpt2)."""
        dt = jnp.dtype(self.cfg.compute_dtype)
        # In the compute layout (activation rules) the table is split by vocabulary only: a
        # vocab-parallel lookup whose partial rows are summed across the tensor axis.
        table_VxD = constrain(self.embed[...], ("vocab", "embed"))
        x_BxLxD = jnp.take(table_VxD, tokens_BxL, axis=0).astype(dt)
        if self.cfg.type == "gpt2":
            pos = (self.pos_embed[:tokens_BxL.shape[1]] if positions is None
                   else jnp.take(self.pos_embed[...], positions, axis=0))  # [L|BxL, D]
            x_BxLxD = x_BxLxD + pos.astype(dt)
        return constrain(x_BxLxD, ("batch", "residual_seq", "embed"))


class Head(nnx.Module):
    """Final norm and output projection; with tied embeddings the projection is the table."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.final_norm = make_norm(cfg, rngs)
        if not cfg.tied_embeddings:
            self.lm_head = param(rngs, normal(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                                 ("embed", "vocab"), cfg.param_dtype)

    def __call__(self, x_BxLxD, table_VxD=None):
        x_BxLxD = self.final_norm(x_BxLxD)
        logits_BxLxV = x_BxLxD @ self._matrix(table_VxD).astype(x_BxLxD.dtype)
        return constrain(logits_BxLxV, ("batch", "seq", "vocab"))

    def _matrix(self, table_VxD):
        return table_VxD.T if self.cfg.tied_embeddings else self.lm_head[...]

    def loss(self, x_BxLxD, targets_BxL, table_VxD=None, weights_BxL=None):
        """Mean next-token loss over all B x L targets, each weighted by `weights_BxL` if given
        (not renormalised here: the step scales a loss mask so that this mean is the mean over
        the counted tokens of the whole batch). `model.cross_entropy=chunked` never forms the
        full logits."""
        tokens = targets_BxL.shape[0] * targets_BxL.shape[1]
        if self.cfg.cross_entropy == "plain":
            return cross_entropy_loss(self(x_BxLxD, table_VxD), targets_BxL, weights_BxL,
                                      denominator=tokens)
        return chunked_cross_entropy(self.final_norm(x_BxLxD), self._matrix(table_VxD),
                                     targets_BxL, weights_BxL=weights_BxL, denominator=tokens,
                                     chunk_tokens=self.cfg.loss_chunk_tokens)


def make_blocks(cfg: ModelConfig, rngs: nnx.Rngs, moe: MoEConfig | None = None,
                count: int | None = None) -> nnx.Module:
    """The stacked unit: `count` (default N) blocks, or with `moe` count / moe.every groups
    ending in an MoE block, as one module whose parameters carry a leading `layers` axis."""
    every = moe.every if moe is not None else 1
    count = cfg.num_layers if count is None else count

    @nnx.split_rngs(splits=count // every)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs):
        if moe is None:
            return Block(cfg, rngs)
        return Block(cfg, rngs, moe) if every == 1 else BlockGroup(cfg, moe, rngs)

    return create(rngs)


def run_blocks(cfg: ModelConfig, graphdef, stacked, x_BxLxD, active_N=None,
               token_pos: TokenPositions = PLAIN):
    """Apply stacked units in order -> (x, summed MoE statistics). Where `active_N` is False a
    unit is the identity (padding in uneven pipeline splits). `token_pos`: see the module
    docstring. An MoE layer's per-expert `load` (reported when its routing bias is moved by
    the step) is not summed but stacked, one row per unit."""

    def body(carry, layer):
        x, stats = carry
        x = checkpoint_name(x, BLOCK_INPUT)
        layer_state, active = layer
        y, layer_stats = nnx.merge(graphdef, layer_state)(x, token_pos)
        layer_stats = dict(layer_stats)
        load = layer_stats.pop("load", None)
        if active is not None:  # a padding unit: no output, no statistics
            y = jnp.where(active, y, x)
            layer_stats, load = jax.tree.map(lambda s: jnp.where(active, s, 0.0),
                                             (layer_stats, load))
        return (y, jax.tree.map(jnp.add, stats, layer_stats)), load

    if cfg.remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat],
                              prevent_cse=not cfg.scan_layers)
    carry = (x_BxLxD, {name: jnp.zeros((), jnp.float32) for name in MOE_STATS})
    if cfg.scan_layers:
        (x_BxLxD, stats), loads = jax.lax.scan(body, carry, (stacked, active_N))
    else:
        count = jax.tree.leaves(stacked)[0].shape[0]
        loads = []
        for i in range(count):
            carry, load = body(carry, jax.tree.map(lambda a: a[i], (stacked, active_N)))
            loads.append(load)
        x_BxLxD, stats = carry
        loads = None if loads[0] is None else jnp.stack(loads)
    if loads is not None:
        stats = {**stats, "load": loads}
    return x_BxLxD, stats


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: MoEConfig | None = None):
        self.cfg = cfg
        self.moe = moe if moe is not None and moe.enabled else None
        self.embedder = Embedder(cfg, rngs)
        stacked = cfg.num_layers
        if self.moe is not None and self.moe.first_dense_layers:
            # DeepSeek-V3's dense first layers: a stack of their own, run before the MoE one.
            self.dense_blocks = make_blocks(cfg, rngs, None, self.moe.first_dense_layers)
            stacked = self.moe.stacked_layers(cfg.num_layers)
        self.blocks = make_blocks(cfg, rngs, self.moe, stacked)
        self.head = Head(cfg, rngs)
        if cfg.mtp_depth:
            self.mtp = MultiTokenPrediction(cfg, rngs)

    def __call__(self, tokens_BxL, token_pos: TokenPositions = PLAIN):
        """Token ids -> logits_BxLxV in the compute dtype."""
        return self.forward(tokens_BxL, token_pos)[0]

    def forward(self, tokens_BxL, token_pos: TokenPositions = PLAIN):
        """-> (logits_BxLxV, aux): aux holds the MoE statistics averaged over MoE layers and
        `weighted_terms`, the auxiliary losses to add to the training objective."""
        x_BxLxD, aux = self._trunk(tokens_BxL, token_pos)
        return self.head(x_BxLxD, self.embedder.embed[...]), aux

    def loss(self, tokens_BxL, targets_BxL, token_pos: TokenPositions = PLAIN,
             weights_BxL=None):
        """-> (mean next-token loss, aux) without returning logits (see Head.loss)."""
        x_BxLxD, aux = self._trunk(tokens_BxL, token_pos)
        loss, last = head_loss(self.cfg, self.head, getattr(self, "mtp", None), x_BxLxD,
                               tokens_BxL, targets_BxL, token_pos, weights_BxL,
                               self.embedder.embed[...], self.embedder)
        return loss, merge_aux(aux, last)

    def _trunk(self, tokens_BxL, token_pos: TokenPositions):
        x_BxLxD = embed(self.cfg, self.embedder, getattr(self, "dense_blocks", None), tokens_BxL,
                        token_pos)
        return run_stack(self.cfg, self.moe, self.blocks, x_BxLxD, token_pos)


def embed(cfg: ModelConfig, embedder: Embedder, dense_blocks, tokens_BxL,
          token_pos: TokenPositions = PLAIN):
    """The first end: token (and learned position) embeddings, then the dense prefix if the
    model has one (`dense_blocks`, else None)."""
    positions = None if token_pos.positions is None and token_pos.order is None else \
        token_pos.positions_for(tokens_BxL.shape[1])
    x_BxLxD = embedder(tokens_BxL, positions)
    if dense_blocks is not None:
        x_BxLxD, _ = run_blocks(cfg, *nnx.split(dense_blocks), x_BxLxD, token_pos=token_pos)
    return x_BxLxD


def run_stack(cfg: ModelConfig, moe: MoEConfig | None, blocks, x_BxLxD,
              token_pos: TokenPositions = PLAIN, active_N=None):
    """A run of stacked blocks -> (x, aux): the whole stack, or a pipeline stage's share of it
    (`active_N` masks the stage's padding units, see `run_blocks`). aux holds this run's share
    of the MoE statistics and auxiliary losses (`moe_aux`), {} for a dense model."""
    x_BxLxD, stats = run_blocks(cfg, *nnx.split(blocks), x_BxLxD, active_N, token_pos)
    return x_BxLxD, ({} if moe is None else moe_aux(cfg, moe, stats))


def head_loss(cfg: ModelConfig, head: Head, mtp, x_BxLxD, inputs_BxL, targets_BxL,
              token_pos: TokenPositions, weights_BxL, table_VxD, embedder):
    """The last end -> (mean next-token loss, aux): the head's loss (tied to `table_VxD` with
    `model.tied_embeddings`), and with multi-token prediction (`mtp`, else None) its mean loss
    in aux, weighted into `weighted_terms`; `embedder` embeds the tokens ahead it reads."""
    loss = head.loss(x_BxLxD, targets_BxL, table_VxD, weights_BxL)
    if mtp is None:
        return loss, {}
    mtp_loss = mtp.mean_loss(x_BxLxD, inputs_BxL, targets_BxL, embed=embedder,
                             head_loss=lambda h, t, w: head.loss(h, t, table_VxD, w),
                             token_pos=token_pos, weights_BxL=weights_BxL)
    return loss, {"mtp_loss": mtp_loss, "weighted_terms": [cfg.mtp_loss_coef * mtp_loss]}


def merge_aux(*auxes: dict) -> dict:
    """Pieces' aux dicts as one: their `weighted_terms` joined, other entries side by side."""
    merged = {}
    for aux in auxes:
        merged.update({k: v for k, v in aux.items() if k != "weighted_terms"})
    terms = [term for aux in auxes for term in aux.get("weighted_terms", [])]
    return {**merged, "weighted_terms": terms} if terms else merged


def moe_aux(cfg: ModelConfig, moe: MoEConfig, stats: dict) -> dict:
    """MoE statistics summed over (some of) the MoE layers -> their share of the per-layer mean
    (`moe_<name>`) and of the weighted auxiliary losses (`weighted_terms`): a pipeline stage's
    shares add up over stages to the whole model's."""
    moe_layers = moe.stacked_layers(cfg.num_layers) // moe.every
    stats = dict(stats)
    load = stats.pop("load", None)
    mean = {name: value / moe_layers for name, value in stats.items()}
    aux = {f"moe_{name}": value for name, value in mean.items()}
    if load is not None:
        aux["moe_load"] = load  # [units, experts]: each layer's own
    aux["weighted_terms"] = [moe.aux_loss_coef * mean["balance"], moe.z_loss_coef * mean["z"]]
    return aux


def cross_entropy_loss(logits_BxLxV, targets_BxL, weights_BxL=None, denominator=None):
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
    if denominator is None:  # the weighted mean
        denominator = jnp.maximum(jnp.sum(weights_BxL), 1.0)
    return jnp.sum(nll_BxL * weights_BxL) / denominator
