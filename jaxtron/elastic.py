"""Continuing a job on fewer processes than it started with, at the same global batch.

A checkpoint restores onto any mesh and process count, and each process reads its own rows of
the same global batch, so a job that has lost processes can go on from its newest checkpoint
on the ones left: what must change is the mesh (the data-parallel degree shrinks with the
devices, and the part of it across hosts with the hosts) and, to keep each device's share of a
step what it was, the number of accumulated microbatches (`optim.grad_accum` grows by the same
factor). The global batch (`train.batch_size`), the data stream and the learning-rate schedule
stay, so the loss curve continues as the uninterrupted run's, up to the order of the sums.
"""

from __future__ import annotations

from jaxtron import config as config_lib
from jaxtron.errors import JaxtronError


class CannotShrink(JaxtronError):
    """The job's layout cannot run on the processes left."""


def fewer_processes(config: config_lib.Config, before: int, after: int) -> list[str]:
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
    try:  # the shrunk config must still pass every check
        config_lib.from_dict(config_lib.to_dict(config), overrides)
    except config_lib.ConfigError as err:
        raise CannotShrink(f"the job cannot continue on {after} process(es): {err}") from None
    return overrides
