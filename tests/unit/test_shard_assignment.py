"""Shard assignment and balance decisions: pure functions, checked by example and by property.

- FNV-1a 64 matches the published test vectors; an entity's shard is in range, the
  same in every call and for every replica (it depends on the id and N only, so it
  survives delete and recreate), and ids spread roughly uniformly.
- By namespace, every object of a namespace lands in one shard.
- Balance: a replica aims at ceil(N / live), hands a shard off only when another
  live replica is short, and shares reached by hand-offs are stable (no thrashing).
- Configuration: shards=1 builds a plain Loop (today's lease name and scope); a bad
  count, shards without a leader, or a repository that cannot fence shards are
  ConfigErrors.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kopf_reconcile as kr
from kopf_reconcile.control.balance import (
    BalanceDecision,
    BalanceView,
    balance,
    member_id,
    view_from_records,
)
from kopf_reconcile.integration import shard_leases
from kopf_reconcile.leader.protocol import LeaseRecord
from kopf_reconcile.sharded_loop import ShardedLoop
from kopf_reconcile.sharding import ShardAssignment, fnv1a_64, shard_id
from kopf_reconcile.testing.memory import (
    MemoryFencedRepository,
    MemoryLeaseElector,
    MemoryLeaseStore,
)

ids = st.text(min_size=1, max_size=80)
counts = st.integers(min_value=1, max_value=1024)


def test_fnv1a_64_matches_the_published_vectors() -> None:
    assert fnv1a_64(b"") == 0xCBF29CE484222325
    assert fnv1a_64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a_64(b"foobar") == 0x85944171F73967E8


@given(entity=ids, shards=counts)
def test_a_shard_is_in_range_and_stable(entity: str, shards: int) -> None:
    one, other = ShardAssignment(shards), ShardAssignment(shards)  # two replicas
    shard = one.shard_of(entity)
    assert 0 <= shard < shards
    assert shard == one.shard_of(entity) == other.shard_of(entity)
    assert shard == fnv1a_64(entity.encode("utf-8", "surrogatepass")) % shards


@given(namespace=st.text(alphabet="abcdefgh-", min_size=1, max_size=20), names=st.lists(ids))
def test_by_namespace_every_object_of_a_namespace_shares_a_shard(
    namespace: str, names: list[str]
) -> None:
    assignment = ShardAssignment(8, by_namespace=True)
    home = assignment.shard_of(f"{namespace}/first")
    assert all(assignment.shard_of(f"{namespace}/{name}") == home for name in names)
    assert assignment.shard_of(namespace) == home  # the namespace itself, cluster-scoped


@settings(max_examples=20)
@given(shards=st.integers(min_value=2, max_value=16), salt=st.text(max_size=8))
def test_ids_spread_roughly_uniformly(shards: int, salt: str) -> None:
    assignment = ShardAssignment(shards)
    n = 4000
    seen = collections.Counter(assignment.shard_of(f"ns-{i % 37}/{salt}obj-{i}") for i in range(n))
    expected = n / shards
    # Well inside 6 standard deviations of a binomial count.
    slack = 6 * math.sqrt(expected)
    assert set(seen) == set(range(shards))
    assert all(abs(count - expected) < slack for count in seen.values()), seen


def test_shard_ids_name_lease_and_scope() -> None:
    assert shard_id("devices", 3) == "devices-shard-3"
    assert member_id("devices", 0) == "devices-member-0"


@pytest.mark.parametrize("bad", [0, -1, 1025, 2.0, True, "2"])
def test_a_bad_shard_count_is_a_config_error(bad: object) -> None:
    with pytest.raises(kr.ConfigError, match="shards"):
        ShardAssignment(bad)  # type: ignore[arg-type]
    with pytest.raises(kr.ConfigError, match="shards"):
        kr.Builder(lambda req: None, kr.Tenancy.SINGLE_TENANT).with_shards(bad)  # type: ignore[arg-type]


# -- balance ----------------------------------------------------------------------------


def view(shards: int, me: str, holders: dict[int, str], *members: str) -> BalanceView:
    return BalanceView(shards=shards, me=me, members=frozenset(members), holders=holders)


def test_alone_a_replica_aims_at_every_shard() -> None:
    decision = balance(view(8, "a", {}, "a"), held=[])
    assert decision.target == 8 and decision.give_up is None


def test_a_new_member_makes_the_others_give_up_their_extra_shards() -> None:
    holders = dict.fromkeys(range(8), "a")
    decision = balance(view(8, "a", holders, "a", "b"), held=range(8))
    assert decision.target == 4
    assert decision.give_up == 7


def test_a_fair_share_is_never_given_up() -> None:
    # 8 shards over 3 replicas: 3, 3, 2 is fair; nobody hands anything off.
    holders = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b", 6: "c", 7: "c"}
    for me, mine in (("a", [0, 1, 2]), ("b", [3, 4, 5]), ("c", [6, 7])):
        assert balance(view(8, me, holders, "a", "b", "c"), held=mine).give_up is None


def test_a_replica_with_no_shard_gets_one_from_a_replica_at_the_target() -> None:
    # 4 shards over 3 replicas: 2, 2, 0 -> one of the twos hands one over.
    holders = {0: "a", 1: "a", 2: "b", 3: "b"}
    decision = balance(view(4, "a", holders, "a", "b", "c"), held=[0, 1])
    assert decision.target == 2 and decision.give_up == 1


def test_a_non_member_counts_itself_and_sees_the_members() -> None:
    holders = dict.fromkeys(range(4), "a")
    decision = balance(view(4, "me", holders, "a"), held=[])
    assert decision.target == 2 and decision.give_up is None


@settings(max_examples=200)
@given(
    shards=st.integers(min_value=1, max_value=32),
    replicas=st.integers(min_value=1, max_value=8),
    start=st.lists(st.integers(min_value=0, max_value=7), min_size=32, max_size=32),
)
def test_hand_offs_converge_to_fair_shares_without_thrashing(
    shards: int, replicas: int, start: list[int]
) -> None:
    """Replaying the decisions (a hand-off goes to a replica below its target) ends."""
    names = [f"r{i}" for i in range(replicas)]
    owner = {k: names[start[k] % replicas] for k in range(shards)}
    moves = 0
    while True:
        moved = False
        for me in names:
            mine = [k for k, h in owner.items() if h == me]
            decision = balance(view(shards, me, owner, *names), held=mine)
            if decision.give_up is None:
                continue
            counts = collections.Counter(owner.values())
            taker = min(names, key=lambda n: (counts[n], n))
            assert counts[taker] < decision.target  # someone below the target takes it
            owner[decision.give_up] = taker
            moves += 1
            moved = True
        if not moved:
            break
        assert moves <= shards * replicas  # converges, never oscillates
    counts = collections.Counter(owner.values())
    assert max(counts[n] for n in names) <= math.ceil(shards / replicas)
    assert min(counts[n] for n in names) >= shards // replicas


def test_the_view_keeps_live_records_of_this_reconciler_only() -> None:
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    later, earlier = now + datetime.timedelta(seconds=5), now - datetime.timedelta(seconds=1)

    def record(name: str, holder: str, expires: datetime.datetime | None) -> LeaseRecord:
        return LeaseRecord(None, name, holder, 1, None, None, expires)

    records = [
        record("d-member-0", "a", later),
        record("d-member-1", "b", earlier),  # expired: b is gone
        record("d-member-2", "", None),  # released
        record("d-shard-0", "a", later),
        record("d-shard-1", "b", earlier),
        record("other-member-0", "z", later),
        record("d-members-x", "y", later),
    ]
    got = view_from_records(
        records,
        reconciler_id="d",
        shards=2,
        me="a",
        now=now,
        shard_ids={"d-shard-0": 0, "d-shard-1": 1},
    )
    assert got.members == frozenset({"a"})
    assert dict(got.holders) == {0: "a"}


def test_a_member_that_missed_its_renewals_is_not_counted_live() -> None:
    # A replica SIGKILLed a moment ago: its membership and shard leases have not
    # expired yet, but it stopped renewing. Counted live, it would look short of
    # shards and the survivors would hand theirs off to it, for nothing.
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    expires = now + datetime.timedelta(seconds=1)

    def record(name: str, holder: str, renewed_ago: float) -> LeaseRecord:
        renewed = now - datetime.timedelta(seconds=renewed_ago)
        return LeaseRecord(None, name, holder, 1, None, renewed, expires)

    records = [
        record("d-member-0", "a", 0.1),
        record("d-member-1", "b", 0.2),
        record("d-member-2", "dead", 2.5),  # renew deadline 2 s: missed its renewals
        *(record(f"d-shard-{k}", "a", 0.1) for k in range(3)),
        *(record(f"d-shard-{k}", "b", 0.2) for k in range(3, 6)),
    ]
    shard_ids = {f"d-shard-{k}": k for k in range(8)}
    view = view_from_records(
        records,
        reconciler_id="d",
        shards=8,
        me="a",
        now=now,
        shard_ids=shard_ids,
        member_stale_after=2.0,
    )
    assert view.members == frozenset({"a", "b"})
    assert balance(view, range(3)) == BalanceDecision(target=4, give_up=None)
    # Counted live (no staleness rule), the dead replica looks short: a gives one up.
    counted = view_from_records(
        records, reconciler_id="d", shards=8, me="a", now=now, shard_ids=shard_ids
    )
    assert balance(counted, range(3)).give_up is not None


# -- configuration ------------------------------------------------------------------------


def build(shards: int, *, leader: bool = True, repo: object = None) -> kr.Loop:
    builder = (
        kr.Builder(lambda req: None, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_reconciler_id("devices")
        .with_shards(shards)
    )
    if leader:
        builder.with_leader(MemoryLeaseElector(MemoryLeaseStore()))
    if repo is not None:
        builder.with_fenced_repo(repo)  # type: ignore[arg-type]
    return builder.build()


def test_one_shard_is_a_plain_loop_with_todays_lease_name() -> None:
    loop = build(1)
    assert type(loop) is kr.Loop
    assert loop.reconciler_id == "devices"


@pytest.mark.parametrize("rid", ["devices-shard-1", "devices-member-0"])
@pytest.mark.parametrize("shards", [1, 3])
def test_a_reconciler_id_may_not_take_a_shards_or_a_members_name(rid: str, shards: int) -> None:
    # It would share the lease and the fencing scope of a sharded reconciler's shard.
    builder = (
        kr.Builder(lambda req: None, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_reconciler_id(rid)
        .with_leader(MemoryLeaseElector(MemoryLeaseStore(), ttl=kr.LeaseTTL(3)))
        .with_shards(shards)
    )
    with pytest.raises(kr.ConfigError, match="shard or a member"):
        builder.build()


def test_shards_need_a_leader() -> None:
    with pytest.raises(kr.ConfigError, match="requires with_leader"):
        build(4, leader=False)


def test_shards_need_a_repository_that_can_fence_shards() -> None:
    with pytest.raises(kr.ConfigError, match="ShardableRepository"):
        build(4, repo=MemoryFencedRepository())


def test_a_sharded_loop_has_one_loop_per_shard_lease() -> None:
    loop = build(3)
    assert isinstance(loop, ShardedLoop)
    assert loop.shards == 3
    assert [sub.reconciler_id for sub in loop._shard_loops] == [
        "devices-shard-0",
        "devices-shard-1",
        "devices-shard-2",
    ]


# -- kopf-reconcile leases ------------------------------------------------------------------


def test_the_leases_listing_groups_shards_in_order_and_summarises_holders() -> None:
    def record(name: str, holder: str, epoch: int) -> LeaseRecord:
        return LeaseRecord("ops", name, holder, epoch, None, None, None)

    records = [
        record("devices-shard-10", "b", 3),
        record("devices-member-0", "a", 1),
        record("devices-shard-2", "a", 7),
        record("devices-member-1", "b", 1),
        record("devices-member-2", "", 1),  # released: not a live member
        record("devices", "z", 9),  # an unsharded reconciler of that name
        record("zeta", "a", 1),
    ]
    assert [r.reconciler_id for r in shard_leases.ordered(records)] == [
        "devices",
        "devices-shard-2",
        "devices-shard-10",
        "devices-member-0",
        "devices-member-1",
        "devices-member-2",
        "zeta",
    ]
    assert shard_leases.summaries(records) == [
        "ops/devices: 2 shards (shard@epoch) — a: 2@7; b: 10@3 — 2 member(s)"
    ]
