"""The leases of sharded reconcilers, grouped for people (``kopf-reconcile leases``).

A reconciler with ``shards=N`` keeps one lease per shard (``<id>-shard-<k>``) and one
membership lease per live replica (``<id>-member-<j>``). :func:`ordered` lists a
store's records with each reconciler's shards together, in shard order (``-shard-10``
after ``-shard-9``); :func:`summaries` says, per sharded reconciler, which holder leads
which shards at which epochs, and how many replicas are members.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

from kopf_reconcile.leader.protocol import LeaseRecord

__all__ = ["ShardedLeases", "group", "ordered", "summaries"]

_SHARDED = re.compile(r"^(?P<base>.+)-(?P<kind>shard|member)-(?P<k>[0-9]+)$")


@dataclasses.dataclass
class ShardedLeases:
    """The shard and membership leases of one sharded reconciler, in one namespace."""

    namespace: str | None
    reconciler_id: str
    shards: dict[int, LeaseRecord] = dataclasses.field(default_factory=dict)
    members: dict[int, LeaseRecord] = dataclasses.field(default_factory=dict)


def _key(record: LeaseRecord) -> tuple[str, str, int, int]:
    match = _SHARDED.match(record.reconciler_id)
    if match is None:
        return (record.namespace or "", record.reconciler_id, -1, -1)
    kind = 0 if match["kind"] == "shard" else 1
    return (record.namespace or "", match["base"], kind, int(match["k"]))


def ordered(records: Iterable[LeaseRecord]) -> list[LeaseRecord]:
    """The records by namespace and reconciler, each one's shards then members in order."""
    return sorted(records, key=_key)


def group(records: Iterable[LeaseRecord]) -> list[ShardedLeases]:
    """The sharded reconcilers among ``records`` (those with at least one shard lease)."""
    found: dict[tuple[str | None, str], ShardedLeases] = {}
    for record in records:
        match = _SHARDED.match(record.reconciler_id)
        if match is None:
            continue
        key = (record.namespace, match["base"])
        entry = found.setdefault(key, ShardedLeases(record.namespace, match["base"]))
        target = entry.shards if match["kind"] == "shard" else entry.members
        target[int(match["k"])] = record
    return [
        entry
        for _, entry in sorted(found.items(), key=lambda i: (i[0][0] or "", i[0][1]))
        if entry.shards
    ]


def summaries(records: Sequence[LeaseRecord]) -> list[str]:
    """One line per sharded reconciler: holders with their shards (and epochs), members."""
    lines = []
    for entry in group(records):
        by_holder: dict[str, list[str]] = {}
        for k, record in sorted(entry.shards.items()):
            holder = record.holder_id or "(released)"
            by_holder.setdefault(holder, []).append(f"{k}@{record.epoch}")
        members = sum(1 for record in entry.members.values() if record.holder_id)
        where = f"{entry.namespace}/" if entry.namespace else ""
        held = "; ".join(f"{holder}: {', '.join(shards)}" for holder, shards in by_holder.items())
        lines.append(
            f"{where}{entry.reconciler_id}: {len(entry.shards)} shards (shard@epoch) — {held}"
            f" — {members} member(s)"
        )
    return lines
