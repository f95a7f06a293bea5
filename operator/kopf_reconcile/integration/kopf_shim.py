"""The kopf shim: ``@kopf_reconcile.reconciler`` runs a reconcile Loop inside a kopf operator.

(Over 400 lines on purpose: the decorator, the kopf handlers of a registration and the
coordinated shutdown share one registry of reconcilers.)

The decorator registers four handlers on kopf's registry for one reconciler:

* a **startup** handler, which builds the Loop (its leader elector and fenced
  repository come from the decorator's arguments or, by default, from the
  process settings: see :mod:`kopf_reconcile.integration.settings`) and starts it inside
  kopf's event loop. The Loop lives as long as the operator: kopf cancels
  tasks it finds still running after it stops, so the cleanup handler, not
  garbage collection, ends it;
* a stateless **on.event** handler: for every watch event, the initial
  listing and DELETED included, it stores the body in the reconciler's
  :class:`~kopf_reconcile.cache.ObjectCache` and enqueues ``<namespace>/<name>``
  (``<name>`` for cluster-scoped objects). It never writes to the object: no
  kopf progress annotations, no finalizers (a reconciler with ``finalizer=`` gets its
  one finalizer added and removed by the leader's reconciles, see below), so any
  number of replicas can watch the same objects, and the reconciler reads the body with
  :func:`kopf_reconcile.cached`. The handler makes kopf watch the resource; the
  events themselves reach the cache straight from kopf's watch stream (see
  "Watch streams" below), and the handler then does nothing;
* a **cleanup** handler, which stops the Loop (draining in-flight reconciles
  and releasing the lease so a peer takes over at once) and closes what the
  startup handler created. kopf runs cleanup handlers one after another, so
  the first one of a registry begins the stop of every Loop in it at once:
  the operator stops within one stop timeout, not one per reconciler. The
  shim's cleanup handlers run before every other one of the registry, wherever
  those are written: a user's ``@kopf.on.cleanup`` (closing a pool the
  reconciler uses) runs once every Loop has stopped and released its lease;
* a **probe** (kopf's liveness endpoint) reporting leadership, epoch and queue.

Events. The leader's Loop records Kubernetes Events on the objects (a failed
reconcile, a dead letter, a recovery, and the reconciler's own ``kr.event``) through
:class:`~kopf_reconcile.integration.events.KubernetesEventSink`, which takes the
object's apiVersion, kind and uid from the cache; Events are separate objects, so the
objects themselves are still never written (``events=False`` turns them off).

Replicas. Every replica watches (a warm standby: its cache is current when it
takes over); only the holder of the reconciler's lease dispatches. kopf's own
peering is not leader election (no atomic acquisition, equal priorities
freeze every replica), so the shim switches kopf to standalone mode unless
peering was asked for explicitly (``kopf run --peering=...`` or
``settings.peering.mandatory = True``). Several reconcilers in one operator
each have their own Loop, cache and lease.

Resyncs. A success without ``requeue_after`` leaves nothing behind in the
Loop: per-entity state stays bounded by the live objects, and a deleted
object, once reconciled, is forgotten. Every ``interval`` (like
controller-runtime's SyncPeriod) and whenever a replica becomes the leader,
the resync-all request re-enqueues every object in the cache; the reconciler
itself never sees that request.

``labels`` and ``field_selector`` select objects on the client side: an object
that stops matching looks deleted to the reconciler (``cached`` returns None),
as a Kubernetes watch with a selector reports it. Only selected objects can
be gone for the reconciler: the deletion of an object it never selected is
not its business and triggers nothing (unless the object carries the reconciler's
finalizer: it is then reconciled as gone to release it, see ``finalizers``).

Watch streams and relists. The shim takes every event of a reconciled resource straight
from kopf's watch stream, in the stream's order, into the caches of the reconcilers of the
operator running it (kopf spends nothing on events it has no other handler for), and reports
objects a relist no longer holds as deleted: :mod:`kopf_reconcile.integration.stream_feed`.
The cache's intake takes a request at once while fewer than the Loop's intake capacity
(100,000 by default) of distinct objects wait, so the stream does not wait on reconciles.
Selection by ``labels`` and ``field_selector``: :mod:`kopf_reconcile.integration.selection`.

Children and finalizers. ``owns=`` and ``watches=`` register an ``on.event`` handler
per related resource too (fed from its watch stream like the reconciled resource's):
its events reconcile their owner (:mod:`kopf_reconcile.integration.related`).
``finalizer=`` wraps each reconcile: the finalizer is added before an object's first
reconcile and removed, lease-checked, after a successful cleanup of the deleting object
(:mod:`kopf_reconcile.integration.finalizers`).

Reconciler ids. By default a reconciler's id (its lease name and fenced
scope) is derived from the resource and the function's name,
``<plural>.<group>-<function>``; a function named only ``reconcile`` (or
another name that says nothing of its purpose) needs an explicit
``reconciler_id`` when a leader is configured (see :mod:`kopf_reconcile.integration.naming`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import functools
import inspect
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias, TypeVar

import kopf

from kopf_reconcile.api import (
    RESYNC_ALL,
    ConfigError,
    Duration,
    ReconcileFn,
    Request,
    as_reconcile_fn,
    seconds,
)
from kopf_reconcile.builder import Builder
from kopf_reconcile.cache import ObjectCache, Transform, serving, strip_managed_fields
from kopf_reconcile.config import DEFAULT_INTERVAL, LoopConfig, validate_name
from kopf_reconcile.fencing.protocol import FencedRepository
from kopf_reconcile.integration import kopf_internals
from kopf_reconcile.integration import settings as process_settings
from kopf_reconcile.integration.api_client import SharedApiClient, shared_api_client
from kopf_reconcile.integration.events import KubernetesEventSink
from kopf_reconcile.integration.fence_lease import LeaseFence
from kopf_reconcile.integration.fenced_client import ClientContext, serving_client
from kopf_reconcile.integration.finalizers import FinalizerWriter, Finalizing, finalizer_name
from kopf_reconcile.integration.kopf_internals import match_namespace
from kopf_reconcile.integration.logs import EVENT_HANDLER_PREFIX, install_quiet_event_handlers
from kopf_reconcile.integration.naming import derived_reconciler_id, is_generic_name
from kopf_reconcile.integration.related import (
    Owns,
    Related,
    RelatedObjects,
    Watches,
    parse_related,
    serving_related,
)
from kopf_reconcile.integration.selection import Selection
from kopf_reconcile.integration.shard_watch import ShardWatch
from kopf_reconcile.integration.stream_feed import Feeder, install_stream_feed
from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector, kubeconfig_namespace
from kopf_reconcile.leader.protocol import LeaderElector
from kopf_reconcile.loop import Loop
from kopf_reconcile.metrics import Metrics, register_metrics
from kopf_reconcile.sharded_loop import ShardedLoop
from kopf_reconcile.sharding import ShardAssignment, shard_id, validate_shards
from kopf_reconcile.tenancy import Tenancy
from kopf_reconcile.triggers import TickerTrigger

__all__ = [
    "FROM_SETTINGS",
    "check_reconciler_ids",
    "match_namespace",  # kopf's, for readiness to watch what kopf watches
    "reconciler",
    "status",
]

logger = logging.getLogger("kopf_reconcile.kopf")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class _FromSettings(enum.Enum):
    FROM_SETTINGS = "from settings"


FROM_SETTINGS = _FromSettings.FROM_SETTINGS
"""Default of ``leader=`` and ``fenced=``: build them from the process settings at startup."""

LeaderOption: TypeAlias = LeaderElector | Callable[[], Any] | _FromSettings | None
FencedOption: TypeAlias = FencedRepository | Callable[[], Any] | _FromSettings | None


@functools.cache
def _default_metrics() -> Metrics:
    """The instruments on prometheus-client's default registry, created once per process."""
    return register_metrics()


