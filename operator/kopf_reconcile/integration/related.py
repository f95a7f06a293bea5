"""Owned and watched resources: other objects whose changes reconcile an owner.

A reconciler declares them on its decorator, as controller-runtime's builder does with
``Owns()`` and ``Watches(..., EnqueueRequestsFromMapFunc)``:

* ``owns=[kr.Owns("", "v1", "configmaps")]``: its **children**, objects whose
  ``metadata.ownerReferences`` hold a controller reference (``controller: true``) to an
  object the reconciler reconciles. Every event of a child (its creation, change and
  deletion, the initial listing included) becomes a request for its owner. The owner is
  found by the reference's uid among the objects the reconciler holds (its namespace and
  name first, then its name alone for a cluster-scoped owner): a reference to an object
  it never selected, or to an older incarnation of a name, requests nothing.
* ``watches=[kr.Watches("", "v1", "secrets", map_to=fn)]``: any other resource; ``fn``
  receives each object's body (its last one for a deletion) and returns the entity ids
  (or :class:`~kopf_reconcile.Request` objects) it affects. Only entities the reconciler
  holds are requested: the deletion of an owner is reconciled by the owner's own event.

Requests from children go through the same queue as the owner's own events, so they
are deduplicated with every other trigger (a burst of child events for one owner is one
reconcile, or one re-run after the running one), and they are fresh triggers (a change:
they revive a dead letter).

``labels={...}`` on either selects the related objects on the client side: a child
without those labels (or without a controller reference) is neither cached nor requests
anything, so a cluster's other ConfigMaps cost a comparison each, no memory. (The watch
itself still lists and streams every object of the resource in the watched namespaces:
kopf watches without a label selector.)

Children are cached with the reconciler's cache transform, indexed by their owner's
uid: inside a reconcile, :func:`owned` returns the cached children of the object
being reconciled (private copies, the current incarnation's only). Watched objects are
not cached: their events only map to requests.

RBAC: the operator lists and watches every related resource; a reconciler that creates
its children also needs ``create`` (and usually ``update``, ``patch``, ``delete``) on them.
The chart's ``children`` value grants both (see ``templates/rbac.yaml``).
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kopf_reconcile.api import ConfigError, Request
from kopf_reconcile.cache import ObjectCache, Transform

__all__ = ["Owns", "RelatedObjects", "Watches", "owned", "parse_related", "serving_related"]

Body = dict[str, Any]
MapTo = Callable[[Mapping[str, Any]], Iterable[str | Request]]


@dataclasses.dataclass(frozen=True)
class _Resource:
    """A resource of related objects; ``labels``: the ones that count."""

    group: str
    version: str
    plural: str
    labels: Mapping[str, str] | None = dataclasses.field(default=None, kw_only=True)


@dataclasses.dataclass(frozen=True)
class Owns(_Resource):
    """Children of a reconciled object: ``group/version/plural`` objects it controls."""


@dataclasses.dataclass(frozen=True)
class Watches(_Resource):
    """Objects of ``group/version/plural`` whose changes reconcile what ``map_to`` returns."""

    map_to: MapTo


@dataclasses.dataclass(frozen=True)
class Related:
    """One declared related resource, checked."""

    group: str
    version: str
    plural: str
    labels: Mapping[str, str]
    map_to: MapTo | None  # None: its objects reconcile their controller owner

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    def matches(self, body: Mapping[str, Any]) -> bool:
        present = (body.get("metadata") or {}).get("labels") or {}
        return all(present.get(k) == v for k, v in self.labels.items())


def parse_related(
    owns: Iterable[Owns | tuple[str, str, str]] | None,
    watches: Iterable[Watches] | None,
    owner: tuple[str, str],
) -> tuple[Related, ...]:
    """The decorator's ``owns=`` and ``watches=``, checked (a ConfigError names the bad one)."""
    related: list[Related] = []
    for entry in _listed("owns", owns):
        item = Owns(*entry) if isinstance(entry, tuple) and len(entry) == 3 else entry
        if not isinstance(item, Owns):
            raise ConfigError(
                f"owns entries must be kr.Owns(group, version, plural) or a "
                f"(group, version, plural) tuple, got {item!r}"
            )
        related.append(_checked("owns", item.group, item.version, item.plural, labels=item.labels))
    for item in _listed("watches", watches):
        if not isinstance(item, Watches):
            raise ConfigError(
                f"watches entries must be kr.Watches(group, version, plural, map_to), got {item!r}"
            )
        if not callable(item.map_to):
            raise ConfigError(f"watches map_to must be a callable, got {item.map_to!r}")
        related.append(
            _checked(
                "watches",
                item.group,
                item.version,
                item.plural,
                labels=item.labels,
                map_to=item.map_to,
            )
        )
    keys = [r.key for r in related]
    for key in keys:
        if key == owner:
            raise ConfigError(
                f"owns/watches name the reconciled resource itself ({_resource(key)}): its "
                "own events reconcile it already"
            )
        if keys.count(key) > 1:
            raise ConfigError(f"owns/watches name {_resource(key)} more than once")
    return tuple(related)


