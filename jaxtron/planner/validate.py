"""Check the planner against XLA: predicted vs compiled per-device memory and communication.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m jaxtron.planner.validate

For each layout of a small matrix the train step is compiled from abstract shapes (nothing is
allocated). XLA's memory analysis gives the per-device arguments (parameters, optimizer state,
batch) plus peak temporaries (gradients, activations, logits); the communication counter
(`jaxtron/sharding/collectives.py`) gives the bytes each device sends per step, booked like the
planner's prediction (`jaxtron/planner/traffic.py`) to the outermost mesh axis a collective
spans. data and fsdp are compared together: XLA merges their gradient reductions differently
by ZeRO stage (one all-reduce over data x fsdp, or one per axis), with the same bytes in total.
The prediction is the CPU one: XLA:CPU has no reduce-scatter rewrite.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxtron.config.loading import load_config
from jaxtron.config.schema import Config
from jaxtron.planner.layout import Layout, apply
from jaxtron.planner.memory import predict
from jaxtron.planner.traffic import AXES, communication
from jaxtron.sharding.collectives import count_collectives
from jaxtron.training.trainer import Trainer

BASE = ["model.num_layers=4", "model.d_model=128", "model.num_heads=4", "model.num_kv_heads=2",
        "model.mlp_dim=512", "model.vocab_size=256", "data.seq_len=128", "train.batch_size=16"]
MOE = ["moe.num_experts=4", "moe.top_k=2"]
# Dropless under expert parallelism: the ragged exchange into buffers of twice the mean rows.
DROPLESS_EP = ["moe.mode=dropless", "moe.ep_buffer_factor=2"]
MATRIX = (Layout(data=8), Layout(fsdp=8), Layout(data=2, tensor=4),
          Layout(data=2, tensor=4, sequence_parallel=True), Layout(data=4, tensor=2, zero_stage=1),
          Layout(data=8, remat="full"), Layout(data=8, remat="save_dots"),
          Layout(data=4, stage=2, microbatches=4), Layout(data=2, fsdp=2, tensor=2),
          Layout(data=8, grad_accum=2), Layout(data=2, sequence=4),
          Layout(data=4, fsdp=2, zero_stage=2, grad_accum=2),
          Layout(data=2, sequence=4, context_parallel="all_to_all"),
          Layout(data=2, sequence=2, tensor=2, context_parallel="all_to_all"),
          Layout(data=2, sequence=4, context_parallel="hybrid", all_to_all_group=2))
# Layouts whose communication the planner predicts within 10% on this backend.
TRAFFIC_MATRIX = (Layout(data=8), Layout(fsdp=8), Layout(data=2, tensor=4),
                  Layout(data=4, tensor=2, zero_stage=1), Layout(data=8, remat="full"),
                  Layout(data=2, fsdp=2, tensor=2), Layout(data=8, grad_accum=2),
                  Layout(data=8, zero_stage=2), Layout(data=4, fsdp=2, zero_stage=2, grad_accum=2),
                  Layout(fsdp=8, remat="full"), Layout(data=2, fsdp=4, zero_stage=1),
                  Layout(data=4, tensor=2, remat="full"),
                  Layout(data=2, fsdp=2, tensor=2, grad_accum=2),
                  Layout(data=4, tensor=2, zero_stage=2, grad_accum=2),
                  Layout(data=2, fsdp=2, tensor=2, remat="save_dots"),
                  Layout(data=4, tensor=2, sequence_parallel=True),
                  Layout(data=2, fsdp=2, tensor=2, sequence_parallel=True),
                  Layout(data=4, tensor=2, sequence_parallel=True, remat="full"),
                  Layout(data=2, sequence=4), Layout(data=4, sequence=2, grad_accum=2),
                  Layout(data=2, sequence=2, tensor=2, sequence_parallel=True),
                  Layout(data=2, sequence=4, remat="full"),
                  Layout(data=2, sequence=4, context_parallel="all_to_all"),
                  Layout(data=2, sequence=4, remat="save_dots", context_parallel="all_to_all"),
                  Layout(data=2, sequence=2, tensor=2, context_parallel="all_to_all"),
                  Layout(data=2, sequence=4, context_parallel="hybrid", all_to_all_group=2),
                  Layout(sequence=8, remat="full", context_parallel="hybrid", all_to_all_group=4),
                  Layout(data=4, stage=2, microbatches=4), Layout(data=2, stage=4, microbatches=4),
                  Layout(data=2, stage=2, tensor=2, microbatches=4, sequence_parallel=True),
                  Layout(data=4, stage=2, microbatches=4, schedule="interleaved",
                         virtual_stages=2),
                  Layout(data=4, stage=2, microbatches=2, grad_accum=2),
                  Layout(data=4, stage=2, microbatches=2, zero_stage=2, grad_accum=2),
                  Layout(data=4, stage=2, microbatches=4, schedule="zb-h1"),
                  Layout(data=4, stage=2, microbatches=4, schedule="zbv", virtual_stages=2))
# Memory of mixture-of-experts layouts (4 experts, top-2 in every layer): capacity routing
# with expert parallelism, inside a pipeline, and the dropless grouped matmul.
MOE_MATRIX = ((Layout(data=2, expert=4), ()),
              (Layout(data=2, expert=2, stage=2, microbatches=4), ()),
              (Layout(data=8), ("moe.mode=dropless",)),
              (Layout(data=2, expert=4), tuple(DROPLESS_EP)))
# The same with a mixture of experts (4 experts, top-2, capacity routing) in every layer.
MOE_TRAFFIC_MATRIX = (Layout(data=2, expert=4), Layout(data=2, expert=4, grad_accum=2),
                      Layout(data=4, expert=2, zero_stage=1), Layout(fsdp=2, expert=4),
                      Layout(data=4, expert=2, zero_stage=2, grad_accum=2))
DROPLESS_EP_TRAFFIC_MATRIX = (Layout(data=2, expert=4), Layout(fsdp=2, expert=4))
BUCKETS = {"data+fsdp": ("data", "fsdp"), "tensor": ("tensor",), "sequence": ("sequence",),
           "expert": ("expert",), "stage": ("stage",)}


@dataclasses.dataclass(frozen=True)
class Row:
    layout: Layout
    predicted_bytes: int
    compiled_bytes: int
    predicted_sent: dict   # bucket -> bytes sent per device per step
    measured_sent: dict
    moe: bool = False

    def traffic_errors(self, floor: float = 2**16) -> dict:
        """bucket -> relative error, for buckets where either side sends more than `floor`.

        Under a pipeline, collectives inside a stage (tensor, fsdp) sit in the schedule's
        per-tick switch, which the counter books at its costliest branch on every tick (an
        upper bound, not what runs), so only stage and data traffic are compared there."""
        compared = BUCKETS
        if self.layout.stage > 1:
            compared = ["stage"] + (["data+fsdp"] if self.layout.fsdp == 1 else [])
        return {b: (self.predicted_sent[b] - self.measured_sent[b]) / self.measured_sent[b]
                if self.measured_sent[b] else float("inf")
                for b in compared if max(self.predicted_sent[b], self.measured_sent[b]) > floor}


def compiled(config: Config, compiler_options=None):
    """(per-device arguments + peak temporaries, Traffic) of the compiled step;
    `compiler_options`: XLA's, over XLA_FLAGS."""
    trainer = Trainer(config)
    step = trainer.compile_step(trainer.abstract_state(), trainer.abstract_batch(),
                                compiler_options)
    stats = step.memory_analysis()
    return (int(stats.argument_size_in_bytes + stats.temp_size_in_bytes),
            count_collectives(step.as_text(), trainer.mesh))


