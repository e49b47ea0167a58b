"""User-facing errors: one paragraph that names the field or file and the fix.

The command-line entry points print these without a traceback and exit with status 2; anything
else that escapes is a bug and keeps its traceback.
"""


class JaxtronError(Exception):
    """Base of every error caused by user input rather than by jaxtron itself."""


class ConfigError(JaxtronError):
    """A config field, override or combination of fields that cannot run."""


class DataError(JaxtronError):
    """A dataset that is missing, malformed or does not fit the model."""
