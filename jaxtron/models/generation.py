"""Autoregressive generation: a prefill, then one cached step per new token.

    model = trainer.model(state)
    ids = generate(model, prompt_ids, max_new_tokens=64, temperature=0.8, top_k=40, seed=1)

The cached path (`decode.py`) compiles twice per prompt length and cache size (the prefill and
the one-token step, whose position is a traced scalar) and donates the cache so it is updated
in place. `use_cache=False` recomputes the full training forward on the whole sequence for
every token: slow, but it is the reference the cache is tested against. Both paths draw token
t with the key `fold_in(key(seed), t)`, so they sample alike.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.errors import ConfigError
from jaxtron.models.decode import forward_cached, init_cache


def sample(logits_BxV, key, temperature: float, top_k: int | None):
    """Next tokens_B: argmax for temperature 0, else a draw from softmax(logits / temperature)
    restricted to the `top_k` largest logits (ties with the k-th are kept)."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = logits_BxV / temperature
    if top_k is not None:
        kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


# The graph definition is static (hashable, equal across models of one config), the parameters
# are traced: every model of a config shares one compilation.


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _forward_cached(graphdef, state, cache, tokens_BxL, position):
    return forward_cached(nnx.merge(graphdef, state), cache, tokens_BxL, position)


@functools.partial(jax.jit, static_argnums=(0, 6, 7), donate_argnums=2)
def _cached_token(graphdef, state, cache, tokens_BxL, position, key, temperature, top_k):
    logits_BxLxV, cache = forward_cached(nnx.merge(graphdef, state), cache, tokens_BxL, position)
    return sample(logits_BxLxV[:, -1], key, temperature, top_k), cache


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _full_token(graphdef, state, tokens_BxL, key, temperature, top_k):
    logits_BxLxV = nnx.merge(graphdef, state)(tokens_BxL)
    return sample(logits_BxLxV[:, -1], key, temperature, top_k)


def prefill(model, tokens_BxL, max_len: int):
    """Run the prompt -> (logits_BxLxV, cache) with a cache of `max_len` positions."""
    cache = init_cache(model.cfg, tokens_BxL.shape[0], max_len)
    return _forward_cached(*nnx.split(model), cache, jnp.asarray(tokens_BxL, jnp.int32), 0)


def decode_step(model, cache: dict, tokens_Bx1, position: int):
    """One new token per sequence at `position` -> (logits_BxV, cache). The cache passed in is
    donated (consumed): use the returned one."""
    logits_Bx1xV, cache = _forward_cached(*nnx.split(model), cache,
                                          jnp.asarray(tokens_Bx1, jnp.int32),
                                          jnp.asarray(position, jnp.int32))
    return logits_Bx1xV[:, 0], cache


def _check(model, prompt: list[int], max_new_tokens: int, temperature: float, top_k) -> None:
    cfg = model.cfg
    if not prompt:
        raise ConfigError("the prompt (--prompt or --prompt-ids) is empty; give at least one "
                          "token.")
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens={max_new_tokens} must be >= 0.")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature={temperature} must be a finite number >= 0 (0 = "
                          "greedy).")
    if top_k is not None and not 1 <= top_k <= cfg.vocab_size:
        raise ConfigError(f"top_k={top_k} must lie in 1..model.vocab_size={cfg.vocab_size} "
                          "(or be None for no cut).")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ConfigError(f"--prompt-ids {bad[:5]} lie outside the vocabulary "
                          f"0..{cfg.vocab_size - 1}; use ids below {cfg.vocab_size}, as the model's "
                          "tokenizer produces.")
    fed = len(prompt) + max_new_tokens - 1  # the last token drawn is never fed back
    if fed > cfg.max_seq_len:
        raise ConfigError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) - 1 = "
                          f"{fed} positions exceed model.max_seq_len={cfg.max_seq_len}; "
                          "shorten the prompt or generate fewer tokens.")


def generate(model, prompt_ids, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, use_cache: bool = True) -> list[int]:
    """The `max_new_tokens` token ids that follow `prompt_ids` (the prompt is not repeated)."""
    prompt = [int(t) for t in prompt_ids]
    temperature = float(temperature)
    _check(model, prompt, max_new_tokens, temperature, top_k)
    if max_new_tokens == 0:
        return []
    graphdef, state = nnx.split(model)
    base_key = jax.random.key(seed)
    tokens_1xL = jnp.asarray([prompt], jnp.int32)
    new = []  # device scalars: nothing syncs with the host until the end
    if use_cache:
        cache = init_cache(model.cfg, 1, len(prompt) + max_new_tokens - 1)
        token_1, cache = _cached_token(graphdef, state, cache, tokens_1xL, jnp.int32(0),
                                       jax.random.fold_in(base_key, 0), temperature, top_k)
        new.append(token_1)
        for t in range(1, max_new_tokens):
            position = jnp.int32(len(prompt) + t - 1)
            token_1, cache = _cached_token(graphdef, state, cache, token_1[:, None], position,
                                           jax.random.fold_in(base_key, t), temperature, top_k)
            new.append(token_1)
    else:
        for t in range(max_new_tokens):
            token_1 = _full_token(graphdef, state, tokens_1xL, jax.random.fold_in(base_key, t),
                                  temperature, top_k)
            new.append(token_1)
            tokens_1xL = jnp.concatenate([tokens_1xL, token_1[:, None]], axis=1)
    return [int(t[0]) for t in jax.device_get(new)]
