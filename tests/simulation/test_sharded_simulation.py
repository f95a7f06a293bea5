"""The simulation with a sharded writer: one lease and fencing scope per shard, replicas
joining, crashing and handing shards off under the nemesis, and the same invariants.

A hand-off that releases a shard's lease while its reconciles still run (and its Loop
still dispatches) is caught: the checker sees two replicas inside one entity.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kopf_reconcile.fencing.protocol import ShardLayoutError
from kopf_reconcile.loop import Loop
from kopf_reconcile.tenancy import Tenancy
from kopf_reconcile.testing.simulation import Settings, simulate
from kopf_reconcile.testing.simulation.__main__ import main
from kopf_reconcile.testing.simulation.stores import FenceStore, StoreRepository

SHARDED_SCHEDULES = 100
SHARDED = Settings(shards=3)


def test_a_sharded_seed_replays_exactly() -> None:
    first, second = simulate(3, SHARDED), simulate(3, SHARDED)
    assert first.schedule == second.schedule
    assert (first.writes, first.leaderships) == (second.writes, second.leaderships)


def test_shards_are_handed_off_during_the_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    hand_offs = 0
    original = Loop.hand_off

    async def counted(self: Loop, grace: float) -> None:
        nonlocal hand_offs
        hand_offs += 1
        await original(self, grace)

    monkeypatch.setattr(Loop, "hand_off", counted)
    assert all(simulate(seed, SHARDED).held for seed in range(10))
    assert hand_offs > 0  # replicas that join take shards from the others


def test_the_simulation_finds_a_hand_off_that_releases_under_running_reconciles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def release_at_once(self: Loop, grace: float) -> None:
        holder = self._holder
        if holder is not None and holder.leading:
            leader = self._config.leader
            assert leader is not None
            # Released while it still dispatches and its reconciles still run.
            await leader.release_lease(holder._token)  # type: ignore[arg-type]

    monkeypatch.setattr(Loop, "hand_off", release_at_once)
    assert any(not simulate(seed, SHARDED).held for seed in range(100))


@pytest.mark.timeout(600)
def test_sharded_schedules_break_no_invariant() -> None:
    broken = [
        outcome.report()
        for seed in range(SHARDED_SCHEDULES)
        if not (outcome := simulate(seed, SHARDED)).held
    ]
    assert not broken, "\n".join(broken[:3])


async def test_the_simulated_store_checks_layouts_as_the_real_one() -> None:
    async def direct(_: str, effect: Callable[[], object]) -> object:
        return effect()

    store = FenceStore(clock=lambda: 0.0)
    base = StoreRepository(store, "a", direct, write_timeout=1.0)
    base.bind_loop(reconciler_id="writer", tenancy=Tenancy.SINGLE_TENANT)
    shard = base.for_shard(1)
    shard.bind_loop(reconciler_id="writer-shard-1", tenancy=Tenancy.SINGLE_TENANT)
    with pytest.raises(ShardLayoutError, match="layout was not recorded"):
        await shard.record_epoch(1, "a")
    await base.record_shard_count(3)
    await shard.record_epoch(1, "a")

    other = StoreRepository(store, "b", direct, write_timeout=1.0)
    other.bind_loop(reconciler_id="writer", tenancy=Tenancy.SINGLE_TENANT)
    with pytest.raises(ShardLayoutError, match="writer/shards=3"):
        await other.record_shard_count(4)  # another count against the recorded one
    with pytest.raises(ShardLayoutError, match="writer/shards=3"):
        await other.record_epoch(1, "b")  # unsharded, against a sharded scope

    store.led["writer"] = (0, "writer/shards=4")  # as a reshard leaves the base scope
    with pytest.raises(ShardLayoutError, match="records the layout 'writer/shards=4'"):
        await shard.record_epoch(2, "a")
    assert store.led["writer-shard-1"][0] == 1  # the refused epoch was not recorded


def test_the_command_line_explores_sharded_schedules(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seeds", "2", "--start", "5", "--shards", "3"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("2 schedules (seeds 5..6)")
    assert "3 shard(s), 3 replicas" in summary
    assert "broken: none" in summary
    with pytest.raises(SystemExit):
        main(["--shards", "0"])
    assert "--shards and --replicas must be at least 1" in capsys.readouterr().err
