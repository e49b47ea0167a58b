"""Which form of context parallelism the step being traced uses over the `sequence` axis.

`mesh.context_parallel` is a property of the run, not of the model: the Trainer traces its
steps inside `context_parallel(mode)` and the attention entry point reads it, as it reads the
active mesh, so the model never names a mesh axis. Outside a Trainer it is the ring.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

RING, ALL_TO_ALL = "ring", "all_to_all"

_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("jaxtron_context_parallel",
                                                            default=RING)


@contextlib.contextmanager
def context_parallel(mode: str) -> Iterator[None]:
    if mode not in (RING, ALL_TO_ALL):
        raise ValueError(f"context parallelism is {RING} or {ALL_TO_ALL}, not {mode!r}")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def context_parallel_mode() -> str:
    return _MODE.get()
