"""SIGTERM / SIGINT handling: finish the current step, save, exit 0; a second signal exits at once.

SLURM sends SIGTERM some time before it kills a job (`--signal`), so a run that checkpoints on
the first signal loses no work.

In a job of several processes the signal may reach one process, or reach them at different
steps; each acting on its own would leave one waiting in a save and another in the next step's
collective. There the agreement JAX already provides decides: the distributed runtime's
preemption notifier catches SIGTERM in whichever process gets it, the coordination service tells
the others, and `multihost_utils.reached_preemption_sync_point(step)` turns true at the same
step everywhere. SIGINT (Ctrl-C at a terminal) is passed on as SIGTERM to take the same road.
JAX's handler owns SIGTERM there, so a second SIGTERM does not exit at once (SIGKILL does).
"""

from __future__ import annotations

import os
import signal
import sys

import jax
from jax.experimental import multihost_utils


class PreemptionGuard:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: int | None = None
        self._previous = {}
        self._agreed = False

    def __enter__(self) -> "PreemptionGuard":
        self._agreed = jax.process_count() > 1
        # With several processes JAX's own SIGTERM handler must stay in place.
        signals = (signal.SIGINT,) if self._agreed else self.SIGNALS
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def stop_requested(self, step: int) -> bool:
        """Whether to save and stop after `step`: the same answer in every process."""
        if self._agreed:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested is not None

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            print(f"received {signal.Signals(signum).name} again: exiting without saving",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = signum
        print(f"received {signal.Signals(signum).name}: finishing this step, then saving a "
              "checkpoint (send it again to exit at once)", file=sys.stderr, flush=True)
        if self._agreed:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's notifier, which tells every process
