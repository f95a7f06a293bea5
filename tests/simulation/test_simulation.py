"""The deterministic simulation: it replays exactly, its checker catches what it must,
and 400 schedules of the real Loop under the nemesis break no invariant."""

from __future__ import annotations

import pytest

from kopf_reconcile.testing.simulation import simulate
from kopf_reconcile.testing.simulation import stores as simulated
from kopf_reconcile.testing.simulation.checker import overlaps, stale_writes
from kopf_reconcile.testing.simulation.stores import Applied, Led
from kopf_reconcile.testing.simulation.world import Span

SCHEDULES = 400  # in CI; `make simulate SEEDS=100000` explores further


def test_a_seed_replays_exactly() -> None:
    first, second = simulate(7), simulate(7)
    assert first.schedule == second.schedule
    assert (first.writes, first.leaderships, first.violations) == (
        second.writes,
        second.leaderships,
        second.violations,
    )
    assert first.writes > 0 and first.leaderships > 1


def test_the_checker_sees_a_write_below_the_epoch_that_led_its_scope() -> None:
    history: list[Applied | Led] = [
        Led(1.0, "s", 2),
        Applied(2.0, "s", "never-written-by-2", 1, {}, "zombie"),
    ]
    assert stale_writes(history)


def test_the_checker_sees_two_replicas_inside_one_entity() -> None:
    spans = [Span("a", "writer", "x", 0.0, 2.0), Span("b", "writer", "x", 1.0, 3.0)]
    assert overlaps(spans, end_of_time=5.0)
    spans[0].exempt = True  # paused: outside what leases promise
    assert not overlaps(spans, end_of_time=5.0)


def test_the_simulation_finds_a_fence_that_lets_old_epochs_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = simulated.FenceStore.apply

    def per_entity_only(self: simulated.FenceStore, scope: str, *write: object) -> bool:
        self.led.pop(scope, None)  # forget the scope-wide fence
        return original(self, scope, *write)  # type: ignore[arg-type]

    monkeypatch.setattr(simulated.FenceStore, "apply", per_entity_only)
    assert any(not simulate(seed).held for seed in range(200))


@pytest.mark.timeout(600)
def test_400_schedules_break_no_invariant() -> None:
    broken = [outcome.report() for seed in range(SCHEDULES) if not (outcome := simulate(seed)).held]
    assert not broken, "\n".join(broken[:3])
