"""Mixture-of-experts feed-forward layer (Shazeer et al. 2017; GShard; Switch; Mixtral).

Routing: a linear router scores every expert; `topk_then_softmax` normalises over the k chosen
logits (Mixtral), `softmax_then_topk` keeps the full-softmax probabilities of the k best
(Switch, GShard). `score: sigmoid` (DeepSeek-V3, arXiv:2412.19437 eq. 13-16) scores each
expert with its own sigmoid and normalises the k chosen scores; `route_groups` and
`route_top_groups` (DeepSeek-V3's node-limited routing) let a token choose only among the
experts of its best groups, a group scoring the sum of its two best experts. Auxiliary losses:
the Switch load-balancing loss E * sum_e f_e * P_e (f_e the fraction of assignments to expert
e, P_e its mean router probability) and the router z-loss mean(logsumexp(logits)^2) (Zoph et
al. 2022, ST-MoE).

Execution, chosen by `moe.mode`:
- `capacity`: each sequence gives every expert C = ceil(factor * L * k / E) slots. Assignments
  claim slots first by choice rank (all first choices before any second choice), then by
  position; an assignment that finds its expert full is dropped and the token keeps only its
  residual. Tokens move by gather into [B, E, C, D] slot buffers and back (no one-hot [L, E, C]
  tensors), so the capacity is static and memory grows with E x C, not L x E x C.
- `dropless`: every assignment is computed. Each sequence sorts its own L * k assignments by
  expert and runs them through one grouped matmul, `ragged_dot_general` over x[B, L*k, D] with
  group sizes [B, E] (one row of E sizes per sequence). Routing a token depends only on the
  token, so this equals one global sort; but B is the axis sharded over data/fsdp, so each
  device sorts and multiplies only its own sequences: per-device work falls as 1/(data*fsdp),
  where a global sort gathered every assignment onto every device. Under expert parallelism
  each rank sends every expert's owner exactly the assignments routed there by ragged
  all-to-all (`jaxtron.kernels.dropless_experts`), into a buffer of `moe.ep_buffer_factor` x
  its T k rows (null: room for all that can come, nothing dropped).

Top-k is taken with a stable sort rather than `lax.top_k`: XLA's SPMD partitioner gathers a
TopK's whole operand onto every device, a sort it splits along the batch.

Expert parallelism is in `jaxtron.kernels.experts`: dispatched tokens cross the `expert` mesh
axis with all-to-all. Routing decisions depend only on the sequence, so every layout routes and
drops exactly the same tokens as one device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.schema import ModelConfig, MoEConfig
from jaxtron.kernels.activations import swiglu
from jaxtron.kernels.dropless_experts import dropless_expert_ffn
from jaxtron.kernels.experts import expert_ffn, expert_parallel_active
from jaxtron.kernels.fp8 import grouped_matmul
from jaxtron.models.layers import MLP, normal, param
from jaxtron.sharding.rules import constrain, mean_over_batch_shards


def top_k(x_BxLxE, k: int):
    """`jax.lax.top_k` over the last axis (ties to the lower index), written as a stable sort:
    XLA's SPMD partitioner splits a sort along its other axes, but gathers a TopK's whole
    operand (every token's scores) onto every device and routes all tokens there."""
    axis = x_BxLxE.ndim - 1
    iota = jax.lax.broadcasted_iota(jnp.int32, x_BxLxE.shape, axis)
    negated, index = jax.lax.sort((-x_BxLxE, iota), dimension=axis, num_keys=1, is_stable=True)
    return -negated[..., :k], index[..., :k]


def group_mask(scores_BxLxE, groups: int, top_groups: int):
    """Experts of each token's `top_groups` best groups (DeepSeek-V3 node-limited routing).

    The E experts split into `groups` equal consecutive groups; a group scores the sum of its
    two best experts (its best one when a group holds a single expert). -> bool [B, L, E]."""
    b, length, e = scores_BxLxE.shape
    per_group = e // groups
    scores_BxLxGxS = scores_BxLxE.reshape(b, length, groups, per_group)
    best_BxLxGx2, _ = top_k(scores_BxLxGxS, min(2, per_group))
    _, chosen_BxLxT = top_k(best_BxLxGx2.sum(axis=-1), top_groups)
    keep_BxLxG = jax.nn.one_hot(chosen_BxLxT, groups, dtype=jnp.int32).sum(axis=-2) > 0
    return jnp.repeat(keep_BxLxG, per_group, axis=-1)


def route(logits_BxLxE, k: int, order: str, *, score: str = "softmax", groups: int = 1,
          top_groups: int = 1, scale: float = 1.0, bias_E=None):
    """-> (weights_BxLxK, experts_BxLxK, probs_BxLxE).

    score=softmax: probs is the full softmax; `order` says whether the weights are the softmax
    of the k chosen logits or the chosen full-softmax probabilities. score=sigmoid (DeepSeek-V3):
    the top-k is taken on sigmoid(logits) and the weights are the chosen scores normalised to
    sum 1 (for k > 1; one expert keeps its raw score so the router still learns, as in
    DeepSeek-V3 and Megatron); probs, the load-balancing loss's probabilities, are the scores
    normalised per token. With `groups` > 1 a token picks its k experts only among the experts
    of its `top_groups` best groups (`group_mask`), scored on the softmax probabilities or the
    sigmoid scores. `scale` multiplies the weights (DeepSeek-V3: 2.5). `bias_E` (auxiliary-
    loss-free balancing) is added to the scores for choosing the experts (and groups) only: the
    weights come from the unbiased scores."""
    if score == "sigmoid":
        scores = jax.nn.sigmoid(logits_BxLxE)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        ranked = scores
    else:
        scores = probs = jax.nn.softmax(logits_BxLxE, axis=-1)
        # softmax is monotone: the k best logits are the k best probabilities
        ranked = probs if order == "softmax_then_topk" else logits_BxLxE
    chosen_from = ranked
    if bias_E is not None:  # the bias moves the choice, never the weights
        scores = ranked = scores + jax.lax.stop_gradient(bias_E)
    if groups > 1:  # the other groups' experts cannot be chosen
        ranked = jnp.where(group_mask(scores, groups, top_groups), ranked, -jnp.inf)
    top_values, experts = top_k(ranked, k)
    if bias_E is not None:
        top_values = jnp.take_along_axis(chosen_from, experts, axis=-1)
    if score == "sigmoid":
        weights = top_values / jnp.sum(top_values, axis=-1, keepdims=True) if k > 1 else top_values
    elif order == "softmax_then_topk":
        weights = top_values
    else:
        weights = jax.nn.softmax(top_values, axis=-1)
    if scale != 1.0:
        weights = weights * scale
    return weights, experts, probs


def load_balancing_loss(probs_BxLxE, experts_BxLxK):
    """Switch Transformer eq. 4, generalised to top-k: E * sum_e f_e * P_e.

    f_e (no gradient: it counts argmax choices) is the whole batch's, also where a rank sees only
    its rows (data-parallel reduction, pipeline replicas); P_e stays the rank's own, so the mean
    over ranks of their losses, and of their gradients, is the whole batch's, as on one
    device."""
    num_experts = probs_BxLxE.shape[-1]
    counts_E = jax.nn.one_hot(experts_BxLxK, num_experts).sum(axis=(0, 1, 2))
    fraction_E = mean_over_batch_shards(jax.lax.stop_gradient(counts_E / experts_BxLxK.size))
    mean_prob_E = probs_BxLxE.reshape(-1, num_experts).mean(axis=0)
    return num_experts * jnp.sum(fraction_E * mean_prob_E), fraction_E


def z_loss(logits_BxLxE):
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_BxLxE, axis=-1)))


