"""Stale writes to the Kubernetes API, counted from the API server's own record (its audit log).

The promise checked. A reconciler's write through ``kr.fenced_client()`` carries its Lease,
holder and epoch as user extras (``kopf-reconcile.io/lease``, ``/holder``, ``/epoch``; the
audit log shows them under ``impersonatedUser.extra``). In the log's order each Lease has a
current term (holder, epoch), which every successful write of it sets: a takeover, a
renewal, a release (no holder), an edit, a deletion (no Lease). A write the API server
admitted (a 2xx answer) is *stale* when the term it carries was not the current one then,
and *unfenced* when its Lease did not exist then (the fence had nothing to compare it
with). Order is the order of the log: the API server writes each request's line when it
answers (stage ``ResponseComplete``).

The log is JSON lines in the ``audit.k8s.io/v1`` Event format, as kube-apiserver writes it
with ``--audit-log-path`` (Lease writes at level ``RequestResponse``, so their
``responseObject`` shows the Lease after the write) and as the embedded API writes it with
``audit_log=``. :func:`api_writes` reads the fenced writes, :func:`lease_terms` the Leases'
terms, :func:`stale_api_writes` finds the stale ones and :func:`assert_no_stale_api_writes`
fails naming them; :func:`unfenced_api_writes` finds writes that named a Lease the API server
had no record of (which its fence cannot check). Each reads the log from byte ``start``: a
test on a shared cluster's log reads what was written since :func:`log_size` at its start.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "ApiWrite",
    "LeaseTerm",
    "api_writes",
    "assert_no_stale_api_writes",
    "lease_terms",
    "log_size",
    "refused_api_writes",
    "stale_api_writes",
    "unfenced_api_writes",
]

LEASE, HOLDER, EPOCH = (
    "kopf-reconcile.io/lease",
    "kopf-reconcile.io/holder",
    "kopf-reconcile.io/epoch",
)
_WRITES = frozenset({"create", "update", "patch", "delete", "deletecollection"})
GONE = -1  # the epoch of a deleted Lease's term: there is no Lease


@dataclasses.dataclass(frozen=True)
class ApiWrite:
    """One fenced write the API server answered."""

    seq: int  # its line in the log
    lease: str  # <namespace>/<name>
    holder: str
    epoch: int
    code: int
    verb: str
    what: str  # resource[/subresource] namespace/name

    @property
    def admitted(self) -> bool:
        return 200 <= self.code < 300


@dataclasses.dataclass(frozen=True)
class LeaseTerm:
    """A Lease as a successful write of it left it."""

    seq: int
    lease: str
    holder: str
    epoch: int


def log_size(path: str | Path) -> int:
    """Where the log ends now: a ``start`` for reading only what is written from now on."""
    return Path(path).stat().st_size if Path(path).exists() else 0


def _events(path: str | Path, start: int = 0) -> Iterator[tuple[int, dict[str, object]]]:
    with open(path, encoding="utf-8") as log:
        log.seek(start)
        for seq, raw in enumerate(log):
            text = raw.strip()
            if not text:
                continue
            try:
                event = json.loads(text)
            except ValueError:
                continue  # a line cut short as the log is being written
            if event.get("stage", "ResponseComplete") == "ResponseComplete":
                yield seq, event


def _code(event: dict[str, object]) -> int:
    status = event.get("responseStatus")
    return int(status.get("code", 0)) if isinstance(status, dict) else 0


def api_writes(path: str | Path, start: int = 0) -> list[ApiWrite]:
    """Every fenced write in the log (admitted or not), in the log's order."""
    writes = []
    for seq, event in _events(path, start):
        if event.get("verb") not in _WRITES or "dryRun=" in str(event.get("requestURI", "")):
            continue  # a dry run changes nothing (the fence's coverage probe is one)
        user = event.get("impersonatedUser")
        extra = user.get("extra") if isinstance(user, dict) else None
        if not isinstance(extra, dict) or not all(k in extra for k in (LEASE, HOLDER, EPOCH)):
            continue
        ref = event.get("objectRef") if isinstance(event.get("objectRef"), dict) else {}
        assert isinstance(ref, dict)
        resource = "/".join(filter(None, (ref.get("resource"), ref.get("subresource"))))
        where = "/".join(filter(None, (ref.get("namespace"), ref.get("name"))))
        try:
            epoch = int(extra[EPOCH][0])
        except (ValueError, IndexError, TypeError):
            epoch = -1
        writes.append(
            ApiWrite(
                seq=seq,
                lease=str(extra[LEASE][0]),
                holder=str(extra[HOLDER][0]),
                epoch=epoch,
                code=_code(event),
                verb=str(event.get("verb")),
                what=f"{resource} {where}",
            )
        )
    return writes


