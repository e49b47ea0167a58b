"""SIGTERM / SIGINT handling: finish the current step, save, exit 0; a second signal exits at once.

SLURM sends SIGTERM some time before it kills a job (`--signal`), so a run that checkpoints on
the first signal loses no work.
"""

from __future__ import annotations

import os
import signal
import sys


class PreemptionGuard:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: int | None = None
        self._previous = {}

    def __enter__(self) -> "PreemptionGuard":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            print(f"received {signal.Signals(signum).name} again: exiting without saving",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested = signum
        print(f"received {signal.Signals(signum).name}: finishing this step, then saving a "
              "checkpoint (send it again to exit at once)", file=sys.stderr, flush=True)