@dataclasses.dataclass
class _Options:
    """What the decorator was given, checked at decoration time."""

    group: str
    version: str
    plural: str
    tenancy: Tenancy
    concurrency: int
    interval: float
    backoff: tuple[float, float] | None
    renew_interval: float | None
    leader: LeaderOption
    fenced: FencedOption
    metrics: Metrics | _FromSettings | None
    name: str
    reconciler_id: str
    selection: Selection
    cache_transform: Transform | None = strip_managed_fields
    generation_changed: bool = False
    ambiguous: bool = False  # a default id that names only the resource (see naming)
    events: bool = True  # Kubernetes Events on the objects (see integration.events)
    # One lease per shard (see sharded_loop); one shard: not sharded.
    shards: ShardAssignment = dataclasses.field(default_factory=lambda: ShardAssignment(1))
    watch_all_shards: bool = False  # by namespace: every replica watches every shard
    related: tuple[Related, ...] = ()  # owned and watched resources (see related)
    finalizer: str | None = None  # the finalizer's name (see finalizers)


class _Registration:
    """One decorated reconciler: its kopf handlers and, between startup and cleanup, its Loop."""

    def __init__(self, fn: ReconcileFn, options: _Options, registry: Any) -> None:
        self.fn = fn
        self.options = options
        self.registry = registry
        self.loop: Loop | None = None
        self.cache: ObjectCache | None = None
        self.related: RelatedObjects | None = None
        self.finalizing: Finalizing | None = None
        self.client_context: ClientContext | None = None
        self._owned: list[object] = []  # electors/repositories built here, closed at cleanup
        self._stopping: asyncio.Task[None] | None = None  # the stop begun by a cleanup
        # The kopf settings of the operator that started this reconciler: its watch
        # streams feed this reconciler directly (see kopf_reconcile.integration.stream_feed).
        self.settings: object | None = None
        # kopf watch streams that feed it now, per (group, plural) they watch.
        self.feeding_streams: collections.Counter[tuple[str, str]] = collections.Counter()
        # Sharded by namespace ranges: its streams carry only the shards it leads.
        self.shard_watch: ShardWatch | None = None

    @property
    def reconciler_id(self) -> str:
        return self.options.reconciler_id

    def register(self) -> None:
        o = self.options
        prefix = f"{EVENT_HANDLER_PREFIX}{o.reconciler_id}"
        permanent = kopf.ErrorsMode.PERMANENT
        reg = self.registry
        kopf.on.startup(id=f"{prefix}/startup", errors=permanent, registry=reg)(self.startup)
        kopf.on.cleanup(id=f"{prefix}/cleanup", registry=reg)(self.cleanup)
        _first_among_cleanups(reg, f"{prefix}/cleanup")
        # A probe that raises would make kopf's liveness endpoint hang: never retry it.
        kopf.on.probe(id=prefix, errors=permanent, registry=reg)(self.probe)
        watched: list[tuple[str, str, str, str, Callable[..., Any]]] = [
            (o.group, o.version, o.plural, "events", self.on_kopf_event)
        ]
        for r in o.related:
            on_related = functools.partial(self.on_kopf_related_event, r.key)
            watched.append(
                (r.group, r.version, r.plural, f"related/{r.plural}.{r.group}", on_related)
            )
        for group, version, plural, suffix, handler in watched:
            kopf.on.event(
                group=group or None,
                version=version,
                plural=plural,
                id=f"{prefix}/{suffix}",
                registry=reg,
            )(handler)

    # -- kopf handlers -----------------------------------------------------------------

    async def startup(self, settings: kopf.OperatorSettings, **_: Any) -> None:
        self._stopping = None  # a registry may run an operator again
        self.settings = None
        config = process_settings.current()
        _standalone_unless_peering(settings)
        _paged_lists(settings)
        o = self.options
        try:
            elector = await self._resolve("leader", o.leader, config.build_elector)
            if elector is not None:
                self.check_unambiguous()
            repository: FencedRepository | None = None
            if elector is not None or o.fenced is not FROM_SETTINGS:
                repository = await self._resolve("fenced", o.fenced, config.build_fenced_repository)
            if elector is not None and o.shards.server_selectable and not o.watch_all_shards:
                self.shard_watch = ShardWatch(o.reconciler_id, o.shards).follow_leadership()
                self._owned.append(self.shard_watch)
            cache = ObjectCache(transform=o.cache_transform)
            related = RelatedObjects(o.related, o.cache_transform)
            api = shared_api_client()
            self._owned.append(api)
            fence = None
            if elector is not None and config.api_fence is process_settings.ApiFence.ON:
                fence = _lease_fence(elector, api, config)
                leases = {o.reconciler_id}
                leases |= {shard_id(o.reconciler_id, k) for k in range(o.shards.shards)}
                self._owned.append(fence.watch_leadership(leases.__contains__))
            client_context = ClientContext(
                api,
                field_manager=o.reconciler_id,
                fence=fence,
                caches={(o.group, o.plural): cache, **related.caches},
            )
            if o.finalizer is not None:
                writer = FinalizerWriter(
                    o.finalizer, o.group, o.version, o.plural, shared=shared_api_client()
                )
                self._owned.append(writer)
                self.finalizing = Finalizing(writer)
            builder = (
                Builder(self.reconcile, o.tenancy)
                .with_trigger(cache)
                .with_trigger(TickerTrigger(o.interval))  # the periodic resync-all
                .with_name(o.name)
                .with_reconciler_id(o.reconciler_id)
                .with_concurrency(o.concurrency)
                .without_default_requeue()  # forgotten after success; resyncs come from above
            )
            if o.backoff is not None:
                builder.with_backoff(*o.backoff)
            if o.shards.shards > 1:
                builder.with_shards(o.shards.shards, by_namespace=o.shards.by_namespace)
            if elector is not None:
                builder.with_leader(elector).with_renew_interval(
                    config.renew_interval if o.renew_interval is None else o.renew_interval
                )
            if repository is not None:
                builder.with_fenced_repo(repository)
            metrics = _default_metrics() if o.metrics is FROM_SETTINGS else o.metrics
            if metrics is not None:
                builder.with_metrics(metrics)
            if config.stop_timeout is not None:
                builder.with_stop_timeout(config.stop_timeout)
            if o.events:
                sink = KubernetesEventSink(
                    cache.get, instance=config.pod_name, shared=shared_api_client()
                )
                self._owned.append(sink)
                builder.with_events(sink)
            loop = builder.build()
            self.cache = cache
            self.related = related
            self.client_context = client_context
            await loop.start()
            self.loop = loop
            self.settings = settings  # from now on its watch streams feed the cache
        except BaseException:
            self.cache = self.related = self.finalizing = self.client_context = None
            self.shard_watch = None
            await self._close_owned()
            raise
        logger.info(
            "reconciler %s watches %s: %s",
            o.reconciler_id,
            "/".join(filter(None, (o.group, o.version, o.plural))),
            _describe(elector, repository),
            extra={"controller": o.name},
        )

    async def cleanup(self, **_: Any) -> None:
        # kopf runs cleanup handlers one after another: stopped one by one, N Loops
        # would take N stop timeouts, past a pod's grace period. The first cleanup of
        # a registry stops every Loop of that registry at once; each handler then
        # waits for (and reports the failure of) its own Loop's stop.
        for registration in _registrations:
            if registration.registry is self.registry:
                registration._begin_stop()
        assert self._stopping is not None
        await self._stopping

    def _begin_stop(self) -> None:
        if self._stopping is None:
            self._stopping = asyncio.create_task(
                self._stop(), name=f"stopping reconciler {self.reconciler_id}"
            )

    async def _stop(self) -> None:
        loop, self.loop = self.loop, None
        self.settings = None
        if self.cache is not None:
            # Events during and after the stop are dropped, never left waiting on a Loop
            # that is gone (kopf would wait for the handler forever): the next leader's
            # resync-all, or this replica's initial listing on its next start, covers them.
            self.cache.close()
        try:
            if loop is not None:
                await loop.stop()
        finally:
            self.cache = self.related = self.finalizing = self.client_context = None
            await self._close_owned()

    async def probe(self, **_: Any) -> dict[str, object]:
        return self.status()

    async def on_kopf_event(self, event: Mapping[str, Any], **_: Any) -> None:
        """kopf's on.event handler: only for events its watch stream did not deliver."""
        if not self.feeding_streams[(self.options.group, self.options.plural)]:
            await self.on_event(event)

    async def on_kopf_related_event(
        self, key: tuple[str, str], event: Mapping[str, Any], **_: Any
    ) -> None:
        """kopf's on.event handler of a related resource (as :meth:`on_kopf_event`)."""
        if not self.feeding_streams[key]:
            await self.on_related_event(key, event)

    async def on_related_event(self, key: tuple[str, str], event: Mapping[str, Any]) -> None:
        """One watch event of an owned or watched resource: requests for its owners."""
        cache, related = self.cache, self.related
        if cache is not None and related is not None:
            await related.on_event(key, event, cache)

    async def on_event(self, event: Mapping[str, Any], **_: Any) -> None:
        """One watch event: store (or drop) the body in the cache, request a reconcile."""
        cache = self.cache
        body = event.get("object")
        if cache is None or not isinstance(body, Mapping):
            return
        metadata = body.get("metadata") or {}
        name, namespace = metadata.get("name"), metadata.get("namespace")
        if not name:
            return
        entity_id = f"{namespace}/{name}" if namespace else str(name)
        deleted = event.get("type") == "DELETED"
        selected = not deleted and self.options.selection.matches(body)
        # Outside the selection yet carrying the finalizer: reconciled as gone to release it.
        release = self.finalizing is not None and self.finalizing.observe(
            entity_id, body, deleted=deleted, selected=selected
        )
        if deleted:
            await cache.remove(entity_id, body)  # only what was selected is gone for the reconciler
        elif selected:
            await cache.update(
                entity_id,
                body,
                skip_same_generation=self.options.generation_changed
                and event.get("type") == "MODIFIED",
            )
        else:  # this incarnation left the selection: to the reconciler it is gone
            held = entity_id in cache
            await cache.forget(entity_id, body)  # (not deleted: it may match again)
            if release and not held:
                await cache.request(entity_id)

    async def release(self, body: Mapping[str, Any]) -> None:
        """The object left the shards this replica's stream carries: forget it, silently."""
        cache = self.cache
        metadata = body.get("metadata") or {}
        name, namespace = metadata.get("name"), metadata.get("namespace")
        if cache is not None and name:
            cache.release(f"{namespace}/{name}" if namespace else str(name), body)

    def watches(self, key: tuple[str, str], version: str | None = None) -> bool:
        """Whether this reconciler watches resource ``key`` (at ``version``, when given)."""
        o = self.options
        versions = [o.version] if key == (o.group, o.plural) else []
        versions += [r.version for r in o.related if r.key == key]
        return bool(versions) and (version is None or version in versions)

    def reconciles(self, key: tuple[str, str]) -> bool:
        """Whether ``key`` is the resource this reconciler reconciles (not a related one)."""
        return key == (self.options.group, self.options.plural)

    def maps(self, key: tuple[str, str]) -> bool:
        """Whether a ``watches=`` entry of this reconciler maps resource ``key``'s objects."""
        return any(r.key == key and r.map_to is not None for r in self.options.related)

    def feeder(self, key: tuple[str, str]) -> Feeder:
        """What takes the events of resource ``key``'s watch stream for this reconciler."""
        if self.reconciles(key):
            return self.reconciler_id, self.on_event
        return self.reconciler_id, functools.partial(self.on_related_event, key)

    # -- the reconcile the Loop calls ----------------------------------------------------

    async def reconcile(self, req: Request) -> object:
        cache, related, client = self.cache, self.related, self.client_context
        if cache is None or related is None or client is None:  # stopped meanwhile
            return None
        if req.entity_id == RESYNC_ALL:
            cache.request_resync()
            return None
        if self.shard_watch is not None:
            # Not before this replica's cache holds the shard (listed after a takeover): an
            # object not listed yet must not look deleted.
            await self.shard_watch.until_covered(self.options.shards.shard_of(req.entity_id))
        with serving(cache), serving_related(related, cache), serving_client(client):
            if self.finalizing is None:
                return await self.fn(req)  # the Loop checks what it returns
            return await self.finalizing.reconcile(
                cache.get(req.entity_id), req.entity_id, functools.partial(self.fn, req)
            )

    # -- helpers -------------------------------------------------------------------------

    def check_unambiguous(self) -> None:
        """With a leader, refuse a default id that another operator could share unknowingly."""
        o = self.options
        if not o.ambiguous:
            return
        resource = f"{o.plural}.{o.group}" if o.group else o.plural
        raise ConfigError(
            f"reconciler {o.name!r} of {resource} needs reconciler_id= when a leader is "
            f"configured: its name says only that it reconciles, so its default lease "
            f"{o.reconciler_id!r} would be shared by any other operator reconciling {resource} "
            f"in that namespace, and only one of them would ever reconcile. Pass "
            f"reconciler_id='<operator>-<purpose>' (unique per lease namespace and database), "
            f"or give the function (or name=) a name that says what it is for"
        )

    def status(self) -> dict[str, object]:
        loop = self.loop
        if loop is None:
            return {"running": False}
        stats = loop.stats()
        status: dict[str, object] = {
            "running": True,
            "leader": stats.is_leader,
            "epoch": stats.epoch,
            "queued": stats.queued,
            "in_flight": stats.in_flight,
            "dead_letters": stats.dead_letters,
            "cached_objects": 0 if self.cache is None else len(self.cache),
        }
        if isinstance(loop, ShardedLoop):  # the shards this replica leads, and at which epoch
            status["shards"] = {
                str(k): s.epoch for k, s in loop.shard_stats().items() if s.is_leader
            }
        return status

    async def _resolve(
        self, option: str, value: object, from_settings: Callable[[], T | None]
    ) -> Any:
        """An elector/repository: given, built by the user's factory, or from the settings."""
        if value is None:
            return None
        if value is FROM_SETTINGS:
            built: object = from_settings()
        elif _is_adapter(option, value):
            return value  # the caller's object: the caller closes it
        elif callable(value):
            built = value()
            if inspect.isawaitable(built):
                built = await built
        else:
            raise ConfigError(
                f"{option} must be an adapter object, a factory returning one, or None; "
                f"got {value!r}"
            )
        if built is not None:
            self._owned.append(built)
            if not _is_adapter(option, built):
                raise ConfigError(f"{option} factory returned {built!r}, not a {option} adapter")
        return built

    async def _close_owned(self) -> None:
        owned, self._owned = self._owned, []
        for adapter in owned:
            close = getattr(adapter, "close", None)
            if not callable(close):
                continue
            try:
                result = close()
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:
                logger.warning("closing %r failed: %r", adapter, exc)


