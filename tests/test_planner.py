"""The layout planner: memory against XLA's compiled analysis, legal and fitting proposals,
closed-form communication and bubble, and `--apply` writing a config the trainer accepts."""


import pytest

from jaxtron.config.loading import load_config
from jaxtron.planner import validate
from jaxtron.planner.cost import SAVE_DOTS_OVERHEAD, bubble_fraction, estimate
from jaxtron.planner.hardware import HARDWARE
from jaxtron.planner.layout import Layout, apply
from jaxtron.planner.memory import memory_budget_bytes, microbatch_tokens, predict, state_bytes
from jaxtron.planner.search import _context_modes, candidates, plan
from jaxtron.planner.traffic import communication
from jaxtron.sharding.report import shard_bytes
from jaxtron.training.trainer import Trainer, check_layout

MiB = 2**20

from conftest import USERS_CODEGEN, run_in_process


def small_config():
    return load_config("configs/tiny.yaml", validate.BASE)


def test_parameter_and_optimizer_bytes_are_exact():
    for layout, moments in ((Layout(fsdp=8), "float32"),
                            (Layout(data=2, tensor=4, zero_stage=1), "float32"),
                            (Layout(data=2, tensor=4, zero_stage=1), "bfloat16")):
        config = load_config("configs/tiny.yaml",
                             validate.BASE + [f"optim.moment_dtype={moments}"])
        planned = apply(config, layout)
        trainer = Trainer(planned)
        state = trainer.abstract_state()
        params, moments, _ = state_bytes(planned, layout)
        assert params == shard_bytes(state.params)
        assert moments == pytest.approx(shard_bytes(state.opt_state), rel=0.01)  # + counters


def test_proposals_fit_pass_the_run_checks_and_compile():
    config = small_config()
    budget = 30 * MiB
    ranked = plan(config, 8, HARDWARE["cpu"], budget, platform="cpu")
    best = ranked.best(config, top=3)
    assert ranked.considered > len(ranked.fitting) > 0 and len(best) == 3
    for candidate in best:
        assert candidate.memory.total <= budget
        planned = apply(config, candidate.layout)  # the config validator accepts it
        check_layout(planned, candidate.layout.degrees())
        measured = validate.compiled_bytes(planned, USERS_CODEGEN)  # and it compiles
        assert measured < 1.25 * budget


def test_communication_and_bubble_follow_the_closed_forms():
    config = small_config()
    assert bubble_fraction(Layout(stage=4, data=2, microbatches=8)) == 3 / 11
    assert bubble_fraction(Layout(stage=4, data=2, microbatches=8, schedule="interleaved",
                                  virtual_stages=2)) == 3 / 19
    # The step uses the idle share with jobs at their lengths (`pipeline/timeline.py`): only
    # ranks that trade wait for each other, so 1F1B and GPipe keep the formula; interleaved,
    # its backwards split into R, B and W of one forward each, idles less than its formula
    # (W and R off the gradients' path).
    one_f_one_b = estimate(config, Layout(stage=4, data=2, microbatches=8), HARDWARE["h100"])
    assert one_f_one_b.bubble == one_f_one_b.idle == pytest.approx(3 / 11)
    interleaved = estimate(config, Layout(stage=4, data=2, microbatches=8,
                                          schedule="interleaved", virtual_stages=2),
                           HARDWARE["h100"])
    assert interleaved.idle < interleaved.bubble == pytest.approx(3 / 19)
    gpipe = estimate(config, Layout(stage=4, data=2, microbatches=8, schedule="gpipe"),
                     HARDWARE["h100"])
    assert gpipe.idle == pytest.approx(3 / 11)
    stored = estimate(config, Layout(stage=4, data=2, microbatches=8, schedule="zb-h1",
                                     recompute=False), HARDWARE["h100"])
    assert stored.idle == pytest.approx(3 / 27)  # the paper's (p-1)/(3m+p-1)
    assert stored.compute_s < one_f_one_b.compute_s  # no forward run again
    layout = Layout(data=4, tensor=2)
    params, _, _ = state_bytes(config, layout)
    comm = communication(config, layout, "gpu")
    assert comm["data"] == 2 * 3 / 4 * params  # ring all-reduce of the gradients
    tokens = config.train.batch_size // 4 * config.data.seq_len  # per data replica
    # Megatron: per block 2 all-reduces forward and 2 backward, plus the vocabulary-parallel
    # embedding and head, of [tokens, D] fp32 over 2 ranks; XLA:CPU sums q, k, v, gate and up
    # input gradients separately: 5 backward
    activation_ring = 2 * (1 / 2) * tokens * 128 * 4
    assert comm["tensor"] == (4 * 4 + 2) * activation_ring
    assert communication(config, layout, "cpu")["tensor"] == (7 * 4 + 2) * activation_ring
    assert comm["fsdp"] == comm["sequence"] == comm["stage"] == 0


