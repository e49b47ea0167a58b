"""Mixture-of-experts feed-forward layer (Shazeer et al. 2017; GShard; Switch; Mixtral).

Routing: a linear router scores every expert; `topk_then_softmax` normalises over the k chosen
logits (Mixtral), `softmax_then_topk` keeps the full-softmax probabilities of the k best
(Switch, GShard). Auxiliary losses: the Switch load-balancing loss E * sum_e f_e * P_e (f_e the
fraction of assignments to expert e, P_e its mean router probability) and the router z-loss
mean(logsumexp(logits)^2) (Zoph et al. 2022, ST-MoE).

Execution, chosen by `moe.mode`:
- `capacity`: each sequence gives every expert C = ceil(factor * L * k / E) slots. Assignments
  claim slots first by choice rank (all first choices before any second choice), then by
  position; an assignment that finds its expert full is dropped and the token keeps only its
  residual. Tokens move through one-hot dispatch/combine einsums, so the capacity is static.
- `dropless`: every assignment is computed: assignments are sorted by expert and run through a
  grouped matmul (`jax.lax.ragged_dot`). Under expert parallelism the same semantics run as the
  capacity path with C = L (a sequence can never send more than L tokens to one expert).

Expert parallelism is in `jaxtron.sharding.experts`: dispatched tokens cross the `expert` mesh
axis with all-to-all. Routing decisions depend only on the sequence, so every layout routes and
drops exactly the same tokens as one device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig, MoEConfig
from jaxtron.models.activations import swiglu
from jaxtron.models.layers import MLP, normal, param
from jaxtron.sharding.experts import expert_ffn, expert_parallel_active
from jaxtron.sharding.rules import constrain


def route(logits_BxLxE, top_k: int, order: str):
    """-> (weights_BxLxK, experts_BxLxK, probs_BxLxE) with probs the full softmax."""
    probs = jax.nn.softmax(logits_BxLxE, axis=-1)
    if order == "softmax_then_topk":
        weights, experts = jax.lax.top_k(probs, top_k)
    else:
        top_logits, experts = jax.lax.top_k(logits_BxLxE, top_k)
        weights = jax.nn.softmax(top_logits, axis=-1)
    return weights, experts, probs


def load_balancing_loss(probs_BxLxE, experts_BxLxK):
    """Switch Transformer eq. 4, generalised to top-k: E * sum_e f_e * P_e."""
    num_experts = probs_BxLxE.shape[-1]
    counts_E = jax.nn.one_hot(experts_BxLxK, num_experts).sum(axis=(0, 1, 2))
    fraction_E = counts_E / experts_BxLxK.size
    mean_prob_E = probs_BxLxE.reshape(-1, num_experts).mean(axis=0)
    return num_experts * jnp.sum(fraction_E * mean_prob_E), fraction_E


def z_loss(logits_BxLxE):
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_BxLxE, axis=-1)))


def capacity(seq_len: int, top_k: int, num_experts: int, factor: float) -> int:
    return max(1, math.ceil(factor * seq_len * top_k / num_experts))


def capacity_slots(experts_BxLxK, num_experts: int, slots: int):
    """Slot of every assignment in its expert's buffer and whether it fits.

    Priority: choice rank first, then position (GShard). Returns (slot_BxLxK, keep_BxLxK).
    """
    b, length, k = experts_BxLxK.shape
    onehot_BxKLxE = jax.nn.one_hot(experts_BxLxK.transpose(0, 2, 1).reshape(b, k * length),
                                   num_experts, dtype=jnp.int32)
    position = jnp.cumsum(onehot_BxKLxE, axis=1) - 1
    slot_BxKL = jnp.sum(position * onehot_BxKLxE, axis=-1)
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

    def __call__(self, x_BxLxD):
        """-> (y_BxLxD, aux) with aux the layer's load-balancing loss, z-loss and statistics."""
        moe, dt = self.moe, x_BxLxD.dtype
        b, length, _ = x_BxLxD.shape
        logits_BxLxE = jnp.einsum("bld,de->ble", x_BxLxD.astype(jnp.float32),
                                  self.router[...].astype(jnp.float32))
        weights_BxLxK, experts_BxLxK, probs = route(logits_BxLxE, moe.top_k, moe.router)
        balance, fraction_E = load_balancing_loss(probs, experts_BxLxK)
        weights = (self.w_gate[...].astype(dt), self.w_up[...].astype(dt),
                   self.w_down[...].astype(dt))
        if moe.mode == "dropless" and not expert_parallel_active():
            y_BxLxD = self._dropless(x_BxLxD, weights_BxLxK, experts_BxLxK, weights)
            kept = jnp.ones(experts_BxLxK.shape, bool)
        else:
            slots = (length if moe.mode == "dropless" else
                     capacity(length, moe.top_k, moe.num_experts, moe.capacity_factor))
            y_BxLxD, kept = self._with_capacity(x_BxLxD, weights_BxLxK, experts_BxLxK,
                                                weights, slots)
        if moe.shared_experts:
            y_BxLxD = y_BxLxD + self.shared(x_BxLxD)
        aux = {"balance": balance, "z": z_loss(logits_BxLxE),
               "dropped": 1.0 - jnp.mean(kept.astype(jnp.float32)),
               "max_load": jnp.max(fraction_E) * moe.num_experts}
        return y_BxLxD, aux

    def _with_capacity(self, x_BxLxD, weights_BxLxK, experts_BxLxK, weights, slots):
        e = self.moe.num_experts
        slot_BxLxK, keep_BxLxK = capacity_slots(experts_BxLxK, e, slots)
        dispatch = (jax.nn.one_hot(experts_BxLxK, e, dtype=x_BxLxD.dtype)[..., None] *
                    jax.nn.one_hot(jnp.where(keep_BxLxK, slot_BxLxK, slots), slots,
                                   dtype=x_BxLxD.dtype)[..., None, :])
        dispatch_BxLxExC = dispatch.sum(axis=2)  # top-k experts are distinct
        combine_BxLxExC = jnp.einsum("blkec,blk->blec", dispatch,
                                     weights_BxLxK.astype(x_BxLxD.dtype))
        x_BxExCxD = jnp.einsum("blec,bld->becd", dispatch_BxLxExC, x_BxLxD)
        y_BxExCxD = expert_ffn(x_BxExCxD, *weights)
        y_BxLxD = jnp.einsum("blec,becd->bld", combine_BxLxExC, y_BxExCxD)
        return constrain(y_BxLxD, ("batch", "residual_seq", "embed")), keep_BxLxK

    def _dropless(self, x_BxLxD, weights_BxLxK, experts_BxLxK, weights):
        b, length, d = x_BxLxD.shape
        k = self.moe.top_k
        x_TxD = x_BxLxD.reshape(b * length, d)
        expert_A = experts_BxLxK.reshape(-1)  # A = T * k assignments, token-major
        order_A = jnp.argsort(expert_A, stable=True)
        token_A = order_A // k
        sizes_E = jnp.bincount(expert_A, length=self.moe.num_experts).astype(jnp.int32)
        w_gate, w_up, w_down = weights
        x_AxD = x_TxD[token_A]
        h_AxF = swiglu(jax.lax.ragged_dot(x_AxD, w_gate, sizes_E),
                       jax.lax.ragged_dot(x_AxD, w_up, sizes_E))
        y_AxD = jax.lax.ragged_dot(h_AxF, w_down, sizes_E)
        gate_A = weights_BxLxK.reshape(-1)[order_A].astype(y_AxD.dtype)
        y_TxD = jnp.zeros_like(x_TxD).at[token_A].add(y_AxD * gate_A[:, None])
        return y_TxD.reshape(b, length, d)