def _listed(option: str, value: object) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise ConfigError(f"{option} must be a list, got {value!r}")
    return list(value)


def _checked(
    option: str,
    group: object,
    version: object,
    plural: object,
    *,
    labels: object,
    map_to: MapTo | None = None,
) -> Related:
    if not isinstance(group, str):
        raise ConfigError(f"{option} group must be a string ('' for the core group), got {group!r}")
    for what, value in (("version", version), ("plural", plural)):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{option} {what} must be a non-empty string, got {value!r}")
    if labels is not None and (
        not isinstance(labels, Mapping)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
    ):
        raise ConfigError(f"{option} labels must map label names to values, got {labels!r}")
    assert isinstance(version, str) and isinstance(plural, str)
    return Related(group, version, plural, dict(labels or {}), map_to)


def _resource(key: tuple[str, str]) -> str:
    group, plural = key
    return f"{plural}.{group}" if group else plural


def controller_uid(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """The (name, uid) of the object's controller owner reference, if it has one."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            name, uid = ref.get("name"), ref.get("uid")
            if isinstance(name, str) and isinstance(uid, str):
                return name, uid
    return None


def _entity_id(body: Mapping[str, Any]) -> str | None:
    metadata = body.get("metadata") or {}
    name, namespace = metadata.get("name"), metadata.get("namespace")
    if not name:
        return None
    return f"{namespace}/{name}" if namespace else str(name)


class RelatedObjects:
    """The related resources of one reconciler: the children cached, events mapped to owners."""

    def __init__(self, related: Iterable[Related], transform: Transform | None) -> None:
        self._related = {r.key: r for r in related}
        # Children only: per owned resource, its cache and its index by owner entity id.
        self._children = {
            key: ObjectCache(transform=transform)
            for key, r in self._related.items()
            if r.map_to is None
        }
        # Per owned resource: owner uid -> its children's entity ids, and back.
        self._by_owner: dict[tuple[str, str], dict[str, set[str]]] = {
            key: {} for key in self._children
        }
        self._owner_of: dict[tuple[str, str], dict[str, str]] = {k: {} for k in self._children}

    def __len__(self) -> int:
        return sum(len(cache) for cache in self._children.values())

    @property
    def caches(self) -> Mapping[tuple[str, str], ObjectCache]:
        """The children's cache of each owned resource, by (group, plural)."""
        return self._children

    async def on_event(
        self, key: tuple[str, str], event: Mapping[str, Any], owners: ObjectCache
    ) -> None:
        """One watch event of a related resource: cache a child, request its owners."""
        related = self._related.get(key)
        body = event.get("object")
        if related is None or not isinstance(body, Mapping):
            return
        entity_id = _entity_id(body)
        if entity_id is None:
            return
        selected = related.matches(body)
        if related.map_to is None:
            targets = self._child_event(key, entity_id, event, selected=selected, owners=owners)
        elif selected:
            targets = _mapped(related.map_to, body)
        else:
            targets = []
        for target in targets:
            if target in owners:  # only objects the reconciler holds
                await owners.request(target)

    def _child_event(
        self,
        key: tuple[str, str],
        entity_id: str,
        event: Mapping[str, Any],
        *,
        selected: bool,
        owners: ObjectCache,
    ) -> list[str]:
        body = event["object"]
        cache = self._children[key]
        held = entity_id in cache
        before = cache.get(entity_id) if held else None  # names the owner it had
        if event.get("type") == "DELETED" and held:
            # A deletion a relist swept may carry the identity only: the cached body
            # still names the owner (and the labels that selected it).
            body = cache.get(entity_id) or body
        reference = controller_uid(body)
        selected = selected and reference is not None  # no controller: nobody's child
        if event.get("type") == "DELETED":
            cache.drop(entity_id, body)
            self._index(key, entity_id, None)
        elif selected:
            cache.keep(entity_id, body)
            self._index(key, entity_id, None if reference is None else reference[1])
        else:  # outside the selection (it may match again: not marked deleted)
            cache.drop(entity_id, None)
            self._index(key, entity_id, None)
        targets = []
        if reference is not None and (selected or held):  # else: not the owner's business
            owner = _held_owner(body, reference, owners)
            targets += [] if owner is None else [owner]
        previous = None if before is None else controller_uid(before)
        if previous is not None and previous != reference:
            # Its controller reference moved or went: the former owner lost a child too.
            former = _held_owner(before, previous, owners)  # type: ignore[arg-type]
            targets += [] if former is None or former in targets else [former]
        return targets

    def _index(self, key: tuple[str, str], child: str, owner_uid: str | None) -> None:
        """Index ``child`` under its controller owner's uid (None: under no owner)."""
        owner_of, by_owner = self._owner_of[key], self._by_owner[key]
        previous = owner_of.pop(child, None)
        if previous is not None:
            children = by_owner.get(previous)
            if children is not None:
                children.discard(child)
                if not children:
                    del by_owner[previous]
        if owner_uid is not None:
            owner_of[child] = owner_uid
            by_owner.setdefault(owner_uid, set()).add(child)

    def children_of(self, owner_uid: str) -> Iterator[Body]:
        """Private copies of the cached children whose controller is ``owner_uid``."""
        for key, cache in self._children.items():
            for child in sorted(self._by_owner[key].get(owner_uid, ())):
                body = cache.get(child)
                if body is not None:
                    yield body


def _held_owner(
    body: Mapping[str, Any], reference: tuple[str, str], owners: ObjectCache
) -> str | None:
    """The entity id of the child's controller owner, when the reconciler holds it."""
    name, uid = reference
    namespace = (body.get("metadata") or {}).get("namespace")
    for candidate in (f"{namespace}/{name}" if namespace else None, name):
        if candidate is not None and owners.holds(candidate, uid):
            return candidate
    return None


def _mapped(map_to: MapTo, body: Mapping[str, Any]) -> list[str]:
    return [r.entity_id if isinstance(r, Request) else str(r) for r in map_to(body) or ()]


_current: contextvars.ContextVar[tuple[RelatedObjects, ObjectCache] | None] = (
    contextvars.ContextVar("kopf_reconcile_related_objects", default=None)
)


def owned(req: Request) -> list[Body]:
    """The cached children of ``req``'s object (declared with ``owns=``), private copies.

    Only inside a reconcile of a ``@kopf_reconcile.reconciler``; empty when the object is
    gone or has no children the watch has seen.
    """
    current = _current.get()
    if current is None:
        raise LookupError(
            "kopf_reconcile.owned() works only inside a reconcile of a @kopf_reconcile.reconciler"
        )
    related, owners = current
    body = owners.get(req.entity_id)
    if body is None:
        return []
    uid = (body.get("metadata") or {}).get("uid")
    return list(related.children_of(uid)) if isinstance(uid, str) else []


@contextmanager
def serving_related(related: RelatedObjects, owners: ObjectCache) -> Iterator[None]:
    """Make ``related`` the one :func:`owned` reads, for the duration of one reconcile."""
    token = _current.set((related, owners))
    try:
        yield
    finally:
        _current.reset(token)
