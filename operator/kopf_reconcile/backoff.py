"""Exponential backoff with full jitter, and the ±10 % jitter of periodic requeues.

Full jitter (a uniform draw in ``[0, min(max, base·2ⁿ)]``) spreads retries of
entities that failed together, so a shared outage does not turn into
synchronised retry waves. The random source is injectable for tests.
"""

from __future__ import annotations

import random

# 2**63 seconds is far beyond any cap; bounding the exponent avoids float overflow.
_MAX_EXPONENT = 62


def exponential_cap(base: float, maximum: float, failures: int) -> float:
    """``min(maximum, base·2^failures)``: the upper bound of the n-th retry delay."""
    return min(maximum, base * float(2 ** min(failures, _MAX_EXPONENT)))


def full_jitter(rng: random.Random, cap: float) -> float:
    """A delay drawn uniformly from ``[0, cap]``."""
    return rng.uniform(0.0, cap)


def requeue_jitter(rng: random.Random, interval: float, spread: float = 0.1) -> float:
    """``interval`` ± ``spread`` (10 % by default), so N entities do not wake together."""
    return interval * (1.0 - spread + 2.0 * spread * rng.random())
