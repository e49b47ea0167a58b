"""Chunked cross-entropy against the unfused loss: value, gradients, sharding and memory."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxtron.kernels.cross_entropy import chunked_cross_entropy
from jaxtron.models.transformer import cross_entropy_loss
from jaxtron.sharding.mesh import build_mesh
from jaxtron.sharding.rules import activation_rules, activation_sharding

from conftest import USERS_CODEGEN, make_config


def problem(batch, length, dim=16, vocab=96, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (batch, length, dim)).astype(dtype)
    head = jax.random.normal(ks[1], (dim, vocab)) * dim ** -0.5
    targets = jax.random.randint(ks[2], (batch, length), 0, vocab)
    weights = (jax.random.uniform(ks[3], (batch, length)) > 0.3).astype(jnp.float32)
    return x, head, targets, weights


def plain(x, head, targets, weights=None):
    return cross_entropy_loss(x @ head.astype(x.dtype), targets, weights)


def value_and_grads(loss, x, head, jit):
    fn = jax.value_and_grad(loss, argnums=(0, 1))
    return (jax.jit(fn) if jit else fn)(x, head)


def assert_close(got, want, rtol=1e-5, atol=1e-6):
    for name, g, w in zip(("loss", "d_x", "d_head"), (got[0], *got[1]), (want[0], *want[1])):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("batch, length, chunk_tokens", [
    (2, 37, 16),   # 74 tokens: 5 chunks of 8 positions per row, the last 3 padding
    (3, 20, 7),    # 9 chunks of 3 positions, 7 of 27 padded
    (2, 24, 12),   # exact: 4 chunks of 6 positions
    (2, 5, 1000),  # one chunk holds everything
    (4, 6, 3),     # fewer tokens per chunk than rows: one position per row per chunk
])
def test_matches_unfused_loss_fp32(batch, length, chunk_tokens, jit):
    x, head, targets, _ = problem(batch, length)
    got = value_and_grads(lambda x, h: chunked_cross_entropy(x, h, targets,
                                                             chunk_tokens=chunk_tokens),
                          x, head, jit)
    assert_close(got, value_and_grads(lambda x, h: plain(x, h, targets), x, head, jit))


def test_weights_match_unfused_loss():
    x, head, targets, weights = problem(2, 37)
    got = value_and_grads(lambda x, h: chunked_cross_entropy(
        x, h, targets, weights_BxL=weights, chunk_tokens=16), x, head, jit=True)
    assert_close(got, value_and_grads(lambda x, h: plain(x, h, targets, weights), x, head,
                                      jit=True))


def test_bf16_activations_keep_dtypes():
    # The unfused loss rounds its logits to bf16 (2^-8 relative) before the fp32 softmax; the
    # chunked one keeps fp32 logits. Gradients come back in each input's own dtype.
    x, head, targets, _ = problem(2, 40, dim=32, vocab=128, dtype=jnp.bfloat16)
    got = value_and_grads(lambda x, h: chunked_cross_entropy(x, h, targets, chunk_tokens=16),
                          x, head, jit=True)
    assert got[1][0].dtype == jnp.bfloat16 and got[1][1].dtype == jnp.float32
    assert_close(got, value_and_grads(lambda x, h: plain(x, h, targets), x, head, jit=True),
                 rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("layout", [
    {"mesh.data": 2, "mesh.tensor": 4},
    {"mesh.data": 1, "mesh.fsdp": 2, "mesh.sequence": 2, "mesh.tensor": 2},
])
def test_sharded_matches_unsharded_and_reduces_d_head_once(layout):
    """A vocab-parallel head and a batch/sequence-split x give the single-device numbers, and
    no loop body all-reduces a d_head-sized [D, V/tensor] array (one reduction per chunk)."""
    batch, length, dim, vocab = 4, 64, 16, 256
    x, head, targets, _ = problem(batch, length, dim, vocab)
    want = value_and_grads(lambda x, h: plain(x, h, targets), x, head, jit=True)
    config = make_config(layout)
    mesh = build_mesh(config.mesh)
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "fsdp"), "sequence")))
    head = jax.device_put(head, NamedSharding(mesh, PartitionSpec("fsdp", "tensor")))
    with activation_sharding(mesh, activation_rules(config)):
        step = jax.jit(jax.value_and_grad(
            lambda x, h: chunked_cross_entropy(x, h, targets, chunk_tokens=32), argnums=(0, 1)))
        compiled = step.lower(x, head).compile()
        got = step(x, head)
    assert_close(got, want)
    in_loops, computation = [], None
    for line in compiled.as_text().splitlines():
        if line and not line.startswith(" "):
            computation = line.split()[0]
        elif computation != "ENTRY" and re.search(r"all-reduce\(|reduce-scatter\(", line):
            in_loops.append(line.strip())
    assert in_loops  # the per-chunk statistics and d_x still reduce over tensor
    d_head_shard = re.compile(rf"f32\[(\d+,)*{dim},{vocab // config.mesh.tensor}\]")
    assert not [line for line in in_loops if d_head_shard.search(line)], in_loops


def test_never_holds_the_full_logits():
    # 2048 tokens x 8192 vocabulary: fp32 logits alone are 64 MiB, their gradient as much again.
    batch, length, dim, vocab = 2, 1024, 64, 8192
    x, head, targets, _ = problem(batch, length, dim, vocab)

    def temp_bytes(loss):
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return fn.lower(x, head).compile(USERS_CODEGEN).memory_analysis().temp_size_in_bytes

    unfused = temp_bytes(lambda x, h: plain(x, h, targets))
    chunked = temp_bytes(lambda x, h: chunked_cross_entropy(x, h, targets, chunk_tokens=256))
    print(f"temp bytes: unfused {unfused / 2**20:.1f} MiB, chunked (256-token chunks) "
          f"{chunked / 2**20:.1f} MiB")
    logits_bytes = batch * length * vocab * 4
    assert unfused >= logits_bytes
    assert chunked < logits_bytes / 2 and chunked < unfused / 8, (chunked, unfused)


def test_bad_shapes_are_refused():
    x, head, targets, _ = problem(2, 8)
    with pytest.raises(ValueError, match="x_BxLxD, head_DxV and targets_BxL"):
        chunked_cross_entropy(x, head.T, targets)
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        chunked_cross_entropy(x, head, targets, chunk_tokens=0)
