"""How many shards a replica should hold, and when it gives one up: pure decisions.

The replicas of a sharded reconciler learn of each other from the lease store:
each holds one *membership* lease (``<reconciler id>-member-<j>``, the first free of
N slots, renewed like any lease) and the shard leases name their holders. From
that view (:class:`BalanceView`) each replica decides on its own:

* its **target**, ``ceil(N / live replicas)`` (itself counted, member or not): it
  acquires a shard only while it holds fewer. A member whose membership lease was
  last renewed longer ago than the renew deadline is not counted live: by its own
  rule it has stepped down, or it is dead or paused, and counting it until its
  lease expires would make the others give up shards to a replica that cannot
  take them (churn after every SIGKILL);
* whether to **give up** one shard: only when another live member is *short* —
  holding fewer than ``floor(N / live)`` while this one holds more than that, or
  fewer than the target while this one holds more than the target. A replica at
  or below its fair share never gives one up, so shares converge (every hand-off
  moves a shard from above to below the fair share) instead of thrashing.

The driver (:class:`~kopf_reconcile.sharded_loop.ShardedLoop`) adds the hysteresis
in time: one hand-off per balance period at most, and a shard it handed off is not
taken back by it for a cooldown, so the short replica gets it.

These decisions are about load, never about safety: a wrong view (a stale listing,
clocks of two machines compared to judge a record's expiry) costs balance, not a
second holder. Safety is each shard lease's own (G1, G2 per shard, docs/safety.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Iterable, Mapping

from kopf_reconcile.leader.protocol import LeaseRecord

__all__ = ["BalanceDecision", "BalanceView", "balance", "member_id", "view_from_records"]


def member_id(reconciler_id: str, slot: int) -> str:
    """The name of membership lease ``slot`` of ``reconciler_id``."""
    return f"{reconciler_id}-member-{slot}"


@dataclasses.dataclass(frozen=True)
class BalanceView:
    """What the lease store shows of one sharded reconciler."""

    shards: int
    me: str  # this replica's holder id
    members: frozenset[str]  # holder ids of live membership leases
    holders: Mapping[int, str]  # shard -> holder id of its live lease

    def live(self) -> int:
        """Live replicas: the members, and this replica (member or not)."""
        return len(self.members | {self.me})

    def held_by(self, holder: str) -> int:
        return sum(1 for h in self.holders.values() if h == holder)


@dataclasses.dataclass(frozen=True)
class BalanceDecision:
    target: int  # acquire while holding fewer
    give_up: int | None  # a shard to hand off now, or None


def balance(view: BalanceView, held: Iterable[int]) -> BalanceDecision:
    """This replica's target, and the shard it should hand off (if any).

    ``held`` are the shards this replica leads (its own knowledge, not the listing).
    """
    mine = sorted(set(held))
    live = view.live()
    target = math.ceil(view.shards / live)
    floor = view.shards // live
    others = [view.held_by(member) for member in view.members if member != view.me]
    count = len(mine)
    short_of_floor = any(n < floor for n in others)
    short_of_target = any(n < target for n in others)
    if mine and ((count > floor and short_of_floor) or (count > target and short_of_target)):
        return BalanceDecision(target, mine[-1])
    return BalanceDecision(target, None)


def view_from_records(
    records: Iterable[LeaseRecord],
    *,
    reconciler_id: str,
    shards: int,
    me: str,
    now: datetime.datetime,
    shard_ids: Mapping[str, int],
    member_stale_after: float | None = None,
) -> BalanceView:
    """The view of one reconciler in a store's listing (live records only).

    ``shard_ids`` maps each shard's lease name to its shard number. A record is live
    when it names a holder and has not expired by ``now`` (this machine's wall clock
    against the store's: good enough for balance, never used for safety). A
    membership record renewed more than ``member_stale_after`` seconds before ``now``
    (the renew deadline) does not count either.
    """
    stale_before = (
        None if member_stale_after is None else now - datetime.timedelta(seconds=member_stale_after)
    )
    members: set[str] = set()
    holders: dict[int, str] = {}
    prefix = member_id(reconciler_id, 0)[:-1]
    for record in records:
        if not record.held_at(now):
            continue
        name = record.reconciler_id
        if name in shard_ids:
            holders[shard_ids[name]] = record.holder_id
        elif name.startswith(prefix) and name[len(prefix) :].isdigit():
            renewed = record.renewed_at
            if stale_before is not None and renewed is not None and renewed < stale_before:
                continue  # missed its renewals: not a replica that can take a shard now
            members.add(record.holder_id)
    return BalanceView(shards=shards, me=me, members=frozenset(members), holders=holders)
