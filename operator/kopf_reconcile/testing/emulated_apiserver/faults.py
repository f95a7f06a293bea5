"""Fault injection: fail or delay the next requests that match a method and a path pattern.

A :class:`Fault` matches requests by HTTP method (or ``*``) and a regular expression that
must match the whole request path (without the query). Each match consumes one of its
``times`` (``None``: forever), waits ``delay`` seconds if set, then answers ``status`` with
a kube-apiserver ``Status`` body if set, or lets the request through (delay-only faults).
Exhausted faults are dropped, so the list stays as small as what tests configure.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field


@dataclass
class Fault:
    """One configured fault and how often it has fired."""

    id: int
    method: str
    path_pattern: re.Pattern[str]
    status: int | None
    delay: float | None
    times: int | None
    fired: int = field(default=0)

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.fired >= self.times

    def describe(self) -> dict[str, object]:
        return {
            "id": self.id,
            "method": self.method,
            "path_pattern": self.path_pattern.pattern,
            "status": self.status,
            "delay": self.delay,
            "times": self.times,
            "fired": self.fired,
        }


class FaultInjector:
    """The active faults, consulted once per request in the order they were added."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._ids = itertools.count(1)

    def add(
        self,
        method: str,
        path_pattern: str,
        status: int | None = None,
        delay: float | None = None,
        times: int | None = 1,
    ) -> Fault:
        if status is None and delay is None:
            raise ValueError("a fault needs a status, a delay, or both")
        if status is not None and not 400 <= status <= 599:
            raise ValueError(f"fault status must be an HTTP error code, got {status!r}")
        if delay is not None and delay < 0:
            raise ValueError(f"fault delay must not be negative, got {delay!r}")
        if times is not None and times < 1:
            raise ValueError(f"fault times must be positive or None, got {times!r}")
        fault = Fault(
            id=next(self._ids),
            method=method.upper(),
            path_pattern=re.compile(path_pattern),
            status=status,
            delay=delay,
            times=times,
        )
        self._faults.append(fault)
        return fault

    def take(self, method: str, path: str) -> Fault | None:
        """The first fault matching this request, with one use consumed; None if none."""
        for fault in self._faults:
            if fault.method in ("*", method) and fault.path_pattern.fullmatch(path):
                fault.fired += 1
                if fault.exhausted:
                    self._faults.remove(fault)
                return fault
        return None

    def remove(self, fault_id: int) -> None:
        self._faults = [fault for fault in self._faults if fault.id != fault_id]

    def clear(self) -> None:
        self._faults.clear()

    def active(self) -> list[Fault]:
        return list(self._faults)
