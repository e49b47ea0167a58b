"""The held-out loss: every evaluation batch of every source, weighted by counted tokens."""

from __future__ import annotations

import jax
import numpy as np


def evaluate(trainer, state, held_out, sources) -> dict:
    """{"eval_loss": ...} and, for a blend, each source's `eval_loss/<label>`; the blend's
    loss is the weighted mean of its sources' (what the training mixture is expected to see)."""
    per_source = {}
    for label, batches in held_out:
        losses, counted = [], []
        for host_batch in batches:
            batch = trainer.put_batch(host_batch)
            losses.append(trainer.eval_loss(state, batch))
            # Each batch's loss is its mean over counted targets (over every host's rows):
            # weight it by their number, so the source's loss is the mean over its tokens.
            counted.append(jax.numpy.sum(batch["loss_mask"]) if "loss_mask" in batch else 1.0)
        losses, counted = np.asarray(jax.device_get(losses)), np.asarray(jax.device_get(counted))
        per_source[label] = float(np.dot(losses, counted) / max(counted.sum(), 1.0))
    if len(sources) == 1:
        return {"eval_loss": per_source[sources[0].label]}
    total = sum(s.weight for s in sources)
    result = {"eval_loss": sum(s.weight * per_source[s.label] for s in sources) / total}
    result.update({f"eval_loss/{label}": loss for label, loss in per_source.items()})
    return result
