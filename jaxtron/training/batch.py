"""A batch as the model takes it: inputs and targets, token positions, loss weights, and
microbatches.

A batch is a dict of [B, ...] arrays (`jaxtron.data`): `tokens` (inputs and shifted targets),
and for packed rows `positions` / `segment_ids`, and `loss_mask` where only some targets count.
The mask becomes `loss_weights` once per step, over the whole global batch
(`counted_tokens_mean`): scaled so that the plain mean over all tokens is the mean over the
counted ones. Every microbatch and data-parallel rank then averages equal-sized shards, and the
step's loss is the global mean over counted tokens however unevenly the mask falls across
microbatches (Megatron divides by the global number of loss tokens the same way).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxtron.models.token_positions import TokenPositions


def counted_tokens_mean(batch: dict) -> dict:
    """`loss_mask` -> `loss_weights` = mask x (B x L) / (counted tokens in the batch): the mean
    of nll x weights over all B x L targets is then the mean over the counted ones."""
    if "loss_mask" not in batch:
        return batch
    batch = dict(batch)
    mask = batch.pop("loss_mask").astype(jnp.float32)
    batch["loss_weights"] = mask * (mask.size / jnp.maximum(jnp.sum(mask), 1.0))
    return batch


def token_positions(tree: dict) -> TokenPositions:
    """The positions and segment ids of a batch (or microbatch) as the model takes them (absent
    for plain rows)."""
    return TokenPositions(positions=tree.get("positions"), segment_ids=tree.get("segment_ids"))


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    inputs_BxL: jax.Array
    targets_BxL: jax.Array
    token_pos: TokenPositions
    weights_BxL: jax.Array | None


def model_inputs(batch: dict) -> ModelInputs:
    """What the model's loss takes from a batch whose mask is already weights."""
    if "loss_mask" in batch:  # a mask read as weights would average over a microbatch only
        raise ValueError("the batch holds a raw loss_mask: pass it through "
                         "counted_tokens_mean(batch) over the whole global batch first.")
    tokens = batch["tokens"]
    return ModelInputs(tokens[:, :-1], tokens[:, 1:], token_positions(batch),
                       batch.get("loss_weights"))


def split_microbatches(tree, microbatches: int):
    """[B, ...] leaves -> [A, B/A, ...]: microbatch a takes rows a, a + A, a + 2A, ..., so each
    device's contiguous rows of a data-sharded batch stay on that device and slicing moves no
    data. None leaves stay None."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] // microbatches, microbatches,
                                            *a.shape[1:]).swapaxes(0, 1), tree)
