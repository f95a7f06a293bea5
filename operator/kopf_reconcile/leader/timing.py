"""Lease timing: how long a lease lasts, when a leader steps down, how often it retries.

One value, :class:`LeaseTiming`, holds the three durations of client-go's
``LeaderElectionConfig``, and the rule that binds them is checked once, where the
value is built:

* ``ttl`` (client-go's LeaseDuration): how long a lease lasts without renewal, as
  the elector declares it (:class:`~kopf_reconcile.leader.protocol.LeaseTTL`);
* ``renew_deadline``: how long a leader goes on without a successful renewal before
  it steps down, 2/3 of the TTL (client-go: RenewDeadline 10 s of LeaseDuration 15 s),
  measured on the local clock from when the last successful renewal was *sent*;
* ``retry_period``: how often the lease is renewed (and, jittered, how often a
  follower tries to acquire it); it must be shorter than the renew deadline, or a
  leader whose renewals fail could not step down before its lease expires for the
  others.

The defaults (15 s, 10 s, 2 s) are client-go's; every elector, the Builder and the
process settings take them from here.

Every duration is measured on the event loop's monotonic clock (:func:`loop_time`), the
one the LeaseHolder and the Loop read; an elector judges expiry on it too.
"""

from __future__ import annotations

import asyncio
import dataclasses

from kopf_reconcile.api import ConfigError, Duration, seconds
from kopf_reconcile.leader.protocol import LeaseTTL

__all__ = [
    "DEFAULT_LEASE_TTL",
    "DEFAULT_RETRY_PERIOD",
    "MAX_LEASE_TTL",
    "RENEW_DEADLINE_FRACTION",
    "LeaseTiming",
    "loop_time",
]

DEFAULT_LEASE_TTL = LeaseTTL(15)  # client-go LeaseDuration
DEFAULT_RETRY_PERIOD = 2.0  # client-go RetryPeriod: the renew interval
RENEW_DEADLINE_FRACTION = 2 / 3  # client-go: RenewDeadline 10 s of LeaseDuration 15 s
# spec.leaseDurationSeconds is an int32; every elector shares that bound so that a value
# valid for one is valid for all (and a timedelta of it never overflows).
MAX_LEASE_TTL = 2**31 - 1


def loop_time() -> float:
    """The event loop's clock: the one the LeaseHolder and the Loop read."""
    return asyncio.get_running_loop().time()


@dataclasses.dataclass(frozen=True)
class LeaseTiming:
    """The validated durations of one lease: TTL, renew deadline and retry period (s)."""

    ttl: float
    renew_deadline: float
    retry_period: float

    @classmethod
    def of(
        cls,
        ttl: LeaseTTL,
        retry_period: Duration = DEFAULT_RETRY_PERIOD,
        *,
        ttl_option: str = "lease ttl",
        retry_option: str = "renew_interval",
    ) -> LeaseTiming:
        """The timing of a lease of ``ttl`` renewed every ``retry_period``, or a ConfigError.

        ``ttl_option`` and ``retry_option`` are the names the error message blames (an
        argument, or the environment variable a value came from).
        """
        retry = seconds(retry_option, retry_period)
        if retry <= 0:
            raise ConfigError(f"{retry_option} must be > 0 seconds, got {retry_period!r}")
        deadline = ttl.seconds * RENEW_DEADLINE_FRACTION
        if retry >= deadline:
            raise ConfigError(
                f"{retry_option} ({retry:g} s) must be shorter than the renew deadline "
                f"({deadline:.3g} s, 2/3 of {ttl_option} ({ttl.seconds:g} s)), so that a leader "
                "whose renewals fail steps down before its lease can expire for the others"
            )
        return cls(ttl=ttl.seconds, renew_deadline=deadline, retry_period=retry)