def _lease_fence(
    elector: LeaderElector, api: SharedApiClient, config: process_settings.Settings
) -> LeaseFence:
    """How the reconciler's API writes name their lease: the elector's own Lease, or (for
    any other elector) a Lease of the same name that mirrors its epoch."""
    if isinstance(elector, KubernetesLeaseElector):
        return LeaseFence(api, elector.lease_namespace)

    async def namespace() -> str:
        return config.pod_namespace or kubeconfig_namespace() or "default"

    return LeaseFence(api, namespace, mirror_ttl_seconds=math.ceil(config.lease_ttl.seconds))


def _first_among_cleanups(registry: Any, handler_id: str) -> None:
    """Run this cleanup handler before every other one of the registry, wherever they are.

    kopf runs cleanup handlers one after another, in the order they were registered. A
    user's ``@kopf.on.cleanup`` written above the reconciler (closing a pool or a client the
    reconciler uses) would otherwise run while its Loop still reconciles and holds the lease.
    """
    handlers = kopf_internals.activity_handlers(registry)
    if handlers is None:  # pragma: no cover - another kopf layout
        logger.warning(
            "this kopf version's registry cannot be ordered: cleanup handlers registered "
            "before a reconciler run before its Loop stops"
        )
        return
    handlers.sort(key=lambda handler: getattr(handler, "id", None) != handler_id)  # stable


