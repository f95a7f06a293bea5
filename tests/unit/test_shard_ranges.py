"""KEP-5866's hash ranges and selectors, the by-namespace assignment by those ranges (and
the earlier releases' one, read back from a store), which names belong to a reconciler,
and the leases a layout change retires."""

from __future__ import annotations

import random

import pytest

from kopf_reconcile.api import ConfigError
from kopf_reconcile.control.layout_wait import LAYOUT_RETRY_MAX, LayoutRefused, LayoutWait
from kopf_reconcile.fencing.postgres.layout import (
    base_lease,
    layout_lease,
    parse_layout,
    shard_scope_lease,
)
from kopf_reconcile.integration.cli import retired_leases
from kopf_reconcile.sharding import (
    HASH_SPACE,
    NAMESPACE_FIELD,
    UID_FIELD,
    ShardAssignment,
    fnv1a_64,
    hash_range,
    of_reconciler,
    range_of,
    range_of_hash,
    shard_selector,
)


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7, 1024])
def test_the_ranges_cover_the_space_contiguously(shards: int) -> None:
    ranges = [hash_range(k, shards) for k in range(shards)]
    assert ranges[0][0] == 0 and ranges[-1][1] == HASH_SPACE
    assert all(ranges[k][1] == ranges[k + 1][0] for k in range(shards - 1))
    rng = random.Random(29)
    for value in (f"{rng.getrandbits(64):x}" for _ in range(200)):
        k = range_of(value, shards)
        start, end = ranges[k]
        assert start <= fnv1a_64(value.encode()) < end


def test_selectors_are_written_as_the_server_echoes_them() -> None:
    assert shard_selector(UID_FIELD, [hash_range(0, 2)]) == (
        "shardRange(object.metadata.uid, '0x0000000000000000', '0x8000000000000000')"
    )
    assert shard_selector(NAMESPACE_FIELD, [hash_range(1, 2), hash_range(0, 4)]) == (
        "shardRange(object.metadata.namespace, '0x8000000000000000', '0x10000000000000000')"
        " || shardRange(object.metadata.namespace, '0x0000000000000000', '0x4000000000000000')"
    )
    with pytest.raises(ValueError):
        shard_selector("object.metadata.name", [hash_range(0, 2)])
    with pytest.raises(ValueError):
        hash_range(2, 2)


def test_a_reconcilers_names_are_its_own_its_shards_and_its_members() -> None:
    for name in ("devices", "devices-shard-0", "devices-shard-12", "devices-member-3"):
        assert of_reconciler(name, "devices")
    for name in ("devicesx", "devices-shard-", "devices-shard-1-extra", "devices-shard-x",
                 "devices-2", "other-shard-1", "devices-shard-\u0661"):  # fmt: skip
        assert not of_reconciler(name, "devices"), name


def test_retired_leases() -> None:
    assert retired_leases("d", 1, 4) == ["d"]
    assert retired_leases("d", 4, 2) == ["d-shard-2", "d-shard-3", "d-member-2", "d-member-3"]
    assert retired_leases("d", 2, 1) == ["d-shard-0", "d-shard-1", "d-member-0", "d-member-1"]
    assert retired_leases("d", 2, 4) == []


def test_a_layout_wait_doubles_up_to_a_minute_and_starts_again_once_accepted() -> None:
    now = [0.0]
    wait = LayoutWait("loop", 2.0, random.Random(1), clock=lambda: now[0])
    assert wait.open()
    seen = []
    for _ in range(8):
        assert isinstance(wait.refused(Exception("layout")), LayoutRefused)
        assert not wait.open()
        seen.append(wait.backoff)
        wait.refused(Exception("again, within the wait"))  # no further step meanwhile
        assert wait.backoff == seen[-1]
        now[0] += LAYOUT_RETRY_MAX * 1.2
        assert wait.open()
    assert seen == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    wait.accepted()
    wait.refused(Exception("layout"))
    assert wait.backoff == 2.0


_RNG = random.Random(5866)
NAMESPACES = ["default", "kube-system", "ünï", "x"] + [
    "".join(_RNG.choice("abcdefghijklmnopqrstuvwxyz-") for _ in range(_RNG.randint(3, 20)))
    for _ in range(300)
]


