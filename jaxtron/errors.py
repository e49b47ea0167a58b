"""User-facing errors: one paragraph that names the field or file and the fix.

The command-line entry points (`@exits_on_user_error`) print these without a traceback and exit
with status 2; anything else that escapes is a bug and keeps its traceback.
"""

import atexit
import functools
import logging
import os
import sys
import threading
import time


class JaxtronError(Exception):
    """Base of every error caused by user input rather than by jaxtron itself."""


class ConfigError(JaxtronError):
    """A config field, override or combination of fields that cannot run."""


class DataError(JaxtronError):
    """A dataset that is missing, malformed or does not fit the model."""


def exits_on_user_error(main):
    """Wrap a command-line `main`: a JaxtronError becomes `error: ...` on stderr and status 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except JaxtronError as err:
            if getattr(err, "from_background", False):
                _let_background_threads_finish()
            print(f"error: {err}", file=sys.stderr, flush=True)
            return 2

    return wrapper


def _let_background_threads_finish(timeout_s: float = 5.0) -> None:
    """Threads that failed with the run (an Orbax write's) print their own report as they
    end: give them a few seconds, so that the error line comes after it, not inside it. Set
    `from_background` on an error raised for such a failure."""
    deadline = time.monotonic() + timeout_s
    for thread in _threads_an_exit_waits_for():
        try:
            thread.join(max(0.0, deadline - time.monotonic()))
        except Exception:  # Orbax's threads raise their own timeout from join
            pass


def exit_command(code: int):
    """Leave a command with `code`, without the interpreter's teardown (`_exit_without_teardown`).
    After an error line (status 2) nothing more is printed:
    background machinery that failed with the run (an Orbax write's asyncio tasks and threads)
    would otherwise report the same failure again, as tracebacks, while the interpreter shuts
    down. Only for a process that is ending (a command's `__main__`), never in a library call."""
    if code == 2:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.getLogger("asyncio").disabled = True
        logging.getLogger("absl").disabled = True
        sys.unraisablehook = lambda unraisable: None
        threading.excepthook = lambda args: None
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stderr.fileno())
        if _threads_an_exit_waits_for():
            # A failed background write's thread would keep the interpreter from exiting:
            # what it held is lost anyway, and the error line says where the last good
            # checkpoint is.
            os._exit(code)
    _exit_without_teardown(code)


def _exit_without_teardown(code: int):
    """Leave now that the command is done. The interpreter's own shutdown would spend about half
    a CPU-second collecting the garbage of every module JAX, Flax and Orbax imported, with
    nothing left to write: the run folder is closed. What a command relies on at exit still
    runs: the exit handlers (`jax.distributed`'s shutdown, logging's flush), then stdout and
    stderr are flushed. While a non-daemon thread still runs, the interpreter's exit waits for
    it as usual."""
    if _threads_an_exit_waits_for():
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _threads_an_exit_waits_for() -> list[threading.Thread]:
    """The threads the interpreter's exit would wait for: alive, not daemons, not this one."""
    return [t for t in threading.enumerate()
            if t is not threading.current_thread() and not t.daemon and t.is_alive()]