_ADAPTER_METHODS = {
    "leader": ("acquire_lease", "renew_lease", "release_lease"),
    "fenced": ("apply_fenced",),
}


def _is_adapter(option: str, value: object) -> bool:
    return all(callable(getattr(value, m, None)) for m in _ADAPTER_METHODS[option])


def _describe(elector: object, repository: object) -> str:
    leadership = "single-process (always leader, epoch 0)" if elector is None else f"{elector!r}"
    fencing = "no fenced writes" if repository is None else f"fenced writes to {repository!r}"
    return f"leadership {leadership}, {fencing}"


def _standalone_unless_peering(settings: kopf.OperatorSettings) -> None:
    """kopf peering freezes equal-priority replicas; leadership is the shim's business."""
    peering = settings.peering
    if peering.mandatory or peering.standalone:
        return
    peering.standalone = True
    logger.info(
        "kopf peering is off (standalone): kopf-reconcile leases decide who reconciles; "
        "pass --peering to kopf to use peering as well"
    )


# Objects per page of a list, as client-go's reflectors ask (kopf lists whole by default).
LIST_PAGE = 500


def _paged_lists(settings: kopf.OperatorSettings) -> None:
    """List in pages unless the user chose (``settings.watching.chunk_size``): a whole list
    is decoded at once, so it sets the replica's peak memory however few objects it keeps
    (a shard's, when the server does not filter), and one page of it is enough."""
    if settings.watching.chunk_size is None:
        settings.watching.chunk_size = LIST_PAGE