@pytest.mark.parametrize("shards", [2, 3, 4, 8])
def test_by_namespace_a_shard_is_the_range_its_namespaces_hash_falls_in(shards: int) -> None:
    assignment = ShardAssignment(shards, by_namespace=True)
    assert assignment.server_selectable
    for namespace in NAMESPACES:
        k = assignment.shard_of(f"{namespace}/obj")
        start, end = hash_range(k, shards)
        assert start <= fnv1a_64(namespace.encode()) < end
        assert k == range_of(namespace, shards)
    # Every range gets namespaces (the ranges, not a modulo, decide).
    assert {assignment.shard_of(f"{n}/o") for n in NAMESPACES} == set(range(shards))


def test_a_selector_names_exactly_the_ranges_of_the_shards_given() -> None:
    assignment = ShardAssignment(4, by_namespace=True)
    q = [f"0x{k * HASH_SPACE // 4:016x}" for k in range(4)] + ["0x10000000000000000"]
    field = NAMESPACE_FIELD
    assert assignment.selector([2]) == f"shardRange({field}, '{q[2]}', '{q[3]}')"
    # Adjacent shards are one range; others are joined with ||, in order.
    assert assignment.selector([3, 1, 2]) == f"shardRange({field}, '{q[1]}', '{q[4]}')"
    assert assignment.selector([3, 0]) == (
        f"shardRange({field}, '{q[0]}', '{q[1]}') || shardRange({field}, '{q[3]}', '{q[4]}')"
    )
    assert assignment.selector([]) is None
    # By id, and by the earlier releases' modulo, the server cannot select a shard.
    assert ShardAssignment(4).selector([0]) is None
    assert ShardAssignment(4, True, namespace_modulo=True).selector([0]) is None
    assert ShardAssignment(1).selector([0]) is None


def test_layouts_are_named_apart_and_read_back() -> None:
    ranges, by_id = ShardAssignment(3, by_namespace=True), ShardAssignment(3)
    modulo = ShardAssignment(3, by_namespace=True, namespace_modulo=True)
    assert layout_lease("r", by_id) == "r/shards=3"
    assert layout_lease("r", ranges) == "r/shards=3/namespace-ranges"
    assert layout_lease("r", modulo) == "r/shards=3/by-namespace"  # as earlier releases wrote
    assert shard_scope_lease("r-shard-1", ranges) == "r-shard-1@shards=3/namespace-ranges"
    for assignment in (ranges, by_id, modulo):
        assert parse_layout(base_lease("r", assignment)) == ("r", assignment)
    # The earlier by-namespace layout assigned by modulo: read back as such.
    assert all(modulo.shard_of(f"{n}/o") == fnv1a_64(n.encode()) % 3 for n in NAMESPACES)
    with pytest.raises(ConfigError, match="namespace_modulo"):
        ShardAssignment(3, namespace_modulo=True)


def test_numbered_namespaces_crowd_into_few_ranges() -> None:
    # FNV-1a's high bits barely change with a name's last characters: namespaces that differ
    # only in a number share a few ranges (docs/safety.md says so; a modulo spreads them).
    numbered = [f"team-{i}" for i in range(300)]
    ranges = {ShardAssignment(8, by_namespace=True).shard_of(f"{n}/o") for n in numbered}
    assert len(ranges) <= 4
    assert {ShardAssignment(8).shard_of(n) for n in numbered} == set(range(8))


@pytest.mark.parametrize("shards", [2, 3, 5, 7, 12, 1000, 1024])
def test_every_range_starts_and_ends_where_the_server_says(shards: int) -> None:
    for k in range(shards):
        start, end = hash_range(k, shards)
        assert range_of_hash(start, shards) == k
        assert range_of_hash(end - 1, shards) == k
        if k:
            assert range_of_hash(start - 1, shards) == k - 1
    # Where a plain h * n // 2**64 is one range too low (n not a power of two).
    assert range_of_hash(0x5555555555555555, 3) == 1 == 0x5555555555555555 * 3 // HASH_SPACE + 1
