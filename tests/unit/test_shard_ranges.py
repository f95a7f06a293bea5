"""KEP-5866's hash ranges and selectors, which names belong to a reconciler, and the
leases a layout change retires."""

from __future__ import annotations

import random

import pytest

from kopf_reconcile.control.layout_wait import LAYOUT_RETRY_MAX, LayoutRefused, LayoutWait
from kopf_reconcile.integration.cli import retired_leases
from kopf_reconcile.sharding import (
    HASH_SPACE,
    NAMESPACE_FIELD,
    UID_FIELD,
    fnv1a_64,
    hash_range,
    of_reconciler,
    range_of,
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
