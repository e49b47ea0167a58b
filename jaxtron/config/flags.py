"""Checks of the commands' own flags: each bad value is one line naming the flag and the fix,
as a config field's is (`checks.py`). argparse checks types; these check ranges."""

from __future__ import annotations

import math

from jaxtron.errors import ConfigError


def at_least(flag: str, value, low, fix: str) -> None:
    """`value` (None: not given) must be a finite number >= `low`."""
    if value is not None and not (math.isfinite(value) and value >= low):
        raise ConfigError(f"{flag} {value} must be at least {low}; {fix}.")


def above(flag: str, value, low, fix: str) -> None:
    """`value` (None: not given) must be a finite number > `low`."""
    if value is not None and not (math.isfinite(value) and value > low):
        raise ConfigError(f"{flag} {value} must be more than {low}; {fix}.")
