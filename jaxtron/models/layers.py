"""Building blocks: norms, rotary embeddings, attention and feed-forward layers.

Each parameter is created with its logical axis names (`param(...)`); the sharding rules turn
those into mesh placements. Parameters are stored in `param_dtype` and cast to the compute
`dtype` at use, so master weights stay fp32 under bf16 compute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.schema import ModelConfig
from jaxtron.kernels.activations import gelu_tanh, swiglu
from jaxtron.kernels.attention import attention
from jaxtron.kernels.fp8 import einsum
from jaxtron.models import rope
from jaxtron.models.token_positions import PLAIN, TokenPositions
from jaxtron.sharding.rules import constrain


def param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
    """A parameter tagged with logical axis names; placement happens later, in one jit."""
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=tuple(names),
                     eager_sharding=False)


def fp8_histories(cfg: ModelConfig, rngs: nnx.Rngs, matmuls: int) -> nnx.Param | None:
    """Delayed fp8 scaling's amax histories of a layer's `matmuls` fp8 matmuls, [matmuls,
    model.fp8_amax_history, 3] (kernels/fp8.py); None unless `model.fp8: delayed`."""
    if cfg.fp8 != "delayed":
        return None
    return param(rngs, nnx.initializers.zeros, (matmuls, cfg.fp8_amax_history, 3),
                 (None, None, None), jnp.float32)


def fp8_history(histories: nnx.Param | None, matmul: int):
    """The amax history of one fp8 matmul of a layer (None without delayed scaling)."""
    return None if histories is None else histories[...][matmul]


def normal(std: float):
    return nnx.initializers.normal(stddev=std)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.scale = param(rngs, nnx.initializers.ones, (cfg.d_model,), ("embed",),
                           cfg.param_dtype)

    def __call__(self, x_BxLxD):
        x = x_BxLxD.astype(jnp.float32)  # statistics in fp32 whatever the compute dtype
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...].astype(jnp.float32)).astype(x_BxLxD.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.scale = param(rngs, nnx.initializers.ones, (cfg.d_model,), ("embed",),
                           cfg.param_dtype)
        self.bias = param(rngs, nnx.initializers.zeros, (cfg.d_model,), ("embed",),
                          cfg.param_dtype)

    def __call__(self, x_BxLxD):
        x = x_BxLxD.astype(jnp.float32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        x = (x - mean) * jax.lax.rsqrt(var + self.eps)
        x = x * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return x.astype(x_BxLxD.dtype)


def make_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return LayerNorm(cfg, rngs) if cfg.type == "gpt2" else RMSNorm(cfg, rngs)


def head_rms_norm(x_BxLxHxK, scale_K, eps: float):
    """RMSNorm over each head's last axis (QK-norm), statistics in fp32 as in `RMSNorm`."""
    x = x_BxLxHxK.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * scale_K.astype(jnp.float32)).astype(x_BxLxHxK.dtype)


def rotary(x_BxLxHxK, positions, cfg: ModelConfig):
    """RoPE (Su et al. 2021), rotating pairs (i, i + K/2) as Llama does, at the rates of
    `models/rope.py` (plain, or scaled by `model.rope_scaling`). `positions` is [L] (every row
    alike) or [B, L] (packed rows, restarting at each document)."""
    width = x_BxLxHxK.shape[-1]
    freq_K2 = jnp.asarray(rope.inverse_frequencies(cfg, width), jnp.float32)
    angle = positions.astype(jnp.float32)[..., None] * freq_K2  # [L, K2] or [B, L, K2]
    angle_BxLx1xK2 = (angle[None] if angle.ndim == 2 else angle)[:, :, None, :]
    scale = rope.rotation_scale(cfg)
    sin, cos = jnp.sin(angle_BxLx1xK2) * scale, jnp.cos(angle_BxLx1xK2) * scale
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


