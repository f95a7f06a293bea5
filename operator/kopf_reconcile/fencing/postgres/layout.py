"""How a shard layout is named in the epochs rows, and read back (no database here).

Sharded reconcilers (``for_shard``) fence each shard in a scope of its own, and their
base scope records the layout (``record_shard_count``): its epochs row names the lease
``<reconciler id>/shards=N[/namespace-ranges]`` (:func:`layout_lease`). A reshard names in
each shard scope the shard's lease qualified by the layout (:func:`shard_scope_lease`).

``/by-namespace`` is the by-namespace layout of earlier releases (``hash mod N``, not
ranges): it is read back so that a store that recorded it can be resharded, and it never
matches what a replica of this release runs, so such a replica is refused (with the hint)
instead of fencing an entity in another scope than the old replicas do.
"""

from __future__ import annotations

import dataclasses
import re

from kopf_reconcile.api import ConfigError
from kopf_reconcile.sharding import MAX_SHARDS, ShardAssignment, validate_shards

__all__ = [
    "OF_RECONCILER",
    "SHARD_SCOPE_LEASE",
    "Layout",
    "ShardLayout",
    "base_lease",
    "check_shard_count",
    "describe_layout",
    "layout_lease",
    "parse_layout",
    "reconciler_of",
    "reshard_hint",
    "shard_scope_lease",
]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A layout recorded in a base scope: its scope, its lease, its assignment."""

    base_scope: str
    lease: str  # what the base scope's epochs row must name (layout_lease)
    assignment: ShardAssignment


@dataclasses.dataclass
class ShardLayout:
    """The layout a sharded repository runs, shared by it and its shard repositories.

    Set by :meth:`PostgresFencedRepository.record_shard_count`; each shard's
    :meth:`~PostgresFencedRepository.record_epoch` checks the base scope against it.
    """

    current: Layout | None = None


_NAMESPACE_RANGES = "/namespace-ranges"
_NAMESPACE_MODULO = "/by-namespace"  # earlier releases' by-namespace layout


def _layout(assignment: ShardAssignment) -> str:
    """``shards=N`` and how entities are assigned, as the leases name a layout."""
    if not assignment.by_namespace:
        return f"shards={assignment.shards}"
    mode = _NAMESPACE_MODULO if assignment.namespace_modulo else _NAMESPACE_RANGES
    return f"shards={assignment.shards}{mode}"


def layout_lease(reconciler_id: str, assignment: ShardAssignment) -> str:
    """The lease a base scope's epochs row names for a layout
    (``<id>/shards=N[/namespace-ranges]``)."""
    return f"{reconciler_id}/{_layout(assignment)}"


def shard_scope_lease(shard_lease: str, assignment: ShardAssignment) -> str:
    """What a shard scope's epochs row names once a reshard made ``assignment`` its layout.

    ``<id>-shard-<k>@shards=N[/namespace-ranges]``: the shard's lease qualified by the layout.
    A shard's :meth:`~PostgresFencedRepository.record_epoch` of this release accepts it
    when its layout is that one, and a client of a release without the layout check
    (which requires the plain lease name) is refused by the server. It never contains
    ``/shards=``, so it is never taken for a base scope's layout (:func:`parse_layout`).
    """
    return f"{shard_lease}@{_layout(assignment)}"


# A scope of a reconciler: its base scope ``given`` or one of its shard scopes
# ``<given>-shard-<k>`` (never another scope that merely starts with the same text).
OF_RECONCILER = (
    "({scope} = {given} OR (starts_with({scope}, {given} || '-shard-') "
    "AND substr({scope}, char_length({given}) + 8) ~ '^[0-9]+$'))"
)

_LAYOUT_LEASE = re.compile(
    r"(?s)(?P<id>.+)/shards=(?P<shards>[0-9]+)(?P<mode>/namespace-ranges|/by-namespace)?"
)


def parse_layout(lease: object) -> tuple[str, ShardAssignment] | None:
    """The reconciler id and assignment a base scope's lease names; ``None`` if unsharded."""
    found = _LAYOUT_LEASE.fullmatch(lease) if isinstance(lease, str) else None
    if found is None:
        return None
    shards = int(found["shards"])
    if not 2 <= shards <= MAX_SHARDS:
        return None
    mode = found["mode"]
    return found["id"], ShardAssignment(shards, bool(mode), mode == _NAMESPACE_MODULO)


def base_lease(reconciler_id: str, assignment: ShardAssignment) -> str:
    """What a base scope's epochs row names under ``assignment``: the reconciler's own
    lease when unsharded, else the layout (:func:`layout_lease`)."""
    if assignment.shards == 1:
        return reconciler_id
    return layout_lease(reconciler_id, assignment)


def reconciler_of(lease: object, *, sharded: bool = False) -> str | None:
    """The reconciler whose lease a base scope's epochs row names: the id of its layout
    (``<id>/shards=N``), or, unless ``sharded``, the lease itself (led unsharded)."""
    parsed = parse_layout(lease)
    if parsed is not None:
        return parsed[0]
    return None if sharded or not isinstance(lease, str) else lease


def describe_layout(lease: str) -> str:
    """``sharded as '<id>/shards=N'``, or ``unsharded`` for a base scope's lease."""
    return "unsharded" if parse_layout(lease) is None else f"sharded as {lease!r}"


# The lease a shard scope's epochs row names: ``<id>-shard-<k>``, maybe qualified by a layout.
SHARD_SCOPE_LEASE = re.compile(r"(?s).+-(shard|member)-[0-9]+(@shards=.*)?")


def reshard_hint(base_scope: str, assignment: ShardAssignment) -> str:
    """How to move a base scope to ``assignment``: the command, once, with the database."""
    flag = " --by-namespace" if assignment.by_namespace else ""
    return (
        f"To change the layout, once no replica of the old layout runs, run `kopf-reconcile "
        f"reshard --reconciler {base_scope} --shards {assignment.shards}{flag} --leases "
        "kubernetes|postgres` (once): it moves the entities to their new scopes and "
        "fences the old layout; until then this replica retries and leads nothing"
    )


def check_shard_count(shards: object) -> int:
    """A sharded layout has from 2 to MAX_SHARDS shards (one shard is an unsharded Loop)."""
    try:
        count = validate_shards(shards)
    except ConfigError:
        count = 0  # refused below, with the range of a sharded layout
    if count < 2:
        raise ConfigError(f"shards must be an integer from 2 to {MAX_SHARDS}, got {shards!r}")
    return count
