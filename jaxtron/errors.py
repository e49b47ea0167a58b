"""User-facing errors: one paragraph that names the field or file and the fix.

The command-line entry points (`@exits_on_user_error`) print these without a traceback and exit
with status 2; anything else that escapes is a bug and keeps its traceback.
"""

import functools
import sys


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
            print(f"error: {err}", file=sys.stderr)
            return 2

    return wrapper
