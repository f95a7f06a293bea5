"""The elector: acquiring, renewing and releasing a Kubernetes Lease, and its epoch.

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
  watches the Lease from the ``resourceVersion`` it last read, until it is
  released, changes hands or is deleted, rather than waiting for its next retry
  (:mod:`~kopf_reconcile.leader.kubernetes.release_watch`).

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
and renewals keep it. How the Lease's fields, labels and ``MicroTime`` values
are written is :mod:`~kopf_reconcile.leader.kubernetes.lease_record`'s; the
client and the namespace are :mod:`~kopf_reconcile.leader.kubernetes.connection`'s.

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

import contextlib
import dataclasses
import datetime
import logging
import os

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from kopf_reconcile.api import ConfigError, Duration
from kopf_reconcile.closing import AsyncClosing
from kopf_reconcile.control.epochs import EpochFloor, EpochMemory
from kopf_reconcile.leader.identity import checked_holder_id
from kopf_reconcile.leader.kubernetes.connection import (
    ALL_NAMESPACES,
    COLLECTION,
    ITEM,
    LeaseApi,
)
from kopf_reconcile.leader.kubernetes.connection import names_kind as _names_kind
from kopf_reconcile.leader.kubernetes.lease_record import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    MAX_EPOCH,
    RELEASED_LEASE_SECONDS,
    Lease,
    format_micro_time,
    lease_duration_seconds,
)
from kopf_reconcile.leader.kubernetes.lease_record import labels as _labels
from kopf_reconcile.leader.kubernetes.lease_record import lease_record as _record
from kopf_reconcile.leader.kubernetes.lease_record import spec as _spec
from kopf_reconcile.leader.kubernetes.lease_record import transitions as _transitions
from kopf_reconcile.leader.kubernetes.release_watch import ReleaseWatch
from kopf_reconcile.leader.protocol import (
    LeaseContended,
    LeaseEpochExhausted,
    LeaseLost,
    LeaseRecord,
    LeaseToken,
    LeaseTTL,
)
from kopf_reconcile.leader.timing import DEFAULT_LEASE_TTL, loop_time

__all__ = ["KubernetesLeaseElector"]

logger = logging.getLogger("kopf_reconcile.leader")

# A Lease deleted between our read and our write is read again this many times.
_ACQUIRE_READS = 3
# After a 409, renew and release read the Lease again and retry once if it is still ours.
_OWN_WRITE_ATTEMPTS = 2


def _wall_clock() -> datetime.datetime:
    """Now, for the informational ``acquireTime``/``renewTime`` fields and the token."""
    return datetime.datetime.now(datetime.UTC)


@dataclasses.dataclass
class _Observation:
    """The last Lease record seen, and when (the event loop's clock) it was first seen."""

    lease: Lease
    record: tuple[str, str, str]  # holderIdentity, renewTime, resourceVersion
    at: float


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
        if api is not None and kubeconfig is not None:
            raise ConfigError(
                f"give either api (a client) or kubeconfig (a file to make one from), not both; "
                f"got api={api!r} and kubeconfig={kubeconfig!r}"
            )
        self._ttl = ttl if isinstance(ttl, LeaseTTL) else LeaseTTL(ttl)
        self._duration = lease_duration_seconds(self._ttl)
        self._holder_id = checked_holder_id(holder_id)
        self._leases = LeaseApi(
            self,
            namespace or os.environ.get("POD_NAMESPACE") or None,
            api,
            os.fspath(kubeconfig) if kubeconfig is not None else None,
            timeout=self._ttl.seconds,
        )
        self._release_watch = ReleaseWatch(self._leases, self._duration, self._ttl.seconds)
        self._observed: dict[str, _Observation] = {}
        self._epochs = EpochMemory()
        # The epoch this elector holds or last held per lease (set before writing it,
        # so a takeover whose answer was lost is still recognised as ours).
        self._held: dict[str, int] = {}

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
        return self._leases.namespace

    async def lease_namespace(self) -> str:
        """Where the Leases live, resolved from the configuration if need be."""
        return await self._leases.resolved_namespace()

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
        for it (:mod:`~kopf_reconcile.leader.kubernetes.release_watch`: how, and what
        a failed watch does). Returns at once when that read found no holder, or
        found nothing. Cancelling the wait closes the HTTP response.
        """
        observed = self._observed.get(reconciler_id)
        if observed is None or not observed.record[0]:
            return
        holder, version = observed.record[0], observed.record[2]
        await self._release_watch.wait(reconciler_id, holder, version)

    # -- startup check ----------------------------------------------------------------

    async def list_leases(self, *, all_namespaces: bool = False) -> list[LeaseRecord]:
        """The kopf-reconcile Leases (by their managed-by label) of the namespace, or of all.

        The client and the namespace are this elector's own (see the class docstring).
        """
        api = await self._leases.client()
        if all_namespaces:
            path, where = ALL_NAMESPACES, {}
        else:
            path, where = COLLECTION, {"namespace": await self._leases.resolved_namespace()}
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
        namespace = await self._leases.resolved_namespace()
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "kopf-reconcile-namespace-check", "namespace": namespace},
            "spec": {},
        }
        try:
            await self._leases.request("POST", COLLECTION, "", body, query=[("dryRun", "All")])
        except ApiException as exc:
            if exc.status == 404 and _names_kind(exc.body, "namespaces"):
                raise ConfigError(
                    f"{source} names namespace {namespace!r}, which does not exist in the "
                    "cluster: the Leases of leader election cannot be created there"
                ) from None

    # -- lifecycle -----------------------------------------------------------------

    async def close(self) -> None:
        """Close the API client if this elector created it (a borrowed one stays open)."""
        await self._leases.close()

    def __repr__(self) -> str:
        return (
            f"<KubernetesLeaseElector holder={self._holder_id!r} "
            f"namespace={self._leases.namespace!r} ttl={self._duration}s>"
        )

    # -- the Lease, over HTTP -------------------------------------------------------

    async def _read(self, reconciler_id: str) -> Lease | None:
        """GET the Lease and record the observation; ``None`` when it does not exist."""
        try:
            lease = await self._leases.request("GET", ITEM, reconciler_id)
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
        namespace = await self._leases.resolved_namespace()
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
            created = await self._leases.request("POST", COLLECTION, reconciler_id, body)
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
        written = await self._leases.request("PUT", ITEM, reconciler_id, body)
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
            self._observed[reconciler_id] = _Observation(lease, record, loop_time())
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
        delete = f"kubectl delete lease -n {self._leases.namespace} {reconciler_id}"
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
        return observed.at + float(duration) - loop_time()

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
        return self._leases.where(reconciler_id)
