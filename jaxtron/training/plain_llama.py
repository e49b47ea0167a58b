"""The same Llama training step written as plainly as JAX allows: the overhead baseline.

Dictionaries of arrays, `lax.scan` over stacked layers, einsum attention, optax AdamW with
clipping, one `jax.jit` with the state donated; no NNX, no sharding, no metrics beyond the loss.
`python -m jaxtron.bench` runs it beside the jaxtron step on one device, so the ratio of the two
is what the framework costs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtron.config.schema import Config
from jaxtron.runtime.cpu_matmuls import keep_until_exit


def init_params(config: Config, seed: int = 0) -> dict:
    m = config.model
    d, h, g, k, f, v, n = (m.d_model, m.num_heads, m.kv_heads, m.resolved_head_dim, m.mlp_dim,
                           m.vocab_size, m.num_layers)
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.normal(0.0, m.init_std, shape), m.param_dtype)

    return {"embed": normal(v, d), "final_norm": jnp.ones((d,), m.param_dtype),
            "head": normal(d, v),
            "layers": {"attn_norm": jnp.ones((n, d), m.param_dtype),
                       "wq": normal(n, d, h * k), "wk": normal(n, d, g * k),
                       "wv": normal(n, d, g * k), "wo": normal(n, h * k, d),
                       "mlp_norm": jnp.ones((n, d), m.param_dtype),
                       "gate": normal(n, d, f), "up": normal(n, d, f), "down": normal(n, f, d)}}


def _rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale).astype(x.dtype)


def _rope(x, theta):
    length, half = x.shape[1], x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(length, dtype=jnp.float32)[:, None] * freqs  # [L, K/2]
    shape = (1, length) + (1,) * (x.ndim - 3) + (half,)  # x is [B, L, heads..., K]
    sin, cos = jnp.sin(angles).reshape(shape), jnp.cos(angles).reshape(shape)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def loss_fn(params, tokens, config: Config):
    m = config.model
    dtype, h, g, k = jnp.dtype(m.compute_dtype), m.num_heads, m.kv_heads, m.resolved_head_dim
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, length = inputs.shape
    x = params["embed"].astype(dtype)[inputs]
    causal = jnp.tril(jnp.ones((length, length), bool))

    def block(x, p):
        p = jax.tree.map(lambda w: w.astype(dtype), p)
        y = _rms_norm(x, p["attn_norm"], m.norm_eps)
        q = _rope((y @ p["wq"]).reshape(b, length, g, h // g, k), m.rope_theta)
        key = _rope((y @ p["wk"]).reshape(b, length, g, k), m.rope_theta)
        value = (y @ p["wv"]).reshape(b, length, g, k)
        logits = jnp.einsum("blgrk,bmgk->bgrlm", q, key) / np.sqrt(k)
        logits = jnp.where(causal, logits.astype(jnp.float32), -1e30)
        attn = jnp.einsum("bgrlm,bmgk->blgrk", jax.nn.softmax(logits).astype(dtype), value)
        x = x + attn.reshape(b, length, h * k) @ p["wo"]
        y = _rms_norm(x, p["mlp_norm"], m.norm_eps)
        return x + (jax.nn.silu(y @ p["gate"]) * (y @ p["up"])) @ p["down"], None

    x, _ = jax.lax.scan(block, x, params["layers"])
    x = _rms_norm(x, params["final_norm"].astype(dtype), m.norm_eps)
    logits = (x @ params["head"].astype(dtype)).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], -1))


def make_step(config: Config, compiler_options: dict | None = None):
    """-> (init_state(), jitted step(state, tokens) -> (state, loss)).

    `compiler_options` are XLA's, as `jax.jit` takes them: the benchmark passes the ones the
    jaxtron step compiles with, so the two steps differ only in how they are written.
    """
    o = config.optim
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip),
                     optax.adamw(o.lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay))

    def init_state():
        params = init_params(config, config.train.seed)
        return params, tx.init(params)

    def step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, config)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    jitted = jax.jit(step, donate_argnums=0, compiler_options=compiler_options)
    if compiler_options:
        keep_until_exit(jitted)
    return init_state, jitted