# Memory, compiled as users compile (`USERS_CODEGEN`): the layouts of `python -m
# jaxtron.planner.validate` (docs/performance.md): data, fsdp, tensor with and without sequence
# parallelism, ZeRO-1/2, recompute policies, a 1F1B pipeline, accumulation, ring and all-to-all
# attention; expert parallelism, an MoE pipeline (experts split inside its stages) and dropless;
# each forward's residuals in the table's slots (`pipeline.recompute: false`).
MEMORY_CASES = ([(layout, validate.BASE) for layout in validate.MATRIX]
                + [(layout, validate.BASE + validate.MOE + list(extra))
                   for layout, extra in validate.MOE_MATRIX]
                + [(layout, validate.BASE) for layout in (
                    Layout(data=2, stage=4, microbatches=4, recompute=False),
                    Layout(data=4, stage=2, microbatches=4, schedule="zb-h1", recompute=False))])
# Bytes sent per device per step: every kind of layout, every schedule's pipeline (one with
# tensor and sequence parallelism inside its stages), expert parallelism.
TRAFFIC_CASES = ([(layout, validate.BASE) for layout in validate.TRAFFIC_MATRIX]
                 + [(layout, validate.BASE + validate.MOE)
                    for layout in validate.MOE_TRAFFIC_MATRIX]
                 + [(layout, validate.BASE + validate.MOE + validate.DROPLESS_EP)
                    for layout in validate.DROPLESS_EP_TRAFFIC_MATRIX])
# A layout in both lists is compiled once for both checks.
COMPILED_CASES = MEMORY_CASES + [case for case in TRAFFIC_CASES if case not in MEMORY_CASES]


def case_id(layout: Layout, base: list[str]) -> str:
    modes = [o.split("=")[1] for o in base if o.startswith("moe.mode=")]
    return " ".join([layout.describe()] + (["moe"] if base != validate.BASE else []) + modes)


def test_communication_is_checked_on_every_kind_of_layout():
    assert len(TRAFFIC_CASES) >= 34 and len(MEMORY_CASES) >= 20


@pytest.mark.parametrize("layout, base", COMPILED_CASES,
                         ids=[case_id(layout, base) for layout, base in COMPILED_CASES])
def test_predicted_memory_and_communication_match_the_compiled_step(layout, base):
    """Per-device arguments + peak temporaries, and bytes sent per device per step, predicted
    vs XLA's compiled step, within 10% (`python -m jaxtron.planner.validate` prints each
    error). A layout in MEMORY_CASES compiles with XLA:CPU's default emitters, as every run does
    (its collectives are the same either way)."""
    memory, traffic = (layout, base) in MEMORY_CASES, (layout, base) in TRAFFIC_CASES
    [row] = validate.run((layout,), base, USERS_CODEGEN if memory else None)
    if memory:
        error = abs(row.predicted_bytes - row.compiled_bytes) / row.compiled_bytes
        print(f"{case_id(layout, base)}: predicted {row.predicted_bytes / MiB:.2f} MiB, "
              f"XLA {row.compiled_bytes / MiB:.2f} MiB, {error:.1%}")
        assert error <= 0.10, (layout, error)
    if traffic:
        errors = row.traffic_errors()
        print(case_id(layout, base), {b: f"{e:+.1%}" for b, e in errors.items()})
        assert errors and all(abs(e) <= 0.10 for e in errors.values()), (row.layout, errors)
    if traffic and layout.stage > 1:  # each of the table's sends one buffer, nothing besides
        config = apply(load_config("configs/tiny.yaml", base), layout)
        buffer = 4 * microbatch_tokens(config, layout) * config.model.d_model
        assert abs(row.predicted_sent["stage"] - row.measured_sent["stage"]) <= buffer


def test_activation_memory_shrinks_as_the_recompute_policy_promises():
    config = small_config()
    none, dots, full = (predict(config, Layout(data=8, remat=r)).activations
                        for r in ("none", "save_dots", "full"))
    assert full < dots < none


def test_the_search_predicts_each_layout_as_predict_does_and_skips_only_what_cannot_fit():
    """The search shares a variant's activations between its ZeRO stages and predicts none
    where the state alone is over the budget: each layout's memory is still `predict`'s, and
    a layout left unpredicted is one whose state exceeds the budget."""
    config = load_config("configs/moe-tiny.yaml", validate.BASE)
    budget = 30 * 2**20
    found = list(candidates(config, 8, HARDWARE["h100"], "gpu", budget))
    skipped = [c for c in found if c.memory is None]
    assert skipped and len(skipped) < len(found)
    assert all(sum(state_bytes(config, c.layout)) > budget for c in skipped)
    assert {c.layout.zero_stage for c in found if c.memory} == {0, 1, 2}
    assert any(c.cost for c in found) and any(c.memory and not c.cost for c in found)
    for c in found:
        if c.memory is not None:
            assert c.memory == predict(config, c.layout), c.layout
            assert (c.cost is not None) == (c.memory.total <= budget)


