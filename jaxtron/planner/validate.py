"""Check the memory model against XLA: predicted vs compiled per-device bytes on this machine.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m jaxtron.planner.validate

For each layout of a small matrix the train step is compiled from abstract shapes (nothing is
allocated) and XLA's memory analysis gives the per-device arguments (parameters, optimizer
state, batch) plus peak temporaries (gradients, activations, logits); the planner's prediction
for the same layout is set beside it with the relative error.
"""

from __future__ import annotations

import sys

from jaxtron import config as config_lib
from jaxtron.planner.layout import Layout, apply
from jaxtron.planner.memory import predict

BASE = ["model.num_layers=4", "model.d_model=128", "model.num_heads=4", "model.num_kv_heads=2",
        "model.mlp_dim=512", "model.vocab_size=256", "data.seq_len=128", "train.batch_size=16"]
MATRIX = (Layout(data=8), Layout(fsdp=8), Layout(data=2, tensor=4),
          Layout(data=2, tensor=4, sequence_parallel=True), Layout(data=4, tensor=2, zero_stage=1),
          Layout(data=8, remat="full"), Layout(data=8, remat="save_dots"),
          Layout(data=4, stage=2, microbatches=4), Layout(data=2, fsdp=2, tensor=2),
          Layout(data=8, grad_accum=2))


def compiled_bytes(config: config_lib.Config) -> int:
    """Per-device arguments + peak temporaries of the compiled step (outputs alias the
    donated arguments)."""
    from jaxtron.trainer import Trainer

    trainer = Trainer(config)
    compiled = trainer.compile_step(trainer.abstract_state(), trainer.abstract_batch())
    stats = compiled.memory_analysis()
    return int(stats.argument_size_in_bytes + stats.temp_size_in_bytes)


def run(layouts=MATRIX, base=BASE) -> list[tuple[Layout, int, int]]:
    """[(layout, predicted bytes, compiled bytes)]."""
    config = config_lib.load("configs/tiny.yaml", list(base))
    rows = []
    for layout in layouts:
        planned = apply(config, layout)
        rows.append((layout, predict(planned, layout).total,
                     compiled_bytes(planned)))
    return rows


def main() -> int:
    rows = run()
    errors = []
    for layout, predicted, measured in rows:
        error = (predicted - measured) / measured
        errors.append(abs(error))
        print(f"{layout.describe():<40} predicted {predicted / 2**20:7.2f} MiB  XLA "
              f"{measured / 2**20:7.2f} MiB  error {error:+.1%}", flush=True)
    print(f"mean |error| {sum(errors) / len(errors):.1%}, max {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
