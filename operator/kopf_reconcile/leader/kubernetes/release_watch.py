"""The release watch: how a follower learns at once that a Lease was given up.

A follower that found a Lease held would otherwise learn of its release only at its
next acquire attempt, a renew interval later. Instead it watches the Lease (a
field-selected watch of the collection) from the ``resourceVersion`` it last read,
until the Lease is released, changes hands or is deleted; the holder's renewals do
not wake it, and a release between that read and the start of the watch is seen
too. A follower therefore needs ``list`` and ``watch`` on Leases besides ``get``,
``create`` and ``update``; without them it falls back to retrying every renew
interval.

A 410 (the version left the server's watch window) is answered as an informer
would: list the Lease, judge it, and watch from the list's version, once. Other
failures (an error status, a refused or dropped connection, an error event) end
the wait like a spurious wake-up, up to a few in a row; a refusal (403, ...) at
once. Then for one lease duration :class:`ReleaseWatch` does not watch: followers
wait out their own retry period, so a watch that keeps failing never turns into an
acquire attempt every few milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from kopf_reconcile.leader.kubernetes.connection import COLLECTION, LeaseApi, named
from kopf_reconcile.leader.kubernetes.lease_record import holder as holder_of
from kopf_reconcile.leader.timing import loop_time
from kopf_reconcile.remote_errors import describe_error, is_permanent

__all__ = ["ReleaseWatch"]

logger = logging.getLogger("kopf_reconcile.leader")

# A watch told its resourceVersion is too old (410) lists the Lease and watches again, once.
_WATCH_ATTEMPTS = 2
_GONE = "410 Gone"
# Consecutive failed watches before followers stop watching for a lease duration.
_WATCH_FAILURES_TOLERATED = 3
# A watch that stayed open this long (seconds) was working: it ends a run of failures.
_WATCH_HEALTHY = 2.0
# A watch connection silent this much longer than the watch's own timeout is dead.
_WATCH_SLACK = 5.0


class ReleaseWatch:
    """Watches one elector's Leases for a release, and stops watching while that fails.

    ``duration`` is the lease duration in whole seconds (the watch's ``timeoutSeconds``
    and the pause after repeated failures); ``connect_timeout`` bounds connecting.
    """

    def __init__(self, leases: LeaseApi, duration: int, connect_timeout: float) -> None:
        self._leases = leases
        self._duration = duration
        self._connect_timeout = connect_timeout
        # Until then (the event loop's clock), followers do not watch: watching failed
        # repeatedly (see wait); one dropped connection is just watched again.
        self._backoff_until = 0.0
        self._failures: dict[str, int] = {}  # failed watches in a row, per lease

    async def wait(self, reconciler_id: str, holder: str, version: str) -> None:
        """Return when the Lease held by ``holder`` at ``version`` is released, changes hands
        or is deleted, or when watching it failed (see the module docstring).

        Cancelling the wait closes the HTTP response.
        """
        pause = self._backoff_until - loop_time()
        if pause > 0:
            await asyncio.sleep(pause)
            return
        started = loop_time()
        try:
            failure = await self._watch(reconciler_id, holder, version)
        except (ApiException, aiohttp.ClientError, OSError, ValueError) as exc:
            # A refusal (403, ...) will not change by itself; a dropped connection or a
            # 5xx may: it is answered like a spurious wake-up (one acquire attempt, then a
            # new watch), up to a few in a row.
            if self._stop_watching(
                reconciler_id, describe_error(exc), started, at_once=is_permanent(exc)
            ):
                raise
            return
        finally:
            if loop_time() - started >= _WATCH_HEALTHY:  # it watched: the run is broken
                self._failures.pop(reconciler_id, None)
        if failure is not None:
            self._stop_watching(reconciler_id, failure, started)
        else:
            self._failures.pop(reconciler_id, None)

    async def _watch(self, reconciler_id: str, holder: str, version: str) -> str | None:
        """``None`` once the Lease was released, changed hands or went; else why not known."""
        for _ in range(_WATCH_ATTEMPTS):
            failure = await self._watch_from(reconciler_id, holder, version)
            if failure != _GONE:
                return failure
            # The version is too old to watch from: where is the Lease now?
            listed = await self._leases.request(
                "GET", COLLECTION, reconciler_id, query=named(reconciler_id)
            )
            items = listed.get("items") or []
            if not items or holder_of(items[0]) != holder:
                return None
            version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
        return "the watch kept answering 410 Gone"

    async def _watch_from(self, reconciler_id: str, holder: str, version: str) -> str | None:
        """Watch the Lease from ``version``: ``None`` when it changed as awaited, else why not."""
        api = await self._leases.client()
        namespace = await self._leases.resolved_namespace()
        started = loop_time()
        query = [
            *named(reconciler_id),
            ("watch", "1"),
            ("resourceVersion", version),
            ("timeoutSeconds", str(self._duration)),
        ]
        response = await api.call_api(
            COLLECTION,
            "GET",
            path_params={"namespace": namespace},
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            # No total timeout: the server ends the watch (timeoutSeconds); a connection
            # that goes silent for longer than that is dead.
            _request_timeout=aiohttp.ClientTimeout(
                sock_connect=self._connect_timeout, sock_read=self._duration + _WATCH_SLACK
            ),
        )
        if not isinstance(response, aiohttp.ClientResponse):
            raise TypeError(f"a watch of {self._leases.where(reconciler_id)} answered {response!r}")
        try:  # closed however this ends, cancellation included (no await in between)
            if response.status == 410:
                return _GONE
            if response.status != 200:
                text = (await response.text())[:500]
                raise ApiException(status=response.status, reason=f"{response.reason}: {text}")
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        return _GONE
                    return f"the watch answered {obj.get('code')}: {obj.get('message')}"
                if kind == "DELETED" or (
                    kind in ("ADDED", "MODIFIED") and holder_of(obj) != holder
                ):
                    return None
        finally:
            response.close()
        if loop_time() - started >= self._duration / 2:
            return None  # the server ended it at timeoutSeconds: worth an attempt anyway
        return "the watch ended early"

    def _stop_watching(
        self, reconciler_id: str, why: str, started: float, *, at_once: bool = False
    ) -> bool:
        """Count a failed watch; True once followers stop watching for a lease duration."""
        healthy = loop_time() - started >= _WATCH_HEALTHY
        failures = 1 if healthy else self._failures.get(reconciler_id, 0) + 1
        self._failures[reconciler_id] = failures
        if failures < _WATCH_FAILURES_TOLERATED and not at_once:
            logger.debug("watching %s ended: %s", self._leases.where(reconciler_id), why)
            return False
        self._failures.pop(reconciler_id, None)
        self._backoff_until = loop_time() + self._duration
        logger.warning(
            "watching %s for a release failed (%s); for %d s followers only retry every "
            "renew interval",
            self._leases.where(reconciler_id),
            why,
            self._duration,
        )
        return True