def refused_api_writes(path: str | Path, start: int = 0) -> list[ApiWrite]:
    """The fenced writes the API server refused with 403 Forbidden (its fence)."""
    return [w for w in api_writes(path, start) if w.code == 403]


def lease_terms(path: str | Path, start: int = 0) -> list[LeaseTerm]:
    """Every successful write of a Lease the log shows, in the log's order: the Lease after
    the write (its ``responseObject``), or, for a deletion, no holder at epoch ``GONE``."""
    terms = []
    for seq, event in _events(path, start):
        ref = event.get("objectRef")
        if not isinstance(ref, dict) or ref.get("resource") != "leases":
            continue
        if ref.get("apiGroup") != "coordination.k8s.io" or not 200 <= _code(event) < 300:
            continue
        if event.get("verb") == "delete" and ref.get("name"):
            lease = f"{ref.get('namespace')}/{ref.get('name')}"
            terms.append(LeaseTerm(seq=seq, lease=lease, holder="", epoch=GONE))
            continue
        written = event.get("responseObject")
        if not isinstance(written, dict) or written.get("kind") != "Lease":
            continue
        metadata, spec = written.get("metadata") or {}, written.get("spec") or {}
        terms.append(
            LeaseTerm(
                seq=seq,
                lease=f"{metadata.get('namespace')}/{metadata.get('name')}",
                holder=str(spec.get("holderIdentity") or ""),
                epoch=int(spec.get("leaseTransitions") or 0),
            )
        )
    return terms


def _judged(path: str | Path, start: int = 0) -> tuple[list[ApiWrite], list[ApiWrite]]:
    """The admitted fenced writes that were stale, and those that were unfenced.

    A write whose Lease the log does not show (never written, or deleted) is unfenced, and
    judged by the writes alone: stale when a write of a higher epoch of that Lease was
    admitted before it. (A log must begin before the Leases it judges are written.)
    """
    current: dict[str, tuple[str, int]] = {}
    highest: dict[str, int] = {}
    stale: list[ApiWrite] = []
    unfenced: list[ApiWrite] = []
    events: list[tuple[int, LeaseTerm | ApiWrite]] = [(t.seq, t) for t in lease_terms(path, start)]
    events += [(w.seq, w) for w in api_writes(path, start) if w.admitted]
    for _, event in sorted(events, key=lambda pair: pair[0]):
        if isinstance(event, LeaseTerm):
            current[event.lease] = (event.holder, event.epoch)
            continue
        term = current.get(event.lease)
        if term is not None and term[1] != GONE:
            if term != (event.holder, event.epoch):
                stale.append(event)
        else:  # never written, or deleted: nothing to check the write against
            unfenced.append(event)
            if event.epoch < highest.get(event.lease, event.epoch):
                stale.append(event)
        highest[event.lease] = max(highest.get(event.lease, event.epoch), event.epoch)
    return stale, unfenced


def stale_api_writes(path: str | Path, start: int = 0) -> list[ApiWrite]:
    """Admitted fenced writes whose term was not their Lease's current one."""
    return _judged(path, start)[0]


def unfenced_api_writes(path: str | Path, start: int = 0) -> list[ApiWrite]:
    """Admitted fenced writes naming a Lease the log does not show then (never written, or
    deleted): the policy compares a write with the Lease it names, and a Lease that does not
    exist is no parameter, so the write passed unchecked."""
    return _judged(path, start)[1]


def assert_no_stale_api_writes(path: str | Path, start: int = 0) -> None:
    """Fail, naming them, when the API server admitted any stale write."""
    stale = stale_api_writes(path, start)
    assert not stale, "stale API writes admitted:\n" + "\n".join(map(str, stale))
