"""Leader election on a Kubernetes ``coordination.k8s.io/v1`` Lease.

(Over 400 lines on purpose: acquisition, renewal, release, the release watch and the
epoch floor all read and write one Lease under one set of invariants (resourceVersion,
transitions, holder).)

:class:`KubernetesLeaseElector` keeps one Lease per reconciler id, named after
it, in one namespace, labelled ``app.kubernetes.io/managed-by=kopf-reconcile``
and with the reconciler id, so ``kubectl get leases`` shows who leads what.
It follows client-go's ``LeaseLock`` model:

* acquire creates the Lease, or takes over one that is free (released) or
  expired, by replacing it with the ``metadata.resourceVersion`` (and ``uid``)
  last read: of two processes racing for it, one gets 409 Conflict and
  reports contention. A holder that finds the Lease still naming it keeps it
  only at the epoch it holds (see "Edited Leases" below).
* renew replaces the Lease with a fresh ``renewTime``, again conditional on
  the version last read. When that fails with 409 the Lease is read again:
  if it still names this holder at the same epoch (an unrelated edit, or this
  holder's own earlier write whose answer was lost) the renewal is retried
  once; otherwise the lease is lost. Other errors are transient.
* release empties ``holderIdentity`` and sets ``leaseDurationSeconds`` to 1,
  keeping the transitions, so the next acquirer takes over at once.
* a follower learns of that at once: :meth:`KubernetesLeaseElector.wait_for_release`
  watches the Lease (a field-selected watch of the collection) from the
  ``resourceVersion`` it last read, until it is released, changes hands or is
  deleted, rather than waiting for its next retry. A follower therefore needs
  ``list`` and ``watch`` on Leases besides ``get``, ``create`` and ``update``;
  without them it falls back to retrying every renew interval.

Expiry is judged on this process's clock only: like client-go's
``observedTime``, the elector remembers each lease record (holder,
``renewTime``, ``resourceVersion``) and the time at which it first saw it, on
the event loop's monotonic clock (the one the LeaseHolder and the Loop read);
the lease is expired *for this process* once ``leaseDurationSeconds`` have
passed since then without a change. The
timestamps in the Lease come from other machines' clocks and are never
compared with ours (a holder whose clock runs years ahead cannot block a
takeover, one whose clock runs behind cannot be robbed early). A process
that has just started waits a full lease duration before taking over a lease
it finds held, because it cannot know how fresh that record is.

The epoch is ``spec.leaseTransitions``: every change of holder increments it
and renewals keep it. ``acquireTime``/``renewTime`` are ``MicroTime`` values
written with exactly six fractional digits (``2006-01-02T15:04:05.000000Z``)
by :func:`format_micro_time`, never by ``isoformat()``, which drops the
fraction when the microseconds are 0 and the API server then rejects the
write. The lease duration is carried in whole seconds
(``leaseDurationSeconds``), so a TTL that is not a whole number of seconds is
a :class:`~kopf_reconcile.ConfigError` rather than silently rounded.

Deleted Leases. Deleting a Lease and creating it again restarts
``leaseTransitions``; the epoch must not go backwards with it, or a zombie
leader's writes at the old epoch would pass the fence. So a new Lease starts
one above the highest epoch known: the highest this process has seen for it,
and the highest any process used, as reported by the source registered with
:meth:`KubernetesLeaseElector.use_epoch_floor` (a Loop registers its fenced
repository's ``highest_epoch``). Every change of holder consults the floor too,
so a Lease recreated by someone else (re-applied from a manifest, restored
from a backup) cannot take the epoch backwards either. A Loop with a fenced
store records each epoch there, and re-checks its lease, before it leads, so
the floor covers epochs that lead without having written yet. Residual risk:
without a fenced store, a Lease deleted while no running process remembers
its last epoch restarts at 1 (there is then no fencing to break, only the
epoch numbering); and Leases are only as durable as the cluster's etcd. When
that is not acceptable, :class:`~kopf_reconcile.leader.postgres.PostgresLeaseElector` is
the strong-fencing choice: its epoch lives in the same database as the
fenced rows and is never reset.

Edited Leases. Anyone allowed to update Leases can restore one from a backup
(an older epoch, possibly still naming this holder) or set
``spec.leaseTransitions`` to anything up to 2**31 - 1. A Lease that names this
elector is therefore kept only at the epoch this elector holds, and only when
no higher epoch is known; otherwise it is taken over like any change of holder,
above every epoch known, and the takeover is logged. Refusing it instead would
leave a restored Lease unusable until someone intervened; taking it over is
always safe for fencing, since the new epoch is above everything that could
have led. Epochs must fit in the int32 ``leaseTransitions``: when the next one
would not, nothing is written and :class:`LeaseEpochExhausted` names the
record at the bound (the Lease, or the fenced store's epochs) and how to
repair it; by handovers alone no fleet ever gets there. An epoch at the bound
that this process only remembers, and that neither the Lease nor the floor
shows any more (the Lease was deleted as the error advises), is forgotten
rather than blocking every later takeover until a restart.

Leader election is not fencing: a process paused past its lease still
believes it leads until it wakes up. The epoch, checked by the fenced
repository, is what rejects its late writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import load_incluster_config, load_kube_config
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.config.kube_config import list_kube_config_contexts

from kopf_reconcile.api import ConfigError, Duration
from kopf_reconcile.closing import AsyncClosing
from kopf_reconcile.control.epochs import EpochFloor, EpochMemory
from kopf_reconcile.leader.identity import unique_holder_id
from kopf_reconcile.leader.protocol import (
    LeaseContended,
    LeaseEpochExhausted,
    LeaseLost,
    LeaseRecord,
    LeaseToken,
    LeaseTTL,
)
from kopf_reconcile.leader.timing import DEFAULT_LEASE_TTL, MAX_LEASE_TTL
from kopf_reconcile.remote_errors import describe_error, is_permanent

__all__ = [
    "DEFAULT_LEASE_TTL",
    "MANAGED_BY",
    "MANAGED_BY_LABEL",
    "MAX_EPOCH",
    "RECONCILER_LABEL",
    "KubernetesLeaseElector",
    "LeaseEpochExhausted",
    "connect_api",
    "format_micro_time",
    "lease_duration_seconds",
]

logger = logging.getLogger("kopf_reconcile.leader")

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "kopf-reconcile"
RECONCILER_LABEL = "kopf-reconcile/reconciler-id"
RELEASED_LEASE_SECONDS = 1  # what a released Lease says, as client-go writes it
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

Lease = dict[str, Any]

_COLLECTION = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
_ITEM = _COLLECTION + "/{name}"
_ALL_NAMESPACES = "/apis/coordination.k8s.io/v1/leases"
_MAX_INT32 = 2**31 - 1
#: The highest epoch a Lease can carry: ``spec.leaseTransitions`` is an int32.
MAX_EPOCH = _MAX_INT32
_MAX_LABEL_VALUE = 63
_LABEL_DIGEST = 10
# A Lease deleted between our read and our write is read again this many times.
_ACQUIRE_READS = 3
# After a 409, renew and release read the Lease again and retry once if it is still ours.
_OWN_WRITE_ATTEMPTS = 2
# A watch told its resourceVersion is too old (410) lists the Lease and watches again, once.
_WATCH_ATTEMPTS = 2
_GONE = "410 Gone"
# Consecutive failed watches before followers stop watching for a lease duration.
_WATCH_FAILURES_TOLERATED = 3
# A watch that stayed open this long (seconds) was working: it ends a run of failures.
_WATCH_HEALTHY = 2.0
# A watch connection silent this much longer than the watch's own timeout is dead.
_WATCH_SLACK = 5.0


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


def _wall_clock() -> datetime.datetime:
    """Now, for the informational ``acquireTime``/``renewTime`` fields and the token."""
    return datetime.datetime.now(datetime.UTC)


@dataclasses.dataclass
class _Observation:
    """The last Lease record seen, and when (the event loop's clock) it was first seen."""

    lease: Lease
    record: tuple[str, str, str]  # holderIdentity, renewTime, resourceVersion
    at: float


def _now() -> float:
    """The event loop's clock: the one the LeaseHolder and the Loop read (see leader.timing)."""
    return asyncio.get_running_loop().time()


class KubernetesLeaseElector(AsyncClosing):
    """A :class:`~kopf_reconcile.leader.protocol.LeaderElector` on Kubernetes Leases.

    ``api`` is a kubernetes-asyncio ``ApiClient``, borrowed: the elector never
    closes it. Without one, the elector creates (and :meth:`close` closes) its
    own on first use, from the ``kubeconfig`` file when given, else from the
    in-cluster service account, else from the default kubeconfig
    (``$KUBECONFIG`` or ``~/.kube/config``). ``namespace`` defaults to
    ``POD_NAMESPACE``, then the namespace of that configuration (the kubeconfig
    context's, or the service account's; with a borrowed ``api``, the default
    kubeconfig's), then ``default``.
    """

    def __init__(
        self,
        namespace: str | None = None,
        ttl: LeaseTTL | Duration = DEFAULT_LEASE_TTL,
        holder_id: str | None = None,
        api: ApiClient | None = None,
        kubeconfig: str | os.PathLike[str] | None = None,
    ) -> None:
        """``holder_id`` defaults to ``POD_NAME`` (or the host name) plus a random suffix."""
        if namespace is not None and (not isinstance(namespace, str) or not namespace):
            raise ConfigError(f"namespace must be a non-empty string or None, got {namespace!r}")
        if holder_id is not None and (not isinstance(holder_id, str) or not holder_id):
            raise ConfigError(f"holder_id must be a non-empty string or None, got {holder_id!r}")
        if api is not None and kubeconfig is not None:
            raise ConfigError(
                f"give either api (a client) or kubeconfig (a file to make one from), not both; "
                f"got api={api!r} and kubeconfig={kubeconfig!r}"
            )
        self._ttl = ttl if isinstance(ttl, LeaseTTL) else LeaseTTL(ttl)
        self._duration = lease_duration_seconds(self._ttl)
        self._holder_id = holder_id if holder_id is not None else unique_holder_id()
        self._namespace = namespace or os.environ.get("POD_NAMESPACE") or None
        self._api = api
        self._owns_api = False
        self._kubeconfig = os.fspath(kubeconfig) if kubeconfig is not None else None
        self._connecting = asyncio.Lock()
        self._closed = False
        self._observed: dict[str, _Observation] = {}
        self._epochs = EpochMemory()
        # The epoch this elector holds or last held per lease (set before writing it,
        # so a takeover whose answer was lost is still recognised as ours).
        self._held: dict[str, int] = {}
        # Until then (the event loop's clock), followers do not watch: watching failed
        # repeatedly (see wait_for_release); one dropped connection is just watched again.
        self._watch_backoff_until = 0.0
        self._watch_failures: dict[str, int] = {}  # failed watches in a row, per lease

    @property
    def holder_id(self) -> str:
        """This elector's identity in ``spec.holderIdentity``."""
        return self._holder_id

    @property
    def ttl(self) -> LeaseTTL:
        """How long a lease lasts without renewal (the Loop derives its renew deadline)."""
        return self._ttl

    @property
    def namespace(self) -> str | None:
        """Where the Leases live; ``None`` until first use when it comes from the configuration."""
        return self._namespace

    async def lease_namespace(self) -> str:
        """Where the Leases live, resolved from the configuration if need be."""
        return await self._resolved_namespace()

    def use_epoch_floor(self, reconciler_id: str, source: EpochFloor) -> None:
        """Seed Leases this elector creates above ``await source()`` (the highest epoch used)."""
        self._epochs.use_floor(reconciler_id, source)

    def drop_epoch_floor(self, reconciler_id: str, source: EpochFloor) -> None:
        """Forget ``source`` as the floor of ``reconciler_id`` if it is the one registered."""
        self._epochs.drop_floor(reconciler_id, source)

    # -- the LeaderElector protocol ---------------------------------------------

    async def acquire_lease(self, reconciler_id: str) -> LeaseToken:
        """Become the holder, or raise :class:`LeaseContended` naming the current one."""
        if not isinstance(reconciler_id, str) or not reconciler_id:
            raise ValueError(f"reconciler_id must be a non-empty string, got {reconciler_id!r}")
        for _ in range(_ACQUIRE_READS):
            lease = await self._read(reconciler_id)
            if lease is None:
                return await self._create(reconciler_id)
            spec = _spec(lease)
            holder = spec.get("holderIdentity") or ""
            now = _wall_clock()
            if holder == self._holder_id and await self._still_ours(reconciler_id, lease):
                # Still ours at the epoch we hold (e.g. after a failed release): keep it.
                update: Lease = {"renewTime": format_micro_time(now)}
            else:
                if holder and holder != self._holder_id:
                    remaining = self._remaining(reconciler_id, lease)
                    if remaining >= 0:
                        raise LeaseContended(
                            f"{self._where(reconciler_id)} is held by {holder!r} at epoch "
                            f"{_transitions(lease)}; unless renewed it expires for this "
                            f"process in {remaining:.1f}s",
                            retry_after=remaining,
                        )
                # A change of holder; never below an epoch this process saw before, nor
                # below the floor (the Lease may have been recreated by someone else,
                # e.g. re-applied from a manifest, restarting its transitions).
                epoch = await self._next_epoch(reconciler_id, _transitions(lease))
                if holder == self._holder_id:
                    logger.warning(
                        "%s names this holder (%s) at epoch %d, but it last took epoch %s "
                        "and epochs up to %d are known: the Lease was edited or restored "
                        "from a backup; taking it over as a new holder at epoch %d",
                        self._where(reconciler_id),
                        self._holder_id,
                        _transitions(lease),
                        self._held.get(reconciler_id, "none"),
                        epoch - 1,
                        epoch,
                    )
                self._held[reconciler_id] = epoch
                update = {
                    "holderIdentity": self._holder_id,
                    "acquireTime": format_micro_time(now),
                    "renewTime": format_micro_time(now),
                    "leaseTransitions": epoch,
                }
            try:
                written = await self._replace(reconciler_id, lease, update)
            except ApiException as exc:
                if exc.status == 409:
                    raise LeaseContended(
                        f"{self._where(reconciler_id)} changed while {self._holder_id!r} was "
                        f"taking it over (another process won the race)",
                        # The winner's record is new to us: a whole lease duration (and a
                        # retry_after lets the caller wait for a release rather than sleep).
                        retry_after=self._duration,
                    ) from None
                if exc.status == 404:
                    continue  # deleted meanwhile: read again, then create it
                raise
            return self._token(reconciler_id, written, now)
        raise LeaseContended(f"{self._where(reconciler_id)} kept disappearing while acquiring it")

    async def renew_lease(self, token: LeaseToken) -> None:
        """Extend the lease, keeping its epoch; :class:`LeaseLost` if it is not ours any more."""
        await self._write_own(token, {"renewTime": format_micro_time(_wall_clock())})

    async def release_lease(self, token: LeaseToken) -> None:
        """Empty the holder so the next acquirer takes over now. Idempotent."""
        update = {
            "holderIdentity": "",
            "leaseDurationSeconds": RELEASED_LEASE_SECONDS,
            "renewTime": format_micro_time(_wall_clock()),
        }
        with contextlib.suppress(LeaseLost):  # not ours any more: nothing to give up
            await self._write_own(token, update)

    # -- followers: waiting for a release ---------------------------------------------

    async def wait_for_release(self, reconciler_id: str) -> None:
        """Return when the Lease last read is released, changes hands or is deleted.

        The Lease is watched from the ``resourceVersion`` this elector last read
        for it, so a release between that read and the start of the watch is seen
        too; the holder's renewals do not wake it. Returns at once when that read
        found no holder, or found nothing. A 410 (the version left the server's
        watch window) is answered as an informer would: list the Lease, judge it,
        and watch from the list's version, once. Other failures (an error status,
        a refused or dropped connection, an error event) propagate or return,
        and for one lease duration this elector then does not watch: followers
        wait out their own retry period, so a watch that keeps failing never
        turns into an acquire attempt every few milliseconds. Cancelling the
        wait closes the HTTP response.
        """
        observed = self._observed.get(reconciler_id)
        if observed is None or not observed.record[0]:
            return
        holder, version = observed.record[0], observed.record[2]
        pause = self._watch_backoff_until - _now()
        if pause > 0:
            await asyncio.sleep(pause)
            return
        started = _now()
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
            if _now() - started >= _WATCH_HEALTHY:  # it watched: the run is broken
                self._watch_failures.pop(reconciler_id, None)
        if failure is not None:
            self._stop_watching(reconciler_id, failure, started)
        else:
            self._watch_failures.pop(reconciler_id, None)

    async def _watch(self, reconciler_id: str, holder: str, version: str) -> str | None:
        """``None`` once the Lease was released, changed hands or went; else why not known."""
        for _ in range(_WATCH_ATTEMPTS):
            failure = await self._watch_from(reconciler_id, holder, version)
            if failure != _GONE:
                return failure
            # The version is too old to watch from: where is the Lease now?
            listed = await self._request(
                "GET", _COLLECTION, reconciler_id, query=_named(reconciler_id)
            )
            items = listed.get("items") or []
            if not items or _holder(items[0]) != holder:
                return None
            version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
        return "the watch kept answering 410 Gone"

    async def _watch_from(self, reconciler_id: str, holder: str, version: str) -> str | None:
        """Watch the Lease from ``version``: ``None`` when it changed as awaited, else why not."""
        api = await self._client()
        namespace = await self._resolved_namespace()
        started = _now()
        query = [
            *_named(reconciler_id),
            ("watch", "1"),
            ("resourceVersion", version),
            ("timeoutSeconds", str(self._duration)),
        ]
        response = await api.call_api(
            _COLLECTION,
            "GET",
            path_params={"namespace": namespace},
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            # No total timeout: the server ends the watch (timeoutSeconds); a connection
            # that goes silent for longer than that is dead.
            _request_timeout=aiohttp.ClientTimeout(
                sock_connect=self._ttl.seconds, sock_read=self._duration + _WATCH_SLACK
            ),
        )
        if not isinstance(response, aiohttp.ClientResponse):
            raise TypeError(f"a watch of {self._where(reconciler_id)} answered {response!r}")
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
                if kind == "DELETED" or (kind in ("ADDED", "MODIFIED") and _holder(obj) != holder):
                    return None
        finally:
            response.close()
        if _now() - started >= self._duration / 2:
            return None  # the server ended it at timeoutSeconds: worth an attempt anyway
        return "the watch ended early"

    def _stop_watching(
        self, reconciler_id: str, why: str, started: float, *, at_once: bool = False
    ) -> bool:
        """Count a failed watch; True once followers stop watching for a lease duration."""
        healthy = _now() - started >= _WATCH_HEALTHY
        failures = 1 if healthy else self._watch_failures.get(reconciler_id, 0) + 1
        self._watch_failures[reconciler_id] = failures
        if failures < _WATCH_FAILURES_TOLERATED and not at_once:
            logger.debug("watching %s ended: %s", self._where(reconciler_id), why)
            return False
        self._watch_failures.pop(reconciler_id, None)
        self._watch_backoff_until = _now() + self._duration
        logger.warning(
            "watching %s for a release failed (%s); for %d s followers only retry every "
            "renew interval",
            self._where(reconciler_id),
            why,
            self._duration,
        )
        return True

    # -- startup check ----------------------------------------------------------------

    async def list_leases(self, *, all_namespaces: bool = False) -> list[LeaseRecord]:
        """The kopf-reconcile Leases (by their managed-by label) of the namespace, or of all.

        The client and the namespace are this elector's own (see the class docstring).
        """
        api = await self._client()
        if all_namespaces:
            path, where = _ALL_NAMESPACES, {}
        else:
            path, where = _COLLECTION, {"namespace": await self._resolved_namespace()}
        listing = await api.call_api(
            path,
            "GET",
            path_params=where,
            query_params=[("labelSelector", f"{MANAGED_BY_LABEL}={MANAGED_BY}")],
            header_params={"Accept": "application/json"},
            response_types_map={200: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            _request_timeout=self._ttl.seconds,
        )
        items = listing.get("items") if isinstance(listing, dict) else None
        records = [_record(lease) for lease in items or [] if isinstance(lease, dict)]
        return sorted(records, key=lambda record: (record.namespace or "", record.reconciler_id))

    async def check_namespace(self, source: str = "namespace") -> None:
        """Raise :class:`ConfigError` naming ``source`` when the Lease namespace does not exist.

        A Lease in a missing namespace can never be created: the elector would retry
        forever and its Loop never lead. A dry-run create (``dryRun=All``: nothing is
        stored) asks the API server, which needs only the ``create`` permission the
        elector has anyway; reading the Namespace object would need more. Any other
        answer (the Lease exists: 409, no permission yet, an unreachable server) is not
        a configuration error, and is left to the elector's retries and its log.
        """
        namespace = await self._resolved_namespace()
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "kopf-reconcile-namespace-check", "namespace": namespace},
            "spec": {},
        }
        try:
            await self._request("POST", _COLLECTION, "", body, query=[("dryRun", "All")])
        except ApiException as exc:
            if exc.status == 404 and _names_kind(exc.body, "namespaces"):
                raise ConfigError(
                    f"{source} names namespace {namespace!r}, which does not exist in the "
                    "cluster: the Leases of leader election cannot be created there"
                ) from None

    # -- lifecycle -----------------------------------------------------------------

    async def close(self) -> None:
        """Close the API client if this elector created it (a borrowed one stays open)."""
        async with self._connecting:
            self._closed = True
            api, self._api = self._api, None
            if api is not None and self._owns_api:
                await api.close()

    def __repr__(self) -> str:
        return (
            f"<KubernetesLeaseElector holder={self._holder_id!r} "
            f"namespace={self._namespace!r} ttl={self._duration}s>"
        )

    # -- the Lease, over HTTP -------------------------------------------------------

    async def _read(self, reconciler_id: str) -> Lease | None:
        """GET the Lease and record the observation; ``None`` when it does not exist."""
        try:
            lease = await self._request("GET", _ITEM, reconciler_id)
        except ApiException as exc:
            if exc.status == 404:
                self._observed.pop(reconciler_id, None)
                return None
            raise
        self._observe(reconciler_id, lease)
        return lease

    async def _create(self, reconciler_id: str) -> LeaseToken:
        epoch = await self._next_epoch(reconciler_id)
        self._held[reconciler_id] = epoch
        now = _wall_clock()
        namespace = await self._resolved_namespace()
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": reconciler_id,
                "namespace": namespace,
                "labels": _labels(reconciler_id),
            },
            "spec": {
                "holderIdentity": self._holder_id,
                "leaseDurationSeconds": self._duration,
                "acquireTime": format_micro_time(now),
                "renewTime": format_micro_time(now),
                "leaseTransitions": epoch,
            },
        }
        try:
            created = await self._request("POST", _COLLECTION, reconciler_id, body)
        except ApiException as exc:
            if exc.status == 409:
                raise LeaseContended(
                    f"{self._where(reconciler_id)} was created by another process meanwhile",
                    retry_after=self._duration,
                ) from None
            raise
        self._observe(reconciler_id, created)
        return self._token(reconciler_id, created, now)

    async def _replace(self, reconciler_id: str, lease: Lease, update: Lease) -> Lease:
        """PUT ``lease`` with ``update`` in its spec, conditional on its version and uid."""
        metadata = {k: v for k, v in lease.get("metadata", {}).items() if k != "managedFields"}
        metadata["labels"] = {**(metadata.get("labels") or {}), **_labels(reconciler_id)}
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {**_spec(lease), "leaseDurationSeconds": self._duration, **update},
        }
        written = await self._request("PUT", _ITEM, reconciler_id, body)
        self._observe(reconciler_id, written)
        return written

    async def _write_own(self, token: LeaseToken, update: Lease) -> None:
        """Replace the Lease while it names us at ``token.epoch``; else :class:`LeaseLost`."""
        rid = token.reconciler_id
        observed = self._observed.get(rid)
        lease = observed.lease if observed is not None else None
        for _ in range(_OWN_WRITE_ATTEMPTS):
            if lease is None or not self._holds(lease, token):
                lease = await self._read(rid)
                if lease is None:
                    raise LeaseLost(f"{self._where(rid)} was deleted")
                if not self._holds(lease, token):
                    holder = _spec(lease).get("holderIdentity") or "nobody (released)"
                    raise LeaseLost(
                        f"{self._where(rid)} is held by {holder} at epoch {_transitions(lease)}, "
                        f"no longer by {token.holder_id!r} at epoch {token.epoch}"
                    )
            try:
                await self._replace(rid, lease, update)
            except ApiException as exc:
                if exc.status == 409:
                    lease = None  # changed since we read it: read it again and judge
                    continue
                if exc.status == 404:
                    raise LeaseLost(f"{self._where(rid)} was deleted") from None
                raise
            return
        raise LeaseLost(f"{self._where(rid)} keeps changing under {token.holder_id!r}")

    async def _request(
        self,
        method: str,
        path: str,
        reconciler_id: str,
        body: Lease | None = None,
        query: list[tuple[str, str]] | None = None,
    ) -> Lease:
        api = await self._client()
        namespace = await self._resolved_namespace()
        result = await api.call_api(
            path,
            method,
            path_params={"namespace": namespace, "name": reconciler_id},
            query_params=query,
            header_params={"Accept": "application/json", "Content-Type": "application/json"},
            body=body,
            response_types_map={200: "object", 201: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            _request_timeout=self._ttl.seconds,  # an answer later than that is useless
        )
        if not isinstance(result, dict):
            raise TypeError(f"{method} {path} answered {result!r}, not a Lease")
        return result

    # -- observation and ownership ----------------------------------------------------

    def _observe(self, reconciler_id: str, lease: Lease) -> None:
        spec = _spec(lease)
        record = (
            str(spec.get("holderIdentity") or ""),
            str(spec.get("renewTime") or ""),
            str(lease.get("metadata", {}).get("resourceVersion") or ""),
        )
        previous = self._observed.get(reconciler_id)
        if previous is None or previous.record != record:
            self._observed[reconciler_id] = _Observation(lease, record, _now())
        else:
            previous.lease = lease
        self._epochs.saw(reconciler_id, _transitions(lease))

    async def _still_ours(self, reconciler_id: str, lease: Lease) -> bool:
        """Whether a Lease naming this holder is at the epoch it holds, with nothing known above.

        Anything else was not left there by this elector: a Lease restored from a
        backup (an older epoch), or one whose transitions were edited. Adopting
        it would take the epoch backwards, or to wherever the edit put it; it is
        taken over as a change of holder instead, above every epoch known.
        """
        transitions = _transitions(lease)
        if self._held.get(reconciler_id) != transitions:
            return False
        return await self._epochs.next_epoch(reconciler_id, transitions) == transitions + 1

    async def _next_epoch(self, reconciler_id: str, current: int = 0) -> int:
        """The epoch of a change of holder: above ``current``, every epoch seen, and the floor.

        It must fit in ``spec.leaseTransitions`` (an int32). When it does not only
        because of an epoch this process saw earlier, one that neither the Lease
        nor the floor shows any more, that memory is dropped (a Lease edited up to
        the bound, then deleted as the error below advises, must not block every
        takeover until each replica restarts): with a fenced store, every epoch
        that ever led is at or below the floor, so nothing leads above it. When
        the Lease itself or the floor is at the bound, nothing is written: the
        :class:`LeaseEpochExhausted` says which record to repair, and how.
        """
        epoch = await self._epochs.next_epoch(reconciler_id, current)
        if epoch <= MAX_EPOCH:
            return epoch
        epoch = await self._epochs.next_epoch(reconciler_id, current, with_seen=False)
        if epoch <= MAX_EPOCH:
            logger.warning(
                "%s: this process saw an epoch for it that leaves no room below %d, which "
                "neither the Lease nor the fenced store shows now (it was edited, then "
                "repaired): forgetting it and continuing at epoch %d",
                self._where(reconciler_id),
                MAX_EPOCH,
                epoch,
            )
            self._epochs.forget_seen(reconciler_id)
            return epoch
        raise LeaseEpochExhausted(self._exhausted(reconciler_id, current, floor=epoch - 1))

    def _exhausted(self, reconciler_id: str, current: int, floor: int) -> str:
        """Why no new epoch fits, and how to repair it."""
        delete = f"kubectl delete lease -n {self._namespace} {reconciler_id}"
        if current >= MAX_EPOCH:
            return (
                f"{self._where(reconciler_id)} shows spec.leaseTransitions {current}, the "
                f"largest epoch a Lease can carry (an int32), so no replica can take it over "
                f"at a new epoch. Epochs grow by one per change of holder: this value was "
                f"written by hand or restored from elsewhere. Repair: delete the Lease "
                f"({delete}); the next leader then starts above the highest epoch the fenced "
                f"store recorded (if that is at the bound too, the next error says so)"
            )
        return (
            f"the fenced store's highest epoch for {reconciler_id!r} is {floor}, so a new "
            f"epoch of {self._where(reconciler_id)} would not fit in spec.leaseTransitions "
            f"(at most {MAX_EPOCH}, an int32) and no replica can lead. No fleet gets there "
            f"by handovers: the store's epoch record was written by hand or by a lease "
            f"elsewhere. Repair, with every replica stopped: lower the epochs the fenced "
            f"store keeps for this scope (for PostgresFencedRepository, its <table>_epochs "
            f"row and the last_epoch of its <table> rows), then delete the Lease ({delete})"
        )

    def _remaining(self, reconciler_id: str, lease: Lease) -> float:
        """Seconds until the observed record expires for this process (negative: expired)."""
        observed = self._observed[reconciler_id]
        duration = _spec(lease).get("leaseDurationSeconds") or self._duration
        return observed.at + float(duration) - _now()

    def _holds(self, lease: Lease, token: LeaseToken) -> bool:
        spec = _spec(lease)
        return spec.get("holderIdentity") == token.holder_id and _transitions(lease) == token.epoch

    def _token(self, reconciler_id: str, lease: Lease, now: datetime.datetime) -> LeaseToken:
        return LeaseToken(
            reconciler_id=reconciler_id,
            holder_id=self._holder_id,
            epoch=_transitions(lease),
            acquired_at=now,
            expires_at=now + datetime.timedelta(seconds=self._duration),
        )

    def _where(self, reconciler_id: str) -> str:
        return f"lease {self._namespace}/{reconciler_id}"

    # -- configuration --------------------------------------------------------------

    async def _client(self) -> ApiClient:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._api is not None:
            return self._api
        async with self._connecting:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            if self._api is None:
                self._api, namespace = await _connect(self._kubeconfig)
                self._owns_api = True
                if self._namespace is None:
                    self._namespace = namespace or "default"
            return self._api

    async def _resolved_namespace(self) -> str:
        if self._namespace is None:
            await self._client()
        if self._namespace is None:  # a borrowed client: the default kubeconfig may say
            self._namespace = _kubeconfig_namespace(None) or "default"
        return self._namespace


async def connect_api(kubeconfig: str | None = None) -> ApiClient:
    """A new client by the elector's rules: ``kubeconfig``, else in-cluster, else the default."""
    api, _ = await _connect(kubeconfig)
    return api


async def _connect(kubeconfig: str | None) -> tuple[ApiClient, str | None]:
    """A new client and the namespace its configuration names (if any)."""
    configuration = Configuration()
    if kubeconfig is None:
        try:
            load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except ConfigException:
            pass  # not in a pod: fall back to the default kubeconfig
        else:
            return ApiClient(configuration), _service_account_namespace()
    path = kubeconfig if kubeconfig is not None else _default_kubeconfig()
    try:
        await load_kube_config(
            config_file=path, client_configuration=configuration, persist_config=False
        )
    except (ConfigException, OSError) as exc:
        raise ConfigError(f"kubeconfig {path!r} cannot be used: {exc}") from exc
    return ApiClient(configuration), _kubeconfig_namespace(path)


def _default_kubeconfig() -> str:
    return os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")


def kubeconfig_namespace(path: str | None = None) -> str | None:
    """The current context's namespace in a kubeconfig (default: the default kubeconfig)."""
    return _kubeconfig_namespace(path)


def _kubeconfig_namespace(path: str | None) -> str | None:
    """The current context's namespace in a kubeconfig (``None``: the default one)."""
    path = path if path is not None else _default_kubeconfig()
    if not any(os.path.exists(os.path.expanduser(p)) for p in path.split(os.pathsep) if p):
        return None
    try:
        _, current = list_kube_config_contexts(path)
    except (ConfigException, OSError, KeyError, TypeError):
        return None
    namespace = ((current or {}).get("context") or {}).get("namespace")
    return namespace if isinstance(namespace, str) and namespace else None


def _service_account_namespace() -> str | None:
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as file:
            return file.read().strip() or None
    except OSError:
        return None


def _record(lease: Lease) -> LeaseRecord:
    """A listed Lease as the shared record type; the expiry is renewTime plus the duration."""
    spec, metadata = _spec(lease), lease.get("metadata") or {}
    holder = str(spec.get("holderIdentity") or "")
    renewed = _parse_micro_time(spec.get("renewTime"))
    duration = spec.get("leaseDurationSeconds")
    expires = None
    if holder and renewed is not None and isinstance(duration, int) and duration > 0:
        expires = renewed + datetime.timedelta(seconds=duration)
    return LeaseRecord(
        namespace=str(metadata.get("namespace") or "") or None,
        reconciler_id=str(metadata.get("name") or ""),
        holder_id=holder,
        epoch=_transitions(lease),
        acquired_at=_parse_micro_time(spec.get("acquireTime")),
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


def _names_kind(body: object, kind: str) -> bool:
    """Whether a ``Status`` body is about an object of ``kind`` (its ``details.kind``)."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    try:
        status = json.loads(body) if isinstance(body, str) else None
    except ValueError:
        return False
    details = status.get("details") if isinstance(status, dict) else None
    return isinstance(details, dict) and details.get("kind") == kind


def _spec(lease: Lease) -> Lease:
    spec = lease.get("spec")
    return spec if isinstance(spec, dict) else {}


def _holder(lease: Lease) -> str:
    return str(_spec(lease).get("holderIdentity") or "")


def _named(reconciler_id: str) -> list[tuple[str, str]]:
    """The query that selects the Lease of ``reconciler_id`` in a list or watch."""
    return [("fieldSelector", f"metadata.name={reconciler_id}")]


def _transitions(lease: Lease) -> int:
    value = _spec(lease).get("leaseTransitions")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _labels(reconciler_id: str) -> dict[str, str]:
    return {MANAGED_BY_LABEL: MANAGED_BY, RECONCILER_LABEL: _label_value(reconciler_id)}


def _label_value(reconciler_id: str) -> str:
    """The reconciler id as a label value (at most 63 characters: long ids get a digest)."""
    if len(reconciler_id) <= _MAX_LABEL_VALUE:
        return reconciler_id
    digest = hashlib.sha256(reconciler_id.encode()).hexdigest()[:_LABEL_DIGEST]
    return f"{reconciler_id[: _MAX_LABEL_VALUE - _LABEL_DIGEST - 1]}-{digest}"