_registrations: list[_Registration] = []


def reconciler(
    group: str,
    version: str,
    plural: str,
    *,
    tenancy: Tenancy,
    concurrency: int = 1,
    interval: Duration = DEFAULT_INTERVAL,
    backoff: tuple[Duration, Duration] | None = None,
    leader: LeaderOption = FROM_SETTINGS,
    fenced: FencedOption = FROM_SETTINGS,
    metrics: Metrics | _FromSettings | None = FROM_SETTINGS,
    events: bool = True,
    name: str | None = None,
    reconciler_id: str | None = None,
    renew_interval: Duration | None = None,
    labels: Mapping[str, str] | None = None,
    field_selector: str | None = None,
    cache_transform: Transform | None = strip_managed_fields,
    generation_changed: bool = False,
    shards: int = 1,
    shard_by_namespace: bool = False,
    watch_all_shards: bool = False,
    owns: Iterable[Owns | tuple[str, str, str]] | None = None,
    watches: Iterable[Watches] | None = None,
    finalizer: bool | str | None = None,
    registry: Any = None,
) -> Callable[[F], F]:
    """Register the decorated reconciler for ``group/version/plural`` objects with kopf.

    * ``tenancy``: required; the entity ids are ``<namespace>/<name>`` (TENANT_SCOPED
      shape) for namespaced objects and ``<name>`` for cluster-scoped ones (which
      therefore need SINGLE_TENANT).
    * ``concurrency``: reconciles of distinct objects at once (default 1).
    * ``interval``: every this long, every live object is reconciled again (default
      10 h, controller-runtime's SyncPeriod); ``Result(requeue_after=...)`` asks for one
      object sooner.
    * ``backoff``: ``(base, max)`` of the per-object retry delay, drawn from
      ``[0, min(max, base·2ⁿ⁻¹)]`` after the n-th failure in a row (default 5 ms, 1000 s).
    * ``leader``, ``fenced``: a ``LeaderElector`` / ``FencedRepository``, a factory
      (sync or async, called at startup inside kopf's event loop) returning one, or
      None (single-process mode / no fencing). By default both come from the
      settings (``KOPF_RECONCILE_LEADER``, ``KOPF_RECONCILE_DATABASE_URL``, ...).
      What the shim builds it also closes; objects you pass stay yours.
    * ``metrics``: instruments from ``register_metrics()``; by default those on
      prometheus-client's default registry; None disables them.
    * ``events``: record Kubernetes Events on the objects (Warning ``ReconcileError``
      and ``DeadLettered``, Normal ``Reconciled`` after a failure, and the
      reconciler's own through ``kr.event``), posted by the leader in the background,
      aggregated and rate-limited (default True; see :mod:`kopf_reconcile.events`).
    * ``name``: controller name in logs (default: the function's name);
      ``reconciler_id``: lease name, fencing scope and metrics' ``controller`` (default:
      ``<plural>.<group>-<name>``, see :mod:`kopf_reconcile.integration.naming`; required with a
      leader when the name says only that it reconciles, such as ``reconcile``).
    * ``renew_interval``: lease renewal period (default: ``KOPF_RECONCILE_RENEW_INTERVAL``).
    * ``labels``: exact label values an object must carry; ``field_selector``: a
      Kubernetes field selector (``metadata.name=x,status.phase!=Done``).
    * ``cache_transform``: applied to every body before the cache keeps it; by default
      :func:`~kopf_reconcile.cache.strip_managed_fields` (drops ``metadata.managedFields``
      and the last-applied annotation); None keeps bodies whole; a callable replaces it.
    * ``generation_changed``: when True, an update that leaves ``metadata.generation``
      unchanged (status, labels, annotations) is cached but triggers no reconcile
      (controller-runtime's GenerationChangedPredicate); creations, deletions and
      resyncs always do. Default False: every change triggers.
    * ``shards``: split the objects into this many shards, each led under a lease of its
      own (``<reconciler_id>-shard-<k>``) and fenced in a scope of its own, so several
      replicas reconcile at once (default 1: one leader; see
      :mod:`kopf_reconcile.sharded_loop`); ``shard_by_namespace``: assign whole
      namespaces to shards instead of single objects: each replica then watches only the
      shards it leads, selected by the API server where it supports KEP-5866 (see
      :mod:`kopf_reconcile.integration.shard_watch`), unless ``watch_all_shards=True``
      (a warm standby of every shard, and deletions seen by followers, for the memory of
      every object in every replica). Needs a leader.
    * ``owns``: child resources (``kr.Owns(group, version, plural, labels=...)`` or a
      ``(group, version, plural)`` tuple): an event of an object whose controller owner
      reference points to a reconciled object reconciles that object; ``kr.owned(req)``
      returns its cached children. ``watches``: ``kr.Watches(group, version, plural,
      map_to)``: an event of such an object reconciles the entity ids ``map_to(body)``
      returns (see :mod:`kopf_reconcile.integration.related`).
    * ``finalizer``: True (named ``<group>/<reconciler_id>``) or a finalizer name: added
      before an object's first reconcile, removed once the reconciler returned without an
      error for the deleting object (see :mod:`kopf_reconcile.integration.finalizers`).
      Default None: no finalizer.
    * ``registry``: a kopf ``OperatorRegistry`` (default: kopf's default registry).
    """
    for option, value in (("version", version), ("plural", plural)):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{option} must be a non-empty string, got {value!r}")
    if not isinstance(group, str):
        raise ConfigError(f"group must be a string ('' for the core API group), got {group!r}")
    checked_backoff = None
    if backoff is not None:
        if not isinstance(backoff, tuple) or len(backoff) != 2:
            raise ConfigError(f"backoff must be a (base, max) pair of durations, got {backoff!r}")
        checked_backoff = (seconds("backoff base", backoff[0]), seconds("backoff max", backoff[1]))
    if metrics is not FROM_SETTINGS and metrics is not None and not isinstance(metrics, Metrics):
        raise ConfigError(f"metrics must come from register_metrics() or be None, got {metrics!r}")
    selection = Selection.parse(labels, field_selector)
    if cache_transform is not None and not callable(cache_transform):
        raise ConfigError(f"cache_transform must be a callable or None, got {cache_transform!r}")
    if not isinstance(generation_changed, bool):
        raise ConfigError(f"generation_changed must be True or False, got {generation_changed!r}")
    assignment = ShardAssignment(validate_shards(shards), shard_by_namespace)
    if not isinstance(watch_all_shards, bool):
        raise ConfigError(f"watch_all_shards must be True or False, got {watch_all_shards!r}")
    related = parse_related(owns, watches, (group, plural))
    if assignment.shards > 1 and leader is None:
        raise ConfigError(
            f"shards={shards} requires a leader: each shard is led under a lease of its own"
        )
    install_quiet_event_handlers()
    install_stream_feed(lambda: _registrations)

    def decorator(fn: F) -> F:
        fn_name, reconcile_fn = as_reconcile_fn(fn)
        controller = validate_name(fn_name if name is None else name)
        rid = (
            derived_reconciler_id(group, plural, controller)
            if reconciler_id is None
            else reconciler_id
        )
        # The rules Builder.build() applies at startup, applied now, at decoration.
        draft = LoopConfig(
            reconciler=reconcile_fn,
            tenancy=tenancy,
            triggers=[],
            concurrency=concurrency,
            interval=seconds("interval", interval),
            name=controller,
            reconciler_id=rid,
        )
        if checked_backoff is not None:
            draft.backoff_base, draft.backoff_max = checked_backoff
        draft.validate()
        real_registry = kopf.get_default_registry() if registry is None else registry
        if any(r.reconciler_id == rid and r.registry is real_registry for r in _registrations):
            raise ConfigError(
                f"reconciler_id {rid!r} is already registered in this operator; give each "
                "reconciler its own reconciler_id (it names its lease and fencing scope)"
            )
        options = _Options(
            group=group,
            version=version,
            plural=plural,
            tenancy=tenancy,
            concurrency=concurrency,
            interval=draft.interval,
            backoff=checked_backoff,
            renew_interval=None
            if renew_interval is None
            else seconds("renew_interval", renew_interval),
            leader=leader,
            fenced=fenced,
            metrics=metrics,
            events=bool(events),
            name=controller,
            reconciler_id=rid,
            selection=selection,
            cache_transform=cache_transform,
            generation_changed=generation_changed,
            ambiguous=reconciler_id is None and is_generic_name(controller),
            shards=assignment,
            watch_all_shards=watch_all_shards,
            related=related,
            finalizer=finalizer_name(finalizer, group, rid),
        )
        shared = [
            r.reconciler_id
            for r in _registrations
            if r.registry is real_registry
            and options.finalizer is not None
            and r.options.finalizer == options.finalizer
            and (r.options.group, r.options.plural) == (group, plural)
        ]
        if shared:
            # Each would take the other's finalizer for its own: the one that does not select
            # an object would clean up after it and remove it, the other add it back, forever.
            raise ConfigError(
                f"finalizer {options.finalizer!r} of reconciler {rid!r} is already the "
                f"finalizer of reconciler {shared[0]!r} on {plural}.{group}: give each "
                "reconciler of a kind its own finalizer name"
            )
        registration = _Registration(reconcile_fn, options, real_registry)
        if leader is not None and leader is not FROM_SETTINGS:
            registration.check_unambiguous()  # a leader is given: refuse it now
        registration.register()
        _registrations.append(registration)
        return fn

    return decorator


