"""Which shard an entity belongs to: a pure, stable function of its id.

A reconciler with ``shards=N`` (``Builder.with_shards(N)``) splits its entities into
N shards, by the 64-bit FNV-1a hash (the hash of Kubernetes' sharded list and watch,
KEP-5866) of a key that depends on nothing but the id:

* by id (the default), the key is the entity id and the shard ``hash mod N``;
* ``by_namespace``, the key is the part of the id before its first ``/`` (the namespace
  of a ``<namespace>/<name>`` id, the tenant of a TENANT_SCOPED id; an id without ``/``
  is its own key), and the shard is the contiguous range of the hash space
  (:func:`hash_range`) the key's hash falls in: exactly how a KEP-5866
  ``shardRange(object.metadata.namespace, ...)`` selector splits it, so the API server
  can send a replica its shards' objects and no others (:meth:`ShardAssignment.selector`).

Either way an entity keeps its shard across delete and recreate, and every replica
computes the same shard for it: each shard's fencing scope sees every write of its
entities, and only those. (The server can also select by ``metadata.uid``; a shard keyed
by uid would move an entity to another shard when its object is recreated, which the
fencing cannot allow: see docs/safety.md, "Shards".)

Each shard has a lease and a fencing scope of its own, both named
``<reconciler id>-shard-<k>`` (:func:`shard_id`). ``N == 1`` is not sharding: the
reconciler keeps its own lease name and scope.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

from kopf_reconcile.api import ConfigError

__all__ = [
    "HASH_SPACE",
    "MAX_SHARDS",
    "NAMESPACE_FIELD",
    "UID_FIELD",
    "ShardAssignment",
    "fnv1a_64",
    "hash_range",
    "of_reconciler",
    "range_of",
    "range_of_hash",
    "shard_id",
    "shard_selector",
    "validate_shards",
]

MAX_SHARDS = 1024  # one lease (and one fencing scope) per shard: keep the store's load sane
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = 2**64 - 1


def fnv1a_64(data: bytes) -> int:
    """The 64-bit FNV-1a hash of ``data``."""
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & _MASK
    return h


def shard_id(reconciler_id: str, shard: int) -> str:
    """The lease name and fencing scope of ``shard`` of ``reconciler_id``."""
    return f"{reconciler_id}-shard-{shard}"


def of_reconciler(name: str, reconciler_id: str) -> bool:
    """Whether a lease or scope ``name`` is ``reconciler_id``'s: its own, one of its shards'
    (``<id>-shard-<k>``) or of its members' (``<id>-member-<k>``), never another name that
    merely starts the same way."""
    if name == reconciler_id:
        return True
    rest = name[len(reconciler_id) :] if name.startswith(reconciler_id) else ""
    for kind in ("-shard-", "-member-"):
        number = rest[len(kind) :] if rest.startswith(kind) else ""
        if number.isascii() and number.isdigit():
            return True
    return False


HASH_SPACE = 2**64  # FNV-1a 64's values: [0, 2**64)
UID_FIELD = "object.metadata.uid"  # what KEP-5866's shard selectors can hash
NAMESPACE_FIELD = "object.metadata.namespace"


def hash_range(shard: int, shards: int) -> tuple[int, int]:
    """Shard ``shard``'s contiguous part ``[start, end)`` of the FNV-1a 64 space, of ``shards``
    equal parts (the last one ends at 2**64), as KEP-5866's shard selectors split it."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard must be in range({shards}), got {shard!r}")
    return shard * HASH_SPACE // shards, (shard + 1) * HASH_SPACE // shards


def range_of(value: str, shards: int) -> int:
    """The contiguous range (:func:`hash_range`) ``value``'s FNV-1a 64 hash falls in."""
    return range_of_hash(fnv1a_64(value.encode("utf-8", "surrogatepass")), shards)


