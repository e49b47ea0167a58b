"""Which form of context parallelism the step being traced uses over the `sequence` axis.

`mesh.context_parallel` is a property of the run, not of the model: the Trainer traces its
steps inside `context_parallel(mode)` and the attention entry point reads it, as it reads the
active mesh, so the model never names a mesh axis. Outside a Trainer it is the ring.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

RING, ALL_TO_ALL, HYBRID = "ring", "all_to_all", "hybrid"

_MODE: contextvars.ContextVar[tuple[str, int]] = contextvars.ContextVar(
    "jaxtron_context_parallel", default=(RING, 1))


@contextlib.contextmanager
def context_parallel(mode: str, group: int = 1) -> Iterator[None]:
    """`group`: with `hybrid`, the consecutive ranks of `sequence` that exchange heads."""
    if mode not in (RING, ALL_TO_ALL, HYBRID):
        raise ValueError(f"context parallelism is {RING}, {ALL_TO_ALL} or {HYBRID}, not "
                         f"{mode!r}")
    token = _MODE.set((mode, group))
    try:
        yield
    finally:
        _MODE.reset(token)


def context_parallel_mode() -> tuple[str, int]:
    """(mode, all-to-all group size)."""
    return _MODE.get()


def ring_size(mode: str, sequence: int, group: int) -> int:
    """Members of each ring over `sequence` devices (1: no ring, the sequence stays in natural
    order)."""
    return {RING: sequence, ALL_TO_ALL: 1, HYBRID: sequence // max(group, 1)}[mode]