class Attention(nnx.Module):
    """Multi-head / grouped-query self-attention; heads are the tensor-parallel axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, g, k = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim
        init, pd = normal(cfg.init_std), cfg.param_dtype
        # Output projection scaled by depth, as in GPT-2, so the residual stream stays O(1).
        out_init = normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        self.wq = param(rngs, init, (d, h, k), ("embed", "heads", "head_dim"), pd)
        self.wk = param(rngs, init, (d, g, k), ("embed", "kv_heads", "head_dim"), pd)
        self.wv = param(rngs, init, (d, g, k), ("embed", "kv_heads", "head_dim"), pd)
        self.wo = param(rngs, out_init, (h, k, d), ("heads", "head_dim", "embed"), pd)
        # GPT-2 biases every projection; Qwen2 (model.qkv_bias) only q, k and v.
        self.use_bias, self.qkv_bias = cfg.type == "gpt2", cfg.type == "gpt2" or cfg.qkv_bias
        zeros = nnx.initializers.zeros
        if self.qkv_bias:
            self.bq = param(rngs, zeros, (h, k), ("heads", "head_dim"), pd)
            self.bk = param(rngs, zeros, (g, k), ("kv_heads", "head_dim"), pd)
            self.bv = param(rngs, zeros, (g, k), ("kv_heads", "head_dim"), pd)
        if self.use_bias:
            self.bo = param(rngs, zeros, (d,), ("embed",), pd)
        if cfg.qk_norm:  # Qwen3: RMSNorm of each head's query and key, one scale per head dim
            ones = nnx.initializers.ones
            self.q_norm = param(rngs, ones, (k,), ("head_dim",), pd)
            self.k_norm = param(rngs, ones, (k,), ("head_dim",), pd)
        self.fp8_amax_history = fp8_histories(cfg, rngs, 4)  # q, k, v, out

    def project_qkv(self, x_BxLxD, positions):
        """q_BxLxHxK, k/v_BxLxGxK with biases, QK-norm and rotary positions applied."""
        cfg, dt = self.cfg, x_BxLxD.dtype
        h = self.fp8_amax_history
        q_BxLxHxK = einsum("bld,dhk->blhk", x_BxLxD, self.wq[...].astype(dt), cfg.fp8,
                           fp8_history(h, 0))
        k_BxLxGxK = einsum("bld,dgk->blgk", x_BxLxD, self.wk[...].astype(dt), cfg.fp8,
                           fp8_history(h, 1))
        v_BxLxGxK = einsum("bld,dgk->blgk", x_BxLxD, self.wv[...].astype(dt), cfg.fp8,
                           fp8_history(h, 2))
        if self.qkv_bias:
            q_BxLxHxK += self.bq[...].astype(dt)
            k_BxLxGxK += self.bk[...].astype(dt)
            v_BxLxGxK += self.bv[...].astype(dt)
        if cfg.qk_norm:  # before RoPE, as Qwen3 does
            q_BxLxHxK = head_rms_norm(q_BxLxHxK, self.q_norm[...], cfg.norm_eps)
            k_BxLxGxK = head_rms_norm(k_BxLxGxK, self.k_norm[...], cfg.norm_eps)
        if cfg.type == "llama":
            q_BxLxHxK = rotary(q_BxLxHxK, positions, cfg)
            k_BxLxGxK = rotary(k_BxLxGxK, positions, cfg)
        return q_BxLxHxK, k_BxLxGxK, v_BxLxGxK

    def project_out(self, out_BxLxHxK):
        dt = out_BxLxHxK.dtype
        out_BxLxD = einsum("blhk,hkd->bld", out_BxLxHxK, self.wo[...].astype(dt),
                           self.cfg.fp8, fp8_history(self.fp8_amax_history, 3))
        if self.use_bias:
            out_BxLxD += self.bo[...].astype(dt)
        return out_BxLxD

    def __call__(self, x_BxLxD, token_pos: TokenPositions = PLAIN):
        """`token_pos`: positions for RoPE, and the documents attention must not cross. The
        causal mask, and `model.sliding_window`'s band, are the kernel's (see
        `jaxtron.sharding.zigzag` for a reordered sequence)."""
        positions = token_pos.positions_for(x_BxLxD.shape[1])
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = self.project_qkv(x_BxLxD, positions)
        q_BxLxHxK = constrain(q_BxLxHxK, ("batch", "seq", "heads", "head_dim"))
        k_BxLxGxK = constrain(k_BxLxGxK, ("batch", "seq", "kv_heads", "head_dim"))
        v_BxLxGxK = constrain(v_BxLxGxK, ("batch", "seq", "kv_heads", "head_dim"))
        out_BxLxHxK = attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, causal=True,
                                segment_ids=token_pos.segment_ids, impl=self.cfg.attention_impl,
                                window=self.cfg.sliding_window)
        return self.project_out(out_BxLxHxK)


class MLP(nnx.Module):
    """SwiGLU (llama) or GELU (gpt2) feed-forward: column-parallel in, row-parallel out."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, pd = cfg.d_model, cfg.mlp_dim, cfg.param_dtype
        init = normal(cfg.init_std)
        out_init = normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        self.fp8 = cfg.fp8
        self.gated = cfg.type == "llama"
        if self.gated:
            self.w_gate = param(rngs, init, (d, f), ("embed", "mlp"), pd)
            self.w_up = param(rngs, init, (d, f), ("embed", "mlp"), pd)
            self.w_down = param(rngs, out_init, (f, d), ("mlp", "embed"), pd)
        else:
            zeros = nnx.initializers.zeros
            self.w_in = param(rngs, init, (d, f), ("embed", "mlp"), pd)
            self.b_in = param(rngs, zeros, (f,), ("mlp",), pd)
            self.w_out = param(rngs, out_init, (f, d), ("mlp", "embed"), pd)
            self.b_out = param(rngs, zeros, (d,), ("embed",), pd)
        self.fp8_amax_history = fp8_histories(cfg, rngs, 3 if self.gated else 2)

    def __call__(self, x_BxLxD):
        dt, fp8, h = x_BxLxD.dtype, self.fp8, self.fp8_amax_history
        if self.gated:
            gate_BxLxF = einsum("bld,df->blf", x_BxLxD, self.w_gate[...].astype(dt), fp8,
                                fp8_history(h, 0))
            up_BxLxF = einsum("bld,df->blf", x_BxLxD, self.w_up[...].astype(dt), fp8,
                              fp8_history(h, 1))
            h_BxLxF = constrain(swiglu(gate_BxLxF, up_BxLxF), ("batch", "seq", "mlp"))
            return einsum("blf,fd->bld", h_BxLxF, self.w_down[...].astype(dt), fp8,
                          fp8_history(h, 2))
        h_BxLxF = (einsum("bld,df->blf", x_BxLxD, self.w_in[...].astype(dt), fp8,
                          fp8_history(h, 0)) + self.b_in[...].astype(dt))
        h_BxLxF = constrain(gelu_tanh(h_BxLxF), ("batch", "seq", "mlp"))
        return (einsum("blf,fd->bld", h_BxLxF, self.w_out[...].astype(dt), fp8,
                       fp8_history(h, 1)) + self.b_out[...].astype(dt))
