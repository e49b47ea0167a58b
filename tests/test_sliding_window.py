"""Sliding-window attention (`model.sliding_window`): query i sees keys i - w < j <= i.

The reference is checked against a numpy loop written from that definition alone; every kernel
(blockwise XLA, Pallas flash in interpret mode, splash in the TPU interpreter, cuDNN's
`local_window_size` convention through JAX's XLA twin, ring and all-gather context parallelism,
the KV-cache decoder) against the reference in value and gradient, with and without packed
documents; then a model on a data x sequence mesh against one device, the CUDA and TPU
lowerings, Hugging Face's window fields and the config errors.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from test_flash import inputs, output_and_grads, packed
from test_lowering import (
    FLASH_KERNELS,
    TPU_KERNEL,
    TRITON,
    forward_and_backward,
    lowered_text,
    shapes,
)
from test_mla import MLA

from jaxtron.errors import ConfigError
from jaxtron.kernels.attention import Kernel, _run, attention
from jaxtron.kernels.blockwise import blockwise_causal_attention, chunk_count
from jaxtron.kernels.context_gather import gathered_context_attention
from jaxtron.kernels.flash import flash_attention
from jaxtron.kernels.ring import ring_attention, to_zigzag
from jaxtron.kernels.splash import splash_attention
from jaxtron.models.generation import decode_step, prefill
from jaxtron.models.transformer import Transformer
from jaxtron.training.flops import attended_keys, training_flops_per_token

from attention_oracle import assert_matches, attention_and_grads, reference_attention
from conftest import make_config
from test_ring import assert_same_loss_and_grads, packed_segment_ids, sequence_mesh


def numpy_attention(q, k, v, window, segment_ids=None):
    """softmax over the keys i - window < j <= i (of the query's document), one query at a
    time, k/v heads repeated: written from the definition, nothing shared with the kernels."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, length, heads, dim = q.shape
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // k.shape[2])
            for i in range(length):
                keys = [j for j in range(max(0, i - window + 1), i + 1)
                        if segment_ids is None or segment_ids[b, j] == segment_ids[b, i]]
                scores = np.array([q[b, i, h] @ k[b, j, g] for j in keys]) / np.sqrt(dim)
                weights = np.exp(scores - scores.max())
                out[b, i, h] = (weights / weights.sum()) @ v[b, keys, g]
    return out


def assert_same(got, want, tol=1e-5):
    for name, g, w in zip(("out", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=tol,
                                   atol=tol * float(jnp.abs(w).max()), err_msg=name)


def reference(window, segment_ids=None):
    return functools.partial(reference_attention, causal=True, window=window,
                             segment_ids=segment_ids)


@pytest.mark.parametrize("window", [1, 5])
@pytest.mark.parametrize("segments", [False, True])
def test_reference_equals_a_numpy_loop(window, segments):
    q, k, v, _ = inputs(length=24)
    ids = packed(2, 24) if segments else None
    np.testing.assert_allclose(reference(window, ids)(q, k, v),
                               numpy_attention(q, k, v, window, ids), rtol=1e-5, atol=1e-5)


# Blockwise with 4 chunks of 10 (window 7 starts inside the previous chunk); flash with 16-wide
# tiles over 40 padded to 48, and with unequal tiles, so the loops start inside the band.
KERNELS = {
    "blockwise": lambda w, ids: functools.partial(blockwise_causal_attention, chunks=4,
                                                  window=w, segment_ids=ids),
    "flash": lambda w, ids: functools.partial(flash_attention, causal=True, interpret=True,
                                              window=w, segment_ids=ids),
    "flash_8x16": lambda w, ids: functools.partial(flash_attention, causal=True, interpret=True,
                                                   window=w, segment_ids=ids, block_q=8,
                                                   block_k=16),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("segments", [False, True])
def test_kernels_equal_the_reference_in_value_and_gradient(kernel, segments):
    q, k, v, cotangent = inputs(length=40)
    ids = packed(2, 40) if segments else None
    got = output_and_grads(KERNELS[kernel](7, ids), q, k, v, cotangent)
    assert_same(got, output_and_grads(reference(7, ids), q, k, v, cotangent))


@pytest.mark.parametrize("block_q", [16, 4])  # one query block, and several offset ones
def test_flash_with_fewer_queries_than_keys_is_bottom_right_windowed(block_q):
    q, k, v, cotangent = inputs(length=16, kv_length=40)
    got = output_and_grads(functools.partial(flash_attention, causal=True, interpret=True,
                                             window=9, block_q=block_q, block_k=8),
                           q, k, v, cotangent)
    assert_same(got, output_and_grads(reference(9), q, k, v, cotangent))
    # and against numpy with the mask built explicitly: query i stands at key i + 24 and sees
    # the 9 keys up to it
    shift, window = 40 - 16, 9
    mask = (np.tril(np.ones((16, 40), bool), k=shift)
            & ~np.tril(np.ones((16, 40), bool), k=shift - window))
    assert mask.sum(axis=1).tolist() == [window] * 16
    assert_matches(got, attention_and_grads(q, k, v, cotangent, mask))


def test_splash_takes_the_window_as_a_local_mask():
    """300 tokens in 128-wide blocks, window 150: splash skips the blocks below the band."""
    q, k, v, cotangent = inputs(length=300, dim=32)
    ids = packed(2, 300)
    got = output_and_grads(functools.partial(splash_attention, causal=True, interpret=True,
                                             max_block=128, window=150, segment_ids=ids),
                           q, k, v, cotangent)
    assert_same(got, output_and_grads(reference(150, ids), q, k, v, cotangent))


def test_cudnn_window_convention_is_the_reference_one(monkeypatch):
    """cuDNN cannot run here; JAX's XLA implementation of `dot_product_attention` takes the same
    `local_window_size`, so the arguments `attention` passes cuDNN are checked through it."""
    exact = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, implementation, **kw: exact(*a, **kw))
    q, k, v, _ = inputs(length=24, kv_heads=4)
    got = _run(Kernel.CUDNN, q, k, v, None, causal=True, mesh=None, window=5)
    np.testing.assert_allclose(got, reference(5)(q, k, v), rtol=1e-5, atol=1e-5)


def test_entry_point_dispatch_and_windows_that_change_nothing():
    q, k, v, _ = inputs(length=40)
    np.testing.assert_allclose(attention(q, k, v, impl="xla", window=7), reference(7)(q, k, v),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(attention(q, k, v, impl="pallas", window=7),
                               reference(7)(q, k, v), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(attention(q, k, v, impl="pallas", window=40),
                               reference_attention(q, k, v, causal=True), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs causal attention"):
        attention(q, k, v, causal=False, window=7)
    for kernel in (reference(0), functools.partial(blockwise_causal_attention, window=0)):
        with pytest.raises(ValueError, match="at least one key"):
            kernel(q, k, v)
    # Chunks about a window long (at least 32 tokens, at most 16 of them).
    assert chunk_count(4096, 512) == 8 and chunk_count(4096, 64) == 16
    assert chunk_count(256, 4096) == chunk_count(256) == 4 and chunk_count(40, 7) == 1


@pytest.mark.parametrize("gather", [False, True], ids=["ring", "all_gather"])
@pytest.mark.parametrize("segments", [False, True])
def test_context_parallelism_equals_the_reference(gather, segments):
    """sequence=4 (8-token zig-zag chunks), window 10: the band crosses chunk and device
    boundaries, and the ring skips the chunk pairs wholly outside it (42% of the causal
    schedule's pairs); inputs in zig-zag order, as a train step hands them over."""
    mesh, n = sequence_mesh((2, 4)), 4
    q, k, v, cotangent = inputs(length=64)
    ids = packed_segment_ids(64) if segments else None
    sharding = NamedSharding(mesh, PartitionSpec("data", "sequence"))
    args = [jax.device_put(to_zigzag(x, n), sharding) for x in (q, k, v)]
    zig_ids = None if ids is None else jax.device_put(to_zigzag(ids, n), sharding)
    kernel = gathered_context_attention if gather else ring_attention
    got = output_and_grads(functools.partial(kernel, mesh=mesh, zigzag=True, window=10,
                                             segment_ids=zig_ids), *args, to_zigzag(cotangent, n))
    want = output_and_grads(reference(10, ids), q, k, v, cotangent)
    assert_same(got, [to_zigzag(x, n) for x in jax.tree.leaves(want)], tol=1e-4)


@pytest.mark.parametrize("model", [{"num_heads": 4, "num_kv_heads": 2}, MLA], ids=["gqa", "mla"])
def test_cached_decoding_equals_the_windowed_forward(model):
    model_settings = model
    config = make_config(model={"d_model": 64, "init_std": 0.1, **model, "sliding_window": 4})
    model = Transformer(config.model, rngs=nnx.Rngs(0))
    tokens_BxT = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
    full_BxTxV = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens_BxT))
    logits_BxLxV, cache = prefill(model, tokens_BxT[:, :5], max_len=12)
    np.testing.assert_allclose(logits_BxLxV, full_BxTxV[:, :5], rtol=1e-5, atol=1e-5)
    for t in range(5, 12):
        logits_BxV, cache = decode_step(model, cache, tokens_BxT[:, t:t + 1], t)
        np.testing.assert_allclose(logits_BxV, full_BxTxV[:, t], rtol=1e-5, atol=1e-5,
                                   err_msg=f"position {t}")
    # And the window is applied at all: the same weights without it agree only on the first
    # four positions, which see no more than four keys either way.
    config = make_config(model={"d_model": 64, "init_std": 0.1, **model_settings})
    unwindowed = np.asarray(jax.jit(lambda m, t: m(t))(
        Transformer(config.model, rngs=nnx.Rngs(0)), tokens_BxT))
    np.testing.assert_allclose(unwindowed[:, :4], full_BxTxV[:, :4], rtol=1e-5, atol=1e-5)
    assert np.abs(unwindowed[:, 4:] - full_BxTxV[:, 4:]).max() > 1e-3


def test_data_by_sequence_mesh_equals_one_device():
    """data=2 x sequence=2 (ring attention), window 12 of 64 tokens: the loss and gradients
    of one device."""
    sections = dict(model={"num_layers": 1, "max_seq_len": 64, "sliding_window": 12},
                    data={"seq_len": 64}, train={"batch_size": 2})
    assert_same_loss_and_grads(make_config({"mesh.data": 2, "mesh.sequence": 2}, **sections),
                               make_config({"mesh.data": 1}, **sections), jax.devices()[:4])


def test_windowed_kernels_lower_for_gpus_and_tpus():
    def windowed(kernel):
        return lambda q, k, v, **kw: kernel(q, k, v, window=100, **kw)

    grads = forward_and_backward(windowed(flash_attention), True, True)
    text = lowered_text(grads, *shapes(64, jnp.bfloat16), platform="cuda")
    assert text.count(TRITON) == 3 and all(f'name = "{n}"' in text for n in FLASH_KERNELS)
    grads = forward_and_backward(windowed(functools.partial(attention, impl="pallas")), True,
                                 False)
    assert lowered_text(grads, *shapes(64, jnp.bfloat16), platform="tpu").count(TPU_KERNEL) == 3


def test_attention_flops_count_the_window():
    # L = 32, w = 8: positions 0..7 see 1..8 keys (36), the other 24 see 8 (192): 228 / 32.
    assert attended_keys(32, 8) == 228 / 32 and attended_keys(32, None) == attended_keys(32, 32)
    # test_flops' hand count (90112 matmul weights, 256 attention FLOPs per key and layer).
    model = make_config({"model.sliding_window": 8}).model
    assert training_flops_per_token(model, 32) == 6 * 90112 + 2 * 3 * 256 * 228 / 32


def test_config_errors_and_warnings_name_the_field():
    from jaxtron.config.checks import config_warnings

    with pytest.raises(ConfigError, match="model.sliding_window=0 must be a positive"):
        make_config({"model.sliding_window": 0})
    # longer than data.seq_len:
    assert not config_warnings(make_config({"model.sliding_window": 64}))
    # training sees no window, generation up to model.max_seq_len does
    (note,) = config_warnings(make_config({"model.sliding_window": 256}))
    assert note.startswith("model.sliding_window=256 is at least model.max_seq_len=256")


def test_hugging_face_window_fields_both_ways():
    """Mistral and windowed Qwen2 import with their window, and export back with it; a Qwen2
    that windows only some layers, and an MLA model with a window, are refused in one line."""
    from jaxtron.hf.translate import _sliding_window, from_hf, to_hf

    qwen2 = {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 16}
    assert _sliding_window("Qwen2ForCausalLM", {**qwen2, "max_window_layers": 0}) == 16
    assert _sliding_window("Qwen2ForCausalLM", {**qwen2, "max_window_layers": 4}) is None
    assert _sliding_window("Qwen2ForCausalLM", {**qwen2, "use_sliding_window": False}) is None
    assert _sliding_window("MistralForCausalLM", {}) == 4096  # transformers' default
    assert _sliding_window("LlamaForCausalLM", {"sliding_window": 16}) is None  # ignored
    with pytest.raises(ConfigError, match="windows 2 of 4 layers .*max_window_layers=2"):
        _sliding_window("Qwen2ForCausalLM", {**qwen2, "max_window_layers": 2})
    for model, arch in (({"qkv_bias": True}, "Qwen2ForCausalLM"), ({}, "MistralForCausalLM")):
        config = make_config(model={**model, "sliding_window": 16})
        hf_config, tensors = to_hf(config, zero_params(config))
        assert hf_config["architectures"] == [arch]
        model, _, _ = from_hf(hf_config, tensors)
        assert model["sliding_window"] == 16 and model["max_seq_len"] == 256
    with pytest.raises(ConfigError, match="model.sliding_window=16 cannot be exported as "
                                          "DeepseekV3ForCausalLM"):
        to_hf(make_config(model={**MLA, "sliding_window": 16}), {})


def zero_params(config) -> dict:
    """Zero parameters in the model layout, shaped from the export table (no model built)."""
    from jaxtron.hf.tensors import tensor_table
    from jaxtron.hf.translate import _dims, _export_arch

    params = {}
    for _, path, _, shape, _ in tensor_table(_dims(config, _export_arch(config))):
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.zeros(shape, np.float32)
    return params
