"""What the supervisor reads from, and adds to, an srun step: which node a failed task ran on,
and the options that start the next step without the nodes that keep failing.

srun reports a task that ends badly on its stderr as `srun: error: <node>: task <n>: <what>`
(`task 0-3` for several, `tasks 1,3` in some versions); with `--kill-on-bad-exit=1` it then
ends the step. A node named there twice in a row (`--drop-after`) is left out of the next
step with `--exclude`, and the step asks for fewer nodes and tasks (`--nodes`, `--ntasks`),
which srun takes from the rest of the allocation.
"""

from __future__ import annotations

import re
import sys
import threading

FAILED_TASK = re.compile(r"srun: error: (?P<node>[^\s:]+): tasks? [\d,\-]+: (?P<what>.+)")


def failed_node(line: str) -> str | None:
    """The node an srun error line names, or None for any other line."""
    match = FAILED_TASK.search(line)
    return match.group("node") if match else None


def step_options(excluded: list[str], tasks: int | None) -> list[str]:
    """srun options for a step without `excluded` nodes, on `tasks` tasks (one per node)."""
    if not excluded:
        return []
    return [f"--exclude={','.join(excluded)}", f"--nodes={tasks}", f"--ntasks={tasks}"]


class FailedNodes:
    """Copies a step's stderr through to ours, noting the first node srun says failed."""

    def __init__(self, stream):
        self.first: str | None = None
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            sys.stderr.write(line)
            sys.stderr.flush()
            node = failed_node(line)
            if node and self.first is None:
                self.first = node

    def wait(self, timeout_s: float = 5) -> str | None:
        """The first failed node once srun's stderr has closed (or `timeout_s` has passed)."""
        self._thread.join(timeout_s)
        return self.first
