"""All-to-all context parallelism (`mesh.context_parallel=all_to_all`, DeepSpeed-Ulysses) and
hybrid (all-to-all within groups, rings across them): the numbers of one device with
grouped-query attention, packed documents and windows, under data x fsdp x tensor and inside
pipeline stages; lowerings for GPUs and TPUs; and the bytes the compiled step sends
over `sequence` against the formula (four all-to-alls per attention forward, their transposes
backward). `python -m jaxtron.planner.validate` rows (tests/test_planner.py) check the
planner's bytes and memory for both."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxtron.config.platforms import building_for
from jaxtron.errors import ConfigError
from jaxtron.kernels.attention import attention
from jaxtron.planner.layout import layout_of
from jaxtron.planner.traffic import communication
from jaxtron.sharding.collectives import count_collectives
from jaxtron.sharding.context_parallel import ALL_TO_ALL, context_parallel
from jaxtron.sharding.rules import activation_rules, activation_sharding
from jaxtron.training.trainer import Trainer

from attention_oracle import reference_attention
from conftest import make_config
from test_ring import assert_same_loss_and_grads, packed_segment_ids, qkv, sequence_mesh

MODEL = {"num_layers": 2, "d_model": 64, "num_heads": 8, "num_kv_heads": 2, "mlp_dim": 128,
         "max_seq_len": 64}


def attend_by_all_to_all(mesh, q, k, v, *, causal=True, segment_ids=None, window=None,
                         impl="auto"):
    """The attention entry point traced as a train step traces it on `mesh`."""
    config = make_config({"mesh.data": mesh.shape["data"],
                          "mesh.sequence": mesh.shape["sequence"]})
    sharding = NamedSharding(mesh, PartitionSpec("data", "sequence"))
    args = [jax.device_put(x, sharding) for x in (q, k, v)]
    ids = None if segment_ids is None else jax.device_put(segment_ids, sharding)
    weights = jax.random.normal(jax.random.key(1), q.shape)  # a cotangent that is not 2 * out

    def loss(q, k, v):
        out = attention(q, k, v, causal=causal, segment_ids=ids, window=window, impl=impl)
        return jnp.sum(out * weights), out

    with (activation_sharding(mesh, activation_rules(config)), building_for("cpu"),
          context_parallel(ALL_TO_ALL)):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(*args)

    def reference(q, k, v):
        out = reference_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                                  window=window)
        return jnp.sum(out * weights), out

    (_, want_out), want_grads = jax.value_and_grad(reference, (0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    for name, g, w in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8], ids=lambda g: f"kv{g}")
def test_kv_heads_repeated_or_split_equal_the_reference(kv_heads):
    """sequence=4 with 8 query heads: 1 and 2 kv heads are repeated up to 4 before the
    exchange, 4 and 8 are split; causal, values and gradients of plain attention."""
    attend_by_all_to_all(sequence_mesh((2, 4)), *qkv(heads=8, kv_heads=kv_heads, length=32))


@pytest.mark.parametrize("impl", ["auto", "pallas"], ids=["xla", "pallas"])
def test_packed_documents_and_a_window_equal_the_reference(impl):
    """Segment ids all-gathered, the window on the whole sequence, with the blockwise XLA
    kernel and the Pallas flash kernel (interpreted) running on each device's heads."""
    q, k, v = qkv(heads=4, kv_heads=2, length=64)
    attend_by_all_to_all(sequence_mesh((2, 2)), q, k, v, segment_ids=packed_segment_ids(64),
                         window=10, impl=impl)


def test_without_causal_mask():
    attend_by_all_to_all(sequence_mesh((1, 4)), *qkv(heads=4, kv_heads=4, length=32),
                         causal=False)


def model_configs(mesh: dict, model=None, **sections):
    model = {**MODEL, **(model or {})}
    sections = {"data": {"seq_len": 64, **sections.pop("data", {})},
                "train": {"batch_size": 4}, **sections}
    single = {k: v for k, v in sections.items() if k != "pipeline"}
    return (make_config({"mesh.context_parallel": "all_to_all", **mesh}, model=model,
                        **sections),
            make_config({"mesh.data": 1}, model=model, **single))


