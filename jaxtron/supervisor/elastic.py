"""Continuing a job on fewer processes than it started with, at the same global batch.

A checkpoint restores onto any mesh and process count, and each process reads its own rows of
the same global batch, so a job that has lost processes can go on from its newest checkpoint
on the ones left: what must change is the mesh (the data-parallel degree shrinks with the
devices, and the part of it across hosts with the hosts) and, to keep each device's share of a
step what it was, the number of accumulated microbatches (`optim.grad_accum` grows by the same
factor). The global batch (`train.batch_size`), the data stream and the learning-rate schedule
stay, so the loss curve continues as the uninterrupted run's, up to the order of the sums.

That smallest change keeps every device's activations but not its state: ZeRO and fsdp shards
grow when their axes shrink. Given the devices' memory (`shrink_within`), the planner's memory
model checks it, and where it does not fit the planner picks the fastest layout that does for
the devices left (same global batch, same pipeline stages, whose parameters keep their layout in
the checkpoint), e.g. ZeRO or fsdp where there was plain data parallelism.
"""

from __future__ import annotations

import dataclasses

from jaxtron.config.loading import config_from_dict, config_to_dict
from jaxtron.config.platforms import for_platform
from jaxtron.config.schema import Config
from jaxtron.errors import ConfigError, JaxtronError
from jaxtron.planner import schedule_choice
from jaxtron.planner.hardware import Hardware
from jaxtron.planner.layout import layout_of
from jaxtron.planner.memory import predict
from jaxtron.planner.search import is_legal, plan
from jaxtron.sharding.mesh import resolve_degrees


class CannotShrink(JaxtronError):
    """The job's layout cannot run on the processes left."""


def fewer_processes(config: Config, before: int, after: int) -> list[str]:
    """Overrides that run `config`, written for `before` processes of equal devices, on
    `after` of them with the same global batch; CannotShrink naming the setting otherwise."""
    if after < 1 or before % after:
        raise CannotShrink(f"{before} processes cannot shrink evenly to {after}; keep a "
                           "divisor of the process count (--min-processes).")
    factor, m = before // after, config.mesh
    overrides = []
    if m.data != -1:  # -1 takes whatever devices are left by itself
        if m.data % factor:
            raise CannotShrink(f"mesh.data={m.data} cannot shrink by {factor} for {after} "
                               "process(es); use mesh.data=-1 or a degree it divides.")
        overrides.append(f"mesh.data={m.data // factor}")
    if m.dcn_data > 1:
        if m.dcn_data % factor:
            raise CannotShrink(f"mesh.dcn_data={m.dcn_data} cannot shrink by {factor}; make "
                               "it a multiple of the process count.")
        overrides.append(f"mesh.dcn_data={m.dcn_data // factor}")
    overrides.append(f"optim.grad_accum={config.optim.grad_accum * factor}")
    _shrunk(config, overrides, after)
    return overrides


def _shrunk(config: Config, overrides: list[str], after: int) -> Config:
    """`config` with `overrides`, which must still pass every check; CannotShrink if not."""
    try:
        return config_from_dict(config_to_dict(config), overrides)
    except ConfigError as err:
        raise CannotShrink(f"the job cannot continue on {after} process(es): {err}") from None


@dataclasses.dataclass(frozen=True)
class Devices:
    """What the supervisor knows of the machines: devices per process, each one's memory, and
    the hardware the planner ranks layouts for (its platform decides `model.dtype: auto`)."""
    per_process: int
    memory_bytes: int
    hardware: Hardware

    @property
    def platform(self) -> str:
        name = self.hardware.name
        return "cpu" if name == "cpu" else "tpu" if name.startswith("tpu") else "gpu"


def shrink_within(config: Config, before: int, after: int,
                  devices: Devices | None) -> list[str]:
    """`fewer_processes`' overrides when they fit `devices` (or nothing is known of them),
    else the planner's fastest fitting layout for the devices left; CannotShrink when none
    fits."""
    overrides = fewer_processes(config, before, after)
    if devices is None:
        return overrides
    count = after * devices.per_process
    shrunk, _ = schedule_choice.resolve(_shrunk(config, overrides, after), count,
                                        devices.hardware, devices.memory_bytes, devices.platform)
    layout = layout_of(shrunk, resolve_degrees(shrunk.mesh, count))
    on_platform = for_platform(shrunk, "cuda" if devices.platform == "gpu" else devices.platform)
    if predict(on_platform, layout).total <= devices.memory_bytes:
        return overrides
    ranked = plan(config, count, devices.hardware, devices.memory_bytes, devices.platform)
    best = next((c.layout for c in ranked.fitting  # fastest first
                 if c.layout.stage == config.mesh.stage
                 and c.layout.virtual_stages == shrunk.pipeline.virtual_stages
                 and is_legal(config, c.layout)), None)
    if best is None:
        raise CannotShrink(
            f"no layout of this model fits {count} devices of "
            f"{devices.memory_bytes / 2**20:,.0f} MiB at train.batch_size="
            f"{config.train.batch_size}; keep more processes (--min-processes) or lower the "
            "batch.")
    chosen = best.overrides()
    chosen.update({f"mesh.dcn_{axis}": 1 for axis in ("data", "fsdp", "stage")})
    if after > 1:  # the data-parallel degree's share across hosts, as before
        chosen["mesh.dcn_data"] = after if chosen["mesh.data"] % after == 0 else 1
    overrides = [f"{key}={value}" for key, value in chosen.items()]
    _shrunk(config, overrides, after)
    return overrides
