"""Configuration values and their validation.

Every configuration error the framework raises is a :class:`ConfigError`
(a :class:`ValueError`) whose message names the option and the bad value, so
a misconfigured operator fails at build or start time with a sentence a user
can act on, never later with a confusing runtime error.

Durations are float seconds everywhere; a :class:`datetime.timedelta` is
accepted too and converted here, in one place.
"""

from __future__ import annotations

import datetime
import math

Duration = float | int | datetime.timedelta


class ConfigError(ValueError):
    """A configuration option has an invalid value; the message names both."""


def seconds(option: str, value: object) -> float:
    """Convert a duration option (seconds or timedelta) to float seconds, or raise."""
    if isinstance(value, datetime.timedelta):
        result = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{option} must be a number of seconds or a timedelta, got {value!r}")
    else:
        result = float(value)
    if math.isnan(result) or math.isinf(result):
        raise ConfigError(f"{option} must be a finite duration, got {value!r}")
    return result


def positive_seconds(option: str, value: object) -> float:
    """A duration that must be strictly positive."""
    result = seconds(option, value)
    if result <= 0:
        raise ConfigError(f"{option} must be > 0 seconds, got {value!r}")
    return result