LAYOUTS = {
    "data2_sequence4": ({"mesh.data": 2, "mesh.sequence": 4}, {}, {}),
    "fsdp2_tensor2_sequence2": ({"mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 2,
                                 "mesh.sequence": 2}, {}, {}),
    # one kv head: replicated over tensor, each rank's query heads read it; repeated for the a2a
    "tensor2_sequence2_one_kv_head": ({"mesh.data": 2, "mesh.tensor": 2, "mesh.sequence": 2},
                                      {"num_kv_heads": 1}, {}),
    "packed_window_sequence4": ({"mesh.data": 2, "mesh.sequence": 4}, {"sliding_window": 12},
                                {"data": {"packing": "documents"}}),
    "stage2_sequence2_data2": ({"mesh.stage": 2, "mesh.data": 2, "mesh.sequence": 2}, {},
                               {"pipeline": {"microbatches": 2, "schedule": "zb-h1"}}),
    # hybrid: all-to-all within groups of 2 or 4, rings of 2 across them
    "hybrid_fsdp2_sequence4_group2": (
        {"mesh.data": 1, "mesh.fsdp": 2, "mesh.sequence": 4, "mesh.context_parallel": "hybrid",
         "mesh.all_to_all_group": 2}, {}, {}),
    "hybrid_packed_window_sequence8_group4": (
        {"mesh.data": 1, "mesh.sequence": 8, "mesh.context_parallel": "hybrid",
         "mesh.all_to_all_group": 4}, {"sliding_window": 12},
        {"data": {"packing": "documents"}}),
    # inside pipeline stages the rings' hops become one all-gather across the groups
    "hybrid_stage2_sequence4_group2_packed": (
        {"mesh.stage": 2, "mesh.data": 1, "mesh.sequence": 4, "mesh.context_parallel": "hybrid",
         "mesh.all_to_all_group": 2}, {"sliding_window": 12},
        {"data": {"packing": "documents"}, "pipeline": {"microbatches": 2}}),
    "hybrid_tensor2_sequence4_group2_one_kv_head": (
        {"mesh.data": 1, "mesh.tensor": 2, "mesh.sequence": 4, "mesh.context_parallel": "hybrid",
         "mesh.all_to_all_group": 2}, {"num_kv_heads": 1}, {}),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_model_equals_one_device(name):
    mesh, model, sections = LAYOUTS[name]
    assert_same_loss_and_grads(*model_configs(mesh, model, **sections))


def compiled_traffic(config):
    trainer = Trainer(config)
    step = trainer.compile_step(trainer.abstract_state(), trainer.abstract_batch())
    return count_collectives(step.as_text(), trainer.mesh), trainer


@pytest.mark.parametrize("remat", ["none", "full"])
def test_compiled_bytes_are_four_exchanges_forward_and_four_backward(remat):
    """Per layer, q, k, v and the output each cross the axis once forward and once backward
    ((n-1)/n of this device's share), the forward again under remat; 2 kv heads go as 4, the
    degree. Nothing travels the ring (no collective-permute beyond the token shift)."""
    config, _ = model_configs({"mesh.data": 2, "mesh.sequence": 4},
                              {"max_seq_len": 1024, "remat": remat}, data={"seq_len": 1024},
                              train={"batch_size": 2})
    traffic, trainer = compiled_traffic(config)
    n, m, e = 4, config.model, 4
    tokens = 1 * 1024 // n  # one sequence per device, a quarter of it
    q = tokens * m.num_heads * m.resolved_head_dim * e
    kv = tokens * n * m.resolved_head_dim * e  # 2 kv heads repeated to 4
    passes = 2 if remat == "none" else 3
    want = m.num_layers * passes * (n - 1) / n * (2 * q + 2 * kv)
    assert traffic.sent("all-to-all", ("sequence",)) == pytest.approx(want, rel=1e-6)
    assert traffic.sent("collective-permute", ("sequence",)) < 1e-3 * want
    predicted = communication(config, layout_of(config, dict(trainer.mesh.shape)), "cpu")
    gradients = traffic.sent("all-reduce", ("sequence",))
    assert predicted["sequence"] == pytest.approx(want + gradients, rel=0.01)


@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
def test_lowers_for_gpus_and_tpus_with_their_kernels(platform):
    """The platform's kernel (Triton on GPUs, splash on TPUs) runs between the exchanges;
    hybrid's rings hop between groups (collective permutes)."""
    config, _ = model_configs({"mesh.data": 2, "mesh.sequence": 4},
                              {"max_seq_len": 256, "dtype": "bfloat16"}, data={"seq_len": 256})
    text = Trainer(config, platform=platform).lower_step().as_text()
    assert "all_to_all" in text
    kernel = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
    assert kernel in text
    hybrid, _ = model_configs({"mesh.data": 2, "mesh.sequence": 4,
                               "mesh.context_parallel": "hybrid", "mesh.all_to_all_group": 2},
                              {"max_seq_len": 256, "dtype": "bfloat16"}, data={"seq_len": 256})
    text = Trainer(hybrid, platform=platform).lower_step().as_text()
    assert "all_to_all" in text and "collective_permute" in text


@pytest.mark.parametrize("overrides, message", [
    ({"mesh.sequence": 4, "model.num_heads": 6, "model.num_kv_heads": 6, "model.d_model": 48},
     "model.num_heads / mesh.tensor = 6 does not split 4 ways"),
    ({"mesh.sequence": 4, "model.num_heads": 12, "model.num_kv_heads": 6, "model.d_model": 48},
     "the 6 kv head(s) of a tensor rank"),
    ({"mesh.sequence": 8, "data.seq_len": 36}, "data.seq_len=36 must be a multiple of "
                                               "mesh.sequence=8"),
    ({"mesh.sequence": 4, "mesh.context_parallel": "hybrid", "mesh.all_to_all_group": 3},
     "mesh.all_to_all_group=3 above 1, below mesh.sequence=4 and dividing it"),
    ({"mesh.sequence": 4, "mesh.context_parallel": "ring", "mesh.all_to_all_group": 2},
     "mesh.all_to_all_group=2 is only read with mesh.context_parallel=hybrid"),
    ({"mesh.sequence": 2, "mesh.stage": 2, "mesh.context_parallel": "hybrid",
      "mesh.all_to_all_group": 2, "pipeline.microbatches": 2}, "above 1, below"),
])
def test_layouts_it_cannot_split_are_refused_at_load_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config({"mesh.data": -1, "mesh.context_parallel": "all_to_all", **overrides})


def test_the_long_context_table_names_the_fastest_layout_of_each_form():
    """`scripts/long_context_table.py` (docs/long-context.md) on a cheap cell: one row with the
    best layout without context parallelism and of each form (hybrid needs the sequence axis
    to leave the 8-device node: 16 devices)."""
    result = subprocess.run([sys.executable, "scripts/long_context_table.py", "--lengths",
                             "65536", "--devices", "16", "--config", "configs/tiny.yaml"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    row = result.stdout.strip().splitlines()[-1]
    assert row.startswith("| 64K | 16 |"), row
    cells = row.strip("|").split("|")[2:]
    assert len(cells) == 4 and "sequence" not in cells[0], cells
    assert "a2a" not in cells[1] and " a2a " in cells[2] and "hybrid a2a=" in cells[3], cells