def test_plan_cli_ranks_and_applies_the_best_layout(tmp_path):
    out = tmp_path / "planned.yaml"
    result = run_in_process(
        "jaxtron.plan", "--config", "configs/tiny.yaml", *validate.BASE, "--devices", "8",
        "--device-memory", "30MiB", "--hardware", "cpu", "--top", "3", "--apply", str(out),
        "--compare", "mesh.tensor=2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "layouts of 8 x cpu considered" in result.stdout
    assert "given layout (mesh.tensor=2), best variant ranks" in result.stdout
    planned = load_config(out)
    assert planned.model.d_model == 128 and planned.train.batch_size == 16
    # its own run folder, never the run it was planned from (which it would only resume)
    assert planned.train.run_dir == str(tmp_path / "planned")
    (tmp_path / "planned" / "checkpoints").mkdir(parents=True)
    again = run_in_process(
        "jaxtron.plan", "--config", "configs/tiny.yaml", *validate.BASE, "--devices", "8",
        "--device-memory", "30MiB", "--hardware", "cpu", "--top", "1", "--apply", str(out))
    assert again.returncode == 2 and "holds a run; give --apply another file name" in again.stderr
    assert memory_budget_bytes("80GiB") == 80 * 2**30 and memory_budget_bytes("141GB") == 141e9


def test_the_search_tries_each_context_parallel_form_where_it_can_run():
    """Llama 3 8B at 128K (32 heads, 8 kv heads) on 8-device nodes: ring and all-to-all where
    the heads split; hybrid only where the sequence axis leaves the node and a group with its
    tensor ranks stays inside; only all-to-all inside pipeline stages; none below 4K tokens;
    host offload searched for GPUs, never for CPUs."""
    config = load_config("configs/llama3-8b.yaml", ["data.seq_len=131072",
                                                     "model.max_seq_len=131072"])
    assert _context_modes(config, 4, 1, 1, 8) == ("ring", "all_to_all")
    assert _context_modes(config, 16, 1, 2, 8) == ("ring", "all_to_all", ("hybrid", 2),
                                                   ("hybrid", 4))
    assert _context_modes(config, 64, 1, 1, 8) == ("ring", ("hybrid", 2), ("hybrid", 4),
                                                   ("hybrid", 8))  # 32 heads: no a2a of 64
    assert _context_modes(config, 4, 2, 1, 8) == ("all_to_all",)
    short = load_config("configs/llama3-8b.yaml", ["data.seq_len=2048"])
    assert _context_modes(short, 4, 1, 1, 8) == ()
    tiny = small_config()
    remats = {platform: {c.layout.remat for c in candidates(tiny, 8, HARDWARE["h100"], platform)}
              for platform in ("gpu", "cpu")}
    assert remats == {"gpu": {"none", "save_dots", "full", "offload"},
                      "cpu": {"none", "save_dots", "full"}}


def test_the_search_chooses_every_field_of_a_layout():
    """`_variants` builds each Layout from the mesh's fields and its own choices, filling the
    instance at once (`Layout.of_fields`): a field in neither would be missing. A layout so
    built equals, hashes and prints as the constructor's."""
    import dataclasses

    from jaxtron.planner.search import MESH_FIELDS, VARIANT_FIELDS

    assert sorted(f.name for f in dataclasses.fields(Layout)) == sorted(MESH_FIELDS
                                                                         + VARIANT_FIELDS)
    built = Layout(data=2, tensor=4, stage=2, sequence_parallel=True, zero_stage=1,
                   remat="full", microbatches=4, schedule="zbv", virtual_stages=2,
                   recompute=False)
    filled = Layout.of_fields(dict(reversed(dataclasses.asdict(built).items())))
    assert filled == built and hash(filled) == hash(built) and repr(filled) == repr(built)
    assert dataclasses.replace(filled, data=1) == dataclasses.replace(built, data=1)


def test_each_layouts_compute_counts_the_attention_its_own_kernel_repeats():
    """Under `save_dots` cuDNN's attention runs again in the backward and the ring's does not
    (it names its output): a layout's FLOPs follow its own sequence axis, whatever the mesh
    of the config it was planned from. Reference: the FLOPs of the config the layout writes."""
    from jaxtron.config.platforms import for_platform
    from jaxtron.training.flops import hardware_flops_per_token

    config = for_platform(load_config("configs/llama3-8b.yaml", ["data.seq_len=8192",
                                                                 "model.max_seq_len=8192"]),
                          "cuda")
    tokens = config.train.batch_size * config.data.seq_len
    for sequence, kernel_repeats in ((1, True), (2, False)):
        layout = Layout(data=64 // sequence, sequence=sequence, remat="save_dots")
        applied = apply(config, layout)
        compute = estimate(config, layout, HARDWARE["h100"]).compute_s
        per_device_peak = HARDWARE["h100"].peak_flops * HARDWARE["h100"].efficiency
        expected = hardware_flops_per_token(applied, "gpu") * tokens / 64 / per_device_peak
        assert compute == pytest.approx(expected * (1 + SAVE_DOTS_OVERHEAD), rel=1e-9), sequence
        repeats = hardware_flops_per_token(applied, "gpu") > hardware_flops_per_token(
            apply(config, Layout(data=64, remat="none")), "gpu")
        assert repeats == kernel_repeats, sequence
