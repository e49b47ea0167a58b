"""Check a config before paying for the hardware: build one step from abstract shapes.

    python -m jaxtron.train --config configs/tiny.yaml --dry-run
    python -m jaxtron.train --config configs/llama3-8b.yaml --dry-run --target cuda --devices 64

Without `--target`, or with this machine's own platform, the step is compiled and XLA's memory
analysis gives the per-device bytes, and the communication counter (`sharding/traffic.py`) the
bytes each device sends per step by collective and mesh axis. With another platform (`cuda`, `rocm`, `tpu` from a CPU
machine) the step is lowered for it, which needs no such device: that runs every check JAX and
the kernels make before code generation (Pallas' Triton and Mosaic lowerings, TPU tile shapes,
shardings, dtypes), and the report names the attention kernel chosen and counts the kernels in
the lowered module. Memory then comes from the planner (`jaxtron.planner.memory`), since only
the target's compiler can allocate. `--devices N` builds the mesh from N simulated CPU devices,
so a layout for 64 GPUs is checked on a laptop.

A step that does not lower stops with one line naming the platform, JAX's first line of error
and the fields that decide the platform-specific code.
"""

from __future__ import annotations

import time

from jaxtron.config.platforms import local_platform
from jaxtron.config.schema import Config
from jaxtron.errors import ConfigError
from jaxtron.kernels.choice import report_line
from jaxtron.planner.layout import layout_of
from jaxtron.planner.memory import predict
from jaxtron.planner.traffic import communication
from jaxtron.sharding.collectives import count_collectives
from jaxtron.sharding.mesh import describe_mesh
from jaxtron.sharding.report import format_memory, memory_report, parameter_table
from jaxtron.training.trainer import Trainer

# How each platform's kernels appear in a lowered module.
KERNEL_MARKERS = {"cuda": "__gpu$xla.gpu.triton", "rocm": "__gpu$xla.gpu.triton",
                  "tpu": "tpu_custom_call"}


def _planned_traffic(trainer) -> tuple[str, dict]:
    """The planner's bytes sent per device per step on each mesh axis, for a step that is
    lowered, not compiled (its executed collectives are the compiler's to decide)."""
    layout = layout_of(trainer.config, dict(trainer.mesh.shape))
    sent = {axis: b for axis, b in communication(trainer.config, layout, "gpu").items() if b}
    cells = ", ".join(f"{axis} {b / 2**30:,.2f} GiB" for axis, b in sent.items()) or "none"
    return f"sent per device per step (planner's estimate): {cells}", sent


def _planned_memory(trainer) -> str:

    mem = predict(trainer.config, layout_of(trainer.config, dict(trainer.mesh.shape)))
    mib = 2 ** 20
    return (f"per-device memory (planner's estimate; only the {trainer.platform} compiler can "
            f"allocate): {mem.total / mib:,.1f} MiB = parameters {mem.params / mib:,.1f}, "
            f"optimizer {mem.optimizer / mib:,.1f}, gradients {mem.gradients / mib:,.1f}, "
            f"activations {mem.activations / mib:,.1f}, logits {mem.logits / mib:,.1f}")


def _lower(trainer):
    """Lower the step for the trainer's platform; a failure becomes one line with the fix."""
    try:
        return trainer.lower_step()
    except ConfigError:
        raise
    except Exception as err:  # JAX's and the kernels' lowering errors, whatever their type
        m = trainer.config.model
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise ConfigError(
            f"the train step does not lower for {trainer.platform}: {type(err).__name__}: "
            f"{first}. The fields that decide platform-specific code are "
            f"model.attention_impl (now {m.attention_impl}; xla takes the attention kernel "
            f"out of the step) and model.dtype (now {m.dtype}).") from None


def dry_run(config: Config, target: str | None = None) -> dict:
    """Build one step for `target` (default: this machine) and print what it will run."""

    here = local_platform()
    platform = target or here
    trainer = Trainer(config, platform=platform)  # refuses what the platform cannot run
    m = trainer.config.model
    mesh = describe_mesh(trainer.mesh, config.mesh)
    print(f"dry run for {platform} on this {here} machine; mesh: {mesh}; "
          f"axes {dict(trainer.mesh.shape)}")
    print(f"compute {m.dtype} (model.dtype={config.model.dtype}), parameters {m.param_dtype}")
    print(report_line(trainer.config, platform))
    state = trainer.abstract_state()
    print(parameter_table(state.params))
    start = time.perf_counter()
    if platform == here:
        compiled = trainer.compile_step(state, trainer.abstract_batch())
        report = memory_report(state, compiled)
        print(format_memory(report))
        traffic = count_collectives(compiled.as_text(), trainer.mesh)
        print("communication per step (from the compiled step):")
        print(traffic.table())
        report["sent_bytes"] = {"+".join(axes): sent for axes, sent in traffic.by_axes().items()}
        print(f"compiled one step in {time.perf_counter() - start:.1f} s")
        return report
    text = _lower(trainer).as_text()
    marker = KERNEL_MARKERS.get(platform)
    kernels = text.count(marker) if marker else 0
    found = f"{kernels} Pallas kernel calls ({marker}); " if marker else ""
    print(f"lowered the train step for {platform} in {time.perf_counter() - start:.1f} s: "
          f"{found}not compiled, which needs a {platform} device")
    print(_planned_memory(trainer))
    line, sent = _planned_traffic(trainer)
    print(line)
    ragged = text.count("ragged_all_to_all")
    if ragged:
        print(f"dropless expert exchange: {ragged} ragged_all_to_all calls")
    return {"platform": platform, "kernel_calls": kernels, "sent_bytes": sent,
            "ragged_all_to_all": ragged}