def capacity(seq_len: int, top_k: int, num_experts: int, factor: float) -> int:
    return max(1, math.ceil(factor * seq_len * top_k / num_experts))


def capacity_slots(experts_BxLxK, num_experts: int, slots: int, positions_L=None):
    """Slot of every assignment in its expert's buffer and whether it fits.

    Priority: choice rank first, then position (GShard): the index along L, or `positions_L`
    when the sequence comes reordered. Returns (slot_BxLxK, keep_BxLxK).
    """
    if positions_L is not None:  # claim slots in position order, report them in array order
        order_L = jnp.argsort(positions_L)
        slot, keep = capacity_slots(experts_BxLxK[:, order_L], num_experts, slots)
        back_L = jnp.argsort(order_L)
        return slot[:, back_L], keep[:, back_L]
    b, length, k = experts_BxLxK.shape
    # Claim order: choice rank, then position. A stable sort by expert keeps that order within
    # each expert, so an assignment's slot is its rank in the sort minus its expert's first
    # rank: O(L k log(L k)) per sequence, where a cumulative sum over one-hot rows costs L k E.
    expert_BxKL = experts_BxLxK.transpose(0, 2, 1).reshape(b, k * length)
    order_BxKL = jnp.argsort(expert_BxKL, axis=-1, stable=True)
    sorted_BxKL = jnp.take_along_axis(expert_BxKL, order_BxKL, axis=-1)
    first_BxE = jax.vmap(lambda row: jnp.searchsorted(row, jnp.arange(num_experts)))(
        sorted_BxKL)
    rank_BxKL = jnp.arange(k * length)[None, :] - jnp.take_along_axis(first_BxE, sorted_BxKL,
                                                                       axis=-1)
    # Scatters are vmapped over the sequence: a batch dimension GSPMD splits without moving
    # data (explicit row indices would make it exchange rows with collective-permutes).
    slot_BxKL = jax.vmap(lambda order, rank: jnp.zeros_like(rank).at[order].set(rank))(
        order_BxKL, rank_BxKL)
    slot_BxLxK = slot_BxKL.reshape(b, k, length).transpose(0, 2, 1)
    return slot_BxLxK, slot_BxLxK < slots


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig, rngs: nnx.Rngs):
        self.cfg, self.moe = cfg, moe
        e, d, f = moe.num_experts, cfg.d_model, moe.expert_mlp_dim or cfg.mlp_dim
        pd, init = cfg.param_dtype, normal(cfg.init_std)
        out_init = normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        self.router = param(rngs, init, (d, e), ("embed", None), pd)
        self.w_gate = param(rngs, init, (e, d, f), ("expert", "embed", "mlp"), pd)
        self.w_up = param(rngs, init, (e, d, f), ("expert", "embed", "mlp"), pd)
        self.w_down = param(rngs, out_init, (e, f, d), ("expert", "mlp", "embed"), pd)
        if moe.shared_experts:
            shared = ModelConfig(**{**cfg.__dict__, "type": "llama",
                                    "mlp_dim": moe.shared_experts * f})
            self.shared = MLP(shared, rngs)
        if moe.bias_update_rate > 0:  # moved by the step from each expert's load, not trained
            self.router_bias = param(rngs, nnx.initializers.zeros, (e,), (None,), jnp.float32)

    def __call__(self, x_BxLxD, order_L=None):
        """-> (y_BxLxD, aux) with aux the layer's load-balancing loss, z-loss and statistics.
        `order_L` (each token's index in the row's natural order; None: 0..L-1) orders the
        capacity mode's claims on slots."""
        moe, dt = self.moe, x_BxLxD.dtype
        b, length, _ = x_BxLxD.shape
        logits_BxLxE = jnp.einsum("bld,de->ble", x_BxLxD.astype(jnp.float32),
                                  self.router[...].astype(jnp.float32))
        weights_BxLxK, experts_BxLxK, probs = route(
            logits_BxLxE, moe.top_k, moe.router, score=moe.score, groups=moe.route_groups,
            top_groups=moe.route_top_groups, scale=moe.route_scale,
            bias_E=self.router_bias[...] if moe.bias_update_rate > 0 else None)
        balance, fraction_E = load_balancing_loss(probs, experts_BxLxK)
        weights = (self.w_gate[...].astype(dt), self.w_up[...].astype(dt),
                   self.w_down[...].astype(dt))
        if moe.mode == "dropless" and not expert_parallel_active():
            y_BxLxD = self._dropless(x_BxLxD, weights_BxLxK, experts_BxLxK, weights)
            kept = jnp.ones(experts_BxLxK.shape, bool)
        elif moe.mode == "dropless":  # each expert's owner gets exactly its assignments
            y_BxLxKxD, kept = dropless_expert_ffn(x_BxLxD, experts_BxLxK, *weights,
                                                  buffer_factor=moe.ep_buffer_factor,
                                                  fp8=self.cfg.fp8)
            y_BxLxD = constrain(jnp.einsum("blkd,blk->bld", y_BxLxKxD, weights_BxLxK.astype(dt)),
                                ("batch", "residual_seq", "embed"))
        else:
            slots = capacity(length, moe.top_k, moe.num_experts, moe.capacity_factor)
            y_BxLxD, kept = self._with_capacity(x_BxLxD, weights_BxLxK, experts_BxLxK,
                                                order_L, weights, slots)
        if moe.shared_experts:
            y_BxLxD = y_BxLxD + self.shared(x_BxLxD)
        aux = {"balance": balance, "z": z_loss(logits_BxLxE),
               "dropped": 1.0 - jnp.mean(kept.astype(jnp.float32)),
               "max_load": jnp.max(fraction_E) * moe.num_experts}
        if moe.bias_update_rate > 0:
            aux["load"] = fraction_E  # per expert, for the step's bias update
        return y_BxLxD, aux

    def _with_capacity(self, x_BxLxD, weights_BxLxK, experts_BxLxK, positions_L, weights,
                       slots):
        e = self.moe.num_experts
        slot_BxLxK, keep_BxLxK = capacity_slots(experts_BxLxK, e, slots, positions_L)
        b, length, k = experts_BxLxK.shape
        # Each kept assignment's row in the flat [E * C] buffer; dropped ones point one past
        # it. Tokens move by gather/scatter on these indices: no [L, E, C] one-hot tensor,
        # whose size (L x E x C per sequence) rules out fine-grained experts.
        row_BxLK = jnp.where(keep_BxLxK, experts_BxLxK * slots + slot_BxLxK,
                             e * slots).reshape(b, length * k)
        token_BxLK = jnp.broadcast_to(jnp.arange(length * k) // k, (b, length * k))
        # The token filling each slot (L for an empty slot: a zero row appended to x).
        token_of_slot = jax.vmap(lambda rows, tokens: jnp.full(
            e * slots + 1, length, jnp.int32).at[rows].set(tokens))(row_BxLK, token_BxLK)[:, :-1]
        x_padded = jnp.concatenate([x_BxLxD, jnp.zeros_like(x_BxLxD[:, :1])], axis=1)
        x_BxExCxD = jnp.take_along_axis(x_padded, token_of_slot[..., None], axis=1).reshape(
            b, e, slots, -1)
        y_BxExCxD = expert_ffn(x_BxExCxD, *weights, fp8=self.cfg.fp8)
        y_flat = jnp.concatenate([y_BxExCxD.reshape(b, e * slots, -1),
                                  jnp.zeros_like(y_BxExCxD[:, 0, :1])], axis=1)
        y_BxLKxD = jnp.take_along_axis(y_flat, row_BxLK[..., None], axis=1)
        y_BxLxD = jnp.einsum("blkd,blk->bld", y_BxLKxD.reshape(b, length, k, -1),
                             weights_BxLxK.astype(x_BxLxD.dtype))
        return constrain(y_BxLxD, ("batch", "residual_seq", "embed")), keep_BxLxK

    def _dropless(self, x_BxLxD, weights_BxLxK, experts_BxLxK, weights):
        """Every assignment through its expert, one sort and one grouped matmul per sequence.

        Routing a token depends only on the token, so grouping the assignments by sequence gives
        the same result as one global sort; but the batch axis is the one sharded over
        data/fsdp, so every device sorts and multiplies only its own sequences (a global sort
        would gather all assignments onto every device and repeat all the work there)."""
        b, length, d = x_BxLxD.shape
        k, e, dt = self.moe.top_k, self.moe.num_experts, x_BxLxD.dtype
        expert_BxA = experts_BxLxK.reshape(b, length * k)  # A = L * k assignments, token-major
        order_BxA = jnp.argsort(expert_BxA, axis=-1, stable=True)
        sizes_BxE = jax.nn.one_hot(expert_BxA, e, dtype=jnp.int32).sum(axis=1)
        x_BxAxD = jnp.take_along_axis(x_BxLxD, (order_BxA // k)[..., None], axis=1)
        x_BxAxD = constrain(x_BxAxD, ("batch", None, "embed"))
        w_gate, w_up, w_down = weights
        fp8 = self.cfg.fp8
        h_BxAxF = swiglu(grouped_matmul(x_BxAxD, w_gate, sizes_BxE, fp8),
                         grouped_matmul(x_BxAxD, w_up, sizes_BxE, fp8))
        h_BxAxF = constrain(h_BxAxF, ("batch", None, "mlp"))
        y_BxAxD = grouped_matmul(h_BxAxF, w_down, sizes_BxE, fp8)
        unsort_BxA = jnp.argsort(order_BxA, axis=-1)  # the inverse permutation: back to token-major
        y_BxLxKxD = jnp.take_along_axis(y_BxAxD, unsort_BxA[..., None], axis=1).reshape(
            b, length, k, d)
        y_BxLxD = jnp.einsum("blkd,blk->bld", y_BxLxKxD, weights_BxLxK.astype(dt))
        return constrain(y_BxLxD, ("batch", "residual_seq", "embed"))


def update_router_bias(params, load_NxE, rate: float):
    """Auxiliary-loss-free balancing (DeepSeek-V3; Megatron's --moe-router-enable-expert-bias):
    every MoE layer's `router_bias` moves by `rate` towards balance, up for the experts that got
    fewer than their share of the step's assignments and down for the others. `load_NxE` is
    each stacked unit's fraction of assignments per expert, in the order of the stack."""
    def step(path, value):
        if not any(getattr(key, "key", None) == "router_bias" for key in path):
            return value
        error = jnp.mean(load_NxE, axis=-1, keepdims=True) - load_NxE
        return value + rate * jnp.sign(error).astype(value.dtype)

    return jax.tree_util.tree_map_with_path(step, params)
