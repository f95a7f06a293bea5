"""The Lease object: its fields, labels and times as the elector reads and writes them.

A Lease is handled as the JSON the API server sends (:data:`Lease`), never as
kubernetes-asyncio's typed ``V1Lease``: the client serialises datetimes with
``isoformat()``, which drops the fraction when the microseconds are 0, and the API
server then rejects the write. ``acquireTime``/``renewTime`` are ``MicroTime``
values written with exactly six fractional digits (``2006-01-02T15:04:05.000000Z``)
by :func:`format_micro_time`. The lease duration is carried in whole seconds
(``leaseDurationSeconds``), so a TTL that is not a whole number of seconds is a
:class:`~kopf_reconcile.ConfigError` rather than silently rounded
(:func:`lease_duration_seconds`).

The epoch is ``spec.leaseTransitions`` (:func:`transitions`), an int32: at most
:data:`MAX_EPOCH`. Every Lease the elector writes is labelled
``app.kubernetes.io/managed-by=kopf-reconcile`` and with its reconciler id
(:func:`labels`), so ``kubectl get leases`` shows who leads what and
:func:`lease_record` can list them as the shared
:class:`~kopf_reconcile.leader.protocol.LeaseRecord`.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

from kopf_reconcile.api import ConfigError
from kopf_reconcile.leader.protocol import LeaseRecord, LeaseTTL
from kopf_reconcile.leader.timing import MAX_LEASE_TTL

__all__ = [
    "MANAGED_BY",
    "MANAGED_BY_LABEL",
    "MAX_EPOCH",
    "RECONCILER_LABEL",
    "RELEASED_LEASE_SECONDS",
    "Lease",
    "format_micro_time",
    "holder",
    "labels",
    "lease_duration_seconds",
    "lease_record",
    "spec",
    "transitions",
]

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "kopf-reconcile"
RECONCILER_LABEL = "kopf-reconcile/reconciler-id"
RELEASED_LEASE_SECONDS = 1  # what a released Lease says, as client-go writes it

Lease = dict[str, Any]

_MAX_INT32 = 2**31 - 1
#: The highest epoch a Lease can carry: ``spec.leaseTransitions`` is an int32.
MAX_EPOCH = _MAX_INT32
_MAX_LABEL_VALUE = 63
_LABEL_DIGEST = 10


def format_micro_time(moment: datetime.datetime) -> str:
    """A ``metav1.MicroTime``: UTC with exactly six fractional digits, even when they are 0."""
    if moment.tzinfo is None:
        raise ValueError(f"a MicroTime needs an aware datetime, got naive {moment!r}")
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_duration_seconds(ttl: LeaseTTL) -> int:
    """The TTL as ``spec.leaseDurationSeconds``; what whole seconds cannot carry is refused."""
    whole = int(ttl.seconds)
    if whole != ttl.seconds or not 1 <= whole <= MAX_LEASE_TTL:
        raise ConfigError(
            f"ttl of a Kubernetes Lease must be a whole number of seconds from 1 to "
            f"{MAX_LEASE_TTL} (it is stored as spec.leaseDurationSeconds), got {ttl.seconds!r} s"
        )
    return whole


def lease_record(lease: Lease) -> LeaseRecord:
    """A listed Lease as the shared record type; the expiry is renewTime plus the duration."""
    fields, metadata = spec(lease), lease.get("metadata") or {}
    holder_id = str(fields.get("holderIdentity") or "")
    renewed = _parse_micro_time(fields.get("renewTime"))
    duration = fields.get("leaseDurationSeconds")
    expires = None
    if holder_id and renewed is not None and isinstance(duration, int) and duration > 0:
        expires = renewed + datetime.timedelta(seconds=duration)
    return LeaseRecord(
        namespace=str(metadata.get("namespace") or "") or None,
        reconciler_id=str(metadata.get("name") or ""),
        holder_id=holder_id,
        epoch=transitions(lease),
        acquired_at=_parse_micro_time(fields.get("acquireTime")),
        renewed_at=renewed,
        expires_at=expires,
    )


def _parse_micro_time(value: object) -> datetime.datetime | None:
    """A MicroTime (or RFC 3339 time) as an aware datetime; None when absent or malformed."""
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.datetime.fromisoformat(value)
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=datetime.UTC)


def spec(lease: Lease) -> Lease:
    """The Lease's ``spec`` (empty when it has none)."""
    value = lease.get("spec")
    return value if isinstance(value, dict) else {}


def holder(lease: Lease) -> str:
    """``spec.holderIdentity`` (empty: released, or never held)."""
    return str(spec(lease).get("holderIdentity") or "")


def transitions(lease: Lease) -> int:
    """``spec.leaseTransitions``: the epoch (0 when absent)."""
    value = spec(lease).get("leaseTransitions")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def labels(reconciler_id: str) -> dict[str, str]:
    """The labels of the Lease of ``reconciler_id``."""
    return {MANAGED_BY_LABEL: MANAGED_BY, RECONCILER_LABEL: _label_value(reconciler_id)}


def _label_value(reconciler_id: str) -> str:
    """The reconciler id as a label value (at most 63 characters: long ids get a digest)."""
    if len(reconciler_id) <= _MAX_LABEL_VALUE:
        return reconciler_id
    digest = hashlib.sha256(reconciler_id.encode()).hexdigest()[:_LABEL_DIGEST]
    return f"{reconciler_id[: _MAX_LABEL_VALUE - _LABEL_DIGEST - 1]}-{digest}"