def range_of_hash(hashed: int, shards: int) -> int:
    """The range ``k`` of :func:`hash_range` holding ``hashed``: the largest ``k`` with
    ``k * 2**64 // shards <= hashed``. (``hashed * shards // 2**64`` differs from it at
    ``shards - 1`` values when ``shards`` is not a power of two, and the server's ranges are
    :func:`hash_range`'s.)"""
    return ((hashed + 1) * shards - 1) // HASH_SPACE


@functools.lru_cache(maxsize=65536)
def _range_of_namespace(namespace: str, shards: int) -> int:
    """:func:`range_of`, remembered: a cluster has few namespaces, each seen in every event."""
    return range_of(namespace, shards)


def shard_selector(field: str, ranges: list[tuple[int, int]]) -> str:
    """The ``shardSelector`` of KEP-5866 (kube-apiserver 1.36+, gate ``ShardedListAndWatch``)
    selecting ``ranges`` of ``field``'s hash, in the server's canonical form: its list echoes
    exactly this string as ``metadata.shardInfo.selector``. Bounds are ``0x`` and 16 lowercase
    hex digits, the end of the space ``0x10000000000000000``; start inclusive, end exclusive."""
    if field not in (UID_FIELD, NAMESPACE_FIELD) or not ranges:
        raise ValueError(f"a shard selector needs a field of {UID_FIELD}, {NAMESPACE_FIELD}")
    return " || ".join(
        f"shardRange({field}, '0x{start:016x}', '0x{end:016x}')" for start, end in ranges
    )


def validate_shards(value: object) -> int:
    """``value`` as a shard count, or a :class:`ConfigError` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SHARDS:
        raise ConfigError(f"shards must be an integer from 1 to {MAX_SHARDS}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ShardAssignment:
    """Entity ids into ``shards`` shards, by the whole id or by its namespace alone.

    ``namespace_modulo`` is the by-namespace assignment of earlier releases (``hash mod N``
    instead of ranges): it is only ever read back from a store that recorded it, so that
    ``kopf-reconcile reshard`` can move its entities; no replica runs it.
    """

    shards: int
    by_namespace: bool = False
    namespace_modulo: bool = False

    def __post_init__(self) -> None:
        validate_shards(self.shards)
        for name in ("by_namespace", "namespace_modulo"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"shard {name} must be a bool, got {getattr(self, name)!r}")
        if self.namespace_modulo and not self.by_namespace:
            raise ConfigError("namespace_modulo describes a by_namespace assignment only")

    def key(self, entity_id: str) -> str:
        """What is hashed: the id, or with ``by_namespace`` what precedes its first ``/``."""
        if self.by_namespace:
            namespace, slash, _ = entity_id.partition("/")
            if slash:
                return namespace
        return entity_id

    def shard_of(self, entity_id: str) -> int:
        """The shard of ``entity_id``, in ``range(shards)``."""
        if self.shards == 1:
            return 0
        key = self.key(entity_id)
        if self.by_namespace and not self.namespace_modulo:
            return _range_of_namespace(key, self.shards)
        return fnv1a_64(key.encode("utf-8", "surrogatepass")) % self.shards

    def shard_of_namespace(self, namespace: str) -> int:
        """The shard of the objects of ``namespace`` (by namespace ranges only)."""
        if not self.server_selectable:
            raise ValueError(f"{self!r} does not assign shards by namespace ranges")
        return _range_of_namespace(namespace, self.shards)

    @property
    def server_selectable(self) -> bool:
        """Whether the API server can select a shard's objects exactly (by namespace ranges)."""
        return self.shards > 1 and self.by_namespace and not self.namespace_modulo

    def selector(self, shards: Iterable[int]) -> str | None:
        """The KEP-5866 ``shardSelector`` of exactly the namespaced objects of ``shards``
        (adjacent ranges joined), ``None`` when the server cannot select them
        (:attr:`server_selectable`) or ``shards`` is empty."""
        chosen = sorted(set(shards))
        if not self.server_selectable or not chosen:
            return None
        ranges: list[tuple[int, int]] = []
        for k in chosen:
            start, end = hash_range(k, self.shards)
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
        return shard_selector(NAMESPACE_FIELD, ranges)
