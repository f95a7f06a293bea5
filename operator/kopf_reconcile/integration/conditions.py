"""Status conditions as ``meta.SetStatusCondition`` keeps them.

A condition is a mapping with ``type``, ``status`` (``"True"``, ``"False"`` or
``"Unknown"``), ``reason``, ``message``, ``observedGeneration`` and
``lastTransitionTime``. Setting one replaces the condition of its type, or appends it:
``lastTransitionTime`` moves only when ``status`` changes (a condition whose reason or
message alone changed keeps the time it last changed status), and ``observedGeneration``
records the generation of the spec the reconciler acted on.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from kopf_reconcile.api import ConfigError

__all__ = ["set_status_condition"]

_STATUSES = ("True", "False", "Unknown")


def set_status_condition(
    conditions: Sequence[Mapping[str, Any]] | None,
    condition: Mapping[str, Any],
    *,
    generation: int | None = None,
    now: datetime.datetime | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """The conditions with ``condition`` set, and whether anything changed.

    ``generation`` fills ``observedGeneration`` when the condition does not carry one;
    ``now`` is the transition time of a new status (default: the current UTC time, whole
    seconds, as ``metav1.Time`` serialises it).
    """
    kind, status = condition.get("type"), condition.get("status")
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"a condition needs a non-empty string 'type', got {condition!r}")
    if status not in _STATUSES:
        raise ConfigError(
            f"condition {kind!r}: 'status' must be one of {', '.join(_STATUSES)}, got {status!r}"
        )
    moment = (now or datetime.datetime.now(datetime.UTC)).replace(microsecond=0)
    stamp = moment.strftime("%Y-%m-%dT%H:%M:%SZ")
    wanted: dict[str, Any] = {
        "type": kind,
        "status": status,
        "reason": str(condition.get("reason") or ""),
        "message": str(condition.get("message") or ""),
    }
    observed = condition.get("observedGeneration", generation)
    if observed is not None:
        wanted["observedGeneration"] = observed
    result = [dict(c) for c in conditions or ()]
    for existing in result:
        if existing.get("type") != kind:
            continue
        before = dict(existing)
        if existing.get("status") != status:
            existing["lastTransitionTime"] = condition.get("lastTransitionTime") or stamp
        existing.update(wanted)
        return result, existing != before
    result.append({**wanted, "lastTransitionTime": condition.get("lastTransitionTime") or stamp})
    return result, True