def compiled_bytes(config: Config, compiler_options=None) -> int:
    return compiled(config, compiler_options)[0]


def _bucketed(per_axis: dict) -> dict:
    return {b: sum(per_axis.get(a, 0.0) for a in axes) for b, axes in BUCKETS.items()}


def run(layouts=MATRIX, base=BASE, compiler_options=None) -> list[Row]:
    rows = []
    for layout in layouts:
        config = load_config("configs/tiny.yaml", list(base))
        planned = apply(config, layout)
        measured, traffic = compiled(planned, compiler_options)
        booked = dict.fromkeys(AXES, 0.0)
        for axes, sent in traffic.by_axes().items():
            if axes:
                booked[axes[0]] += sent  # the outermost axis it spans
        rows.append(Row(layout, predict(planned, layout).total, measured,
                        _bucketed(communication(planned, layout, "cpu")), _bucketed(booked),
                        planned.moe.enabled))
    return rows


def main(argv=None) -> int:
    argparse.ArgumentParser(
        prog="python -m jaxtron.planner.validate", description=__doc__.split("\n\n")[0],
        epilog="Compiles about 60 layouts: about 6 minutes on 2 CPU cores.").parse_args(argv)
    mib = 2**20
    errors = []
    print("memory: per-device arguments + peak temporaries")
    moe_rows = [row for layout, extra in MOE_MATRIX
                for row in run((layout,), BASE + MOE + list(extra))]
    for row in run(MATRIX) + moe_rows:
        error = (row.predicted_bytes - row.compiled_bytes) / row.compiled_bytes
        errors.append(abs(error))
        moe = " moe" if row.moe else ""
        print(f"{row.layout.describe() + moe:<44} predicted {row.predicted_bytes / mib:7.2f} "
              f"MiB  XLA {row.compiled_bytes / mib:7.2f} MiB  error {error:+.1%}", flush=True)
    print(f"mean |error| {sum(errors) / len(errors):.1%}, max {max(errors):.1%}")
    worst = 0.0
    print("communication: MiB sent per device per step, predicted / counted (error)")
    for row in (run(TRAFFIC_MATRIX) + run(MOE_TRAFFIC_MATRIX, BASE + MOE)
                + run(DROPLESS_EP_TRAFFIC_MATRIX, BASE + MOE + DROPLESS_EP)):
        cells = [f"{b} {row.predicted_sent[b] / mib:.2f} / {row.measured_sent[b] / mib:.2f} "
                 f"({e:+.1%})" for b, e in row.traffic_errors().items()]
        worst = max([worst, *map(abs, row.traffic_errors().values())])
        moe = " moe" if row.moe else ""
        print(f"{row.layout.describe() + moe:<44} {'  '.join(cells)}", flush=True)
    print(f"communication: worst |error| {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
