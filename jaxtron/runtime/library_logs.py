"""Where the libraries' own log lines go during a run: a file in the run folder.

Orbax logs a failed background write (and its tracebacks, several times over) through absl's
logger; the run reports each failure itself, in one line naming the checkpoint and the fix, so
the libraries' details belong in `<run_dir>/library.log`, where they are kept for whoever needs
them, not on the console between the run's own lines.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from pathlib import Path
from typing import Iterator

LOGGERS = ("absl",)
FILE = "library.log"


@contextlib.contextmanager
def library_logs_in(run_dir: Path, process: int = 0, processes: int = 1) -> Iterator[None]:
    """Send the libraries' logs to `<run_dir>/library.log` (`library-<process>.log` in a job of
    several processes) while inside."""
    run_dir.mkdir(parents=True, exist_ok=True)
    name = FILE if processes == 1 else FILE.replace(".log", f"-{process}.log")
    handler = logging.FileHandler(run_dir / name)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in LOGGERS]
    before = [(logger.propagate, logger.level) for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.INFO)
    hooks = sys.excepthook, sys.unraisablehook
    sys.excepthook = lambda *exc: handler.stream.write("".join(traceback.format_exception(*exc)))
    sys.unraisablehook = lambda u: handler.stream.write("".join(
        traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback)))
    try:
        yield
    finally:
        sys.excepthook, sys.unraisablehook = hooks
        for logger, (propagate, level) in zip(loggers, before):
            logger.removeHandler(handler)
            logger.propagate, logger.level = propagate, level
        handler.close()