def check_reconciler_ids(config: process_settings.Settings, registry: Any = None) -> None:
    """Before kopf starts: refuse ambiguous default ids of reconcilers that will lead.

    The startup handlers check it too; this lets ``kopf-reconcile run`` stop with a
    configuration error before anything runs.
    """
    if config.leader_kind is process_settings.LeaderKind.NONE:
        return
    real_registry = kopf.get_default_registry() if registry is None else registry
    for registration in _registrations:
        if registration.registry is real_registry and registration.options.leader is FROM_SETTINGS:
            registration.check_unambiguous()


def watched_resources(registry: Any = None) -> list[tuple[str, str, str]]:
    """(group, version, plural) of every resource the reconcilers registered on ``registry``
    watch, owned and watched resources included (readiness)."""
    real_registry = kopf.get_default_registry() if registry is None else registry
    resources: list[tuple[str, str, str]] = []
    for r in _registrations:
        if r.registry is real_registry:
            o = r.options
            for resource in [(o.group, o.version, o.plural)] + [
                (x.group, x.version, x.plural) for x in o.related
            ]:
                if resource not in resources:
                    resources.append(resource)
    return resources


def running_loops(registry: Any = None) -> list[Loop]:
    """The Loops of the reconcilers registered on ``registry`` that run now."""
    real_registry = kopf.get_default_registry() if registry is None else registry
    loops = (r.loop for r in _registrations if r.registry is real_registry)
    return [loop for loop in loops if loop is not None]


def status(registry: Any = None) -> dict[str, dict[str, object]]:
    """Per reconciler id: running, leader, epoch and queue figures (for probes and /healthz)."""
    real_registry = kopf.get_default_registry() if registry is None else registry
    return {r.reconciler_id: r.status() for r in _registrations if r.registry is real_registry}
