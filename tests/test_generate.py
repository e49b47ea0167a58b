"""KV-cache decoding == the training forward: logits at every position, greedy tokens, sampling."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtron.errors import ConfigError
from jaxtron.models.generation import decode_step, generate, prefill
from jaxtron.models.transformer import Transformer

from conftest import make_config

# A wider init than training's 0.02 spreads the logits, so greedy choices have no near-ties.
VARIANTS = {
    "llama": ({"num_layers": 3, "num_heads": 4, "num_kv_heads": 2}, {}),  # GQA, RoPE
    "gpt2": ({"type": "gpt2", "num_layers": 3, "num_kv_heads": None}, {}),  # biases, tied head
    # A dense first block (its own stack), then interleaved MoE (a dense block, then an MoE
    # block, stacked): the cache rows of both stacks, and BlockGroup units.
    "moe": ({"num_layers": 3}, {"num_experts": 4, "top_k": 2, "every": 2, "mode": "dropless",
                                "first_dense_layers": 1}),
}


def build(name):
    model, moe = VARIANTS[name]
    config = make_config(model={"d_model": 64, "init_std": 0.1, **model}, moe=moe)
    return Transformer(config.model, rngs=nnx.Rngs(0), moe=config.moe)


def prompt(length=6, seed=3):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, length)]


@pytest.mark.parametrize("name", ["llama", "gpt2", "moe"])
def test_cached_logits_equal_full_forward_at_every_position(name):
    model = build(name)
    tokens_BxT = jax.random.randint(jax.random.key(1), (2, 14), 0, 256)
    full_BxTxV = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens_BxT))
    split = 5
    logits_BxLxV, cache = prefill(model, tokens_BxT[:, :split], max_len=tokens_BxT.shape[1])
    np.testing.assert_allclose(np.asarray(logits_BxLxV), full_BxTxV[:, :split],
                               rtol=1e-5, atol=1e-5)
    for t in range(split, tokens_BxT.shape[1]):
        logits_BxV, cache = decode_step(model, cache, tokens_BxT[:, t:t + 1], t)
        np.testing.assert_allclose(np.asarray(logits_BxV), full_BxTxV[:, t],
                                   rtol=1e-5, atol=1e-5, err_msg=f"position {t}")


@pytest.mark.parametrize("name", ["llama", "gpt2"])  # the no-cache path compiles per length
def test_greedy_with_and_without_cache_agree(name):
    model = build(name)
    cached = generate(model, prompt(), max_new_tokens=6)
    uncached = generate(model, prompt(), max_new_tokens=6, use_cache=False)
    assert len(cached) == 6 and all(0 <= t < 256 for t in cached)
    assert cached == uncached


def test_top_k_one_sampling_is_greedy():
    model = build("llama")
    greedy = generate(model, prompt(), max_new_tokens=10)
    assert generate(model, prompt(), max_new_tokens=10, temperature=1.5, top_k=1, seed=7) == greedy


def test_sampling_is_deterministic_given_the_seed():
    model = build("gpt2")
    draw = dict(max_new_tokens=6, temperature=2.0, top_k=50)
    first = generate(model, prompt(), seed=1, **draw)
    assert generate(model, prompt(), seed=1, **draw) == first
    assert generate(model, prompt(), seed=1, use_cache=False, **draw) == first
    assert generate(model, prompt(), seed=2, **draw) != first


def test_generate_names_the_limit_it_exceeds():
    model = build("gpt2")  # max_seq_len 256: learned positions end there
    with pytest.raises(ConfigError, match="max_seq_len=256"):
        generate(model, prompt(200), max_new_tokens=100)
    with pytest.raises(ConfigError, match="top_k=0"):
        generate(model, prompt(), max_new_tokens=1, top_k=0)
