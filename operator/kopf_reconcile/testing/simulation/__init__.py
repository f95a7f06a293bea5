"""Deterministic simulation of several replicas under a seeded nemesis.

Scripted failover tests prove the scenarios someone thought of. This runs the
real :class:`~kopf_reconcile.Loop`, its lease control plane, its fenced
writer and work queue — not copies — as several replicas in one process on
virtual time (:mod:`.virtual_time`), against in-memory stores that keep the
real stores' semantics (:mod:`.stores`), while a nemesis chosen by a seed
delays, fails, hangs and duplicates their calls, pauses, crashes and restarts
them, and deletes lease records (:mod:`.world`). The invariants are judged
from the stores' history alone (:mod:`.checker`).

One seed is one schedule: ``simulate(seed)`` replays it. A failing run's
report carries its seed and the nemesis' schedule. Run many from the command
line: ``python -m kopf_reconcile.testing.simulation --seeds 1000``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from kopf_reconcile.testing.simulation.checker import check
from kopf_reconcile.testing.simulation.stores import Applied
from kopf_reconcile.testing.simulation.virtual_time import VirtualTimeLoop
from kopf_reconcile.testing.simulation.world import Action, Settings, World

__all__ = ["Outcome", "Settings", "simulate"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one seed's run showed."""

    seed: int
    violations: list[str]
    schedule: list[Action]
    writes: int
    leaderships: int
    virtual_seconds: float

    @property
    def held(self) -> bool:
        return not self.violations

    def report(self) -> str:
        lines = [f"seed {self.seed}: {'held' if self.held else 'BROKEN'}"]
        lines += [f"  {violation}" for violation in self.violations]
        if not self.held:
            lines.append(f"  schedule (replay: simulate({self.seed})):")
            lines += [f"    {action}" for action in self.schedule]
        return "\n".join(lines)


def simulate(seed: int, settings: Settings | None = None) -> Outcome:
    """Run one seeded schedule to the end and check every invariant."""
    settings = settings or Settings()
    quiet = logging.getLogger("kopf_reconcile")
    level, quiet.level = quiet.level, logging.CRITICAL  # thousands of expected failures
    try:
        with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
            return runner.run(_run(seed, settings))
    finally:
        quiet.setLevel(level)


async def _run(seed: int, settings: Settings) -> Outcome:
    world = World(seed, settings)
    await world.run()
    await asyncio.sleep(0)
    current = asyncio.current_task()
    leftovers = [repr(task) for task in asyncio.all_tasks() if task is not current]
    spans = [span for replica in world.replicas + world.retired for span in replica.spans]
    violations = check(
        fence=world.fence,
        spans=spans,
        desired=world.desired,
        end_of_time=world.clock(),
        leftovers=leftovers,
    )
    return Outcome(
        seed=seed,
        violations=violations,
        schedule=world.schedule,
        writes=sum(1 for event in world.fence.history if isinstance(event, Applied)),
        leaderships=len({(g.reconciler_id, g.epoch) for g in world.leases.history}),
        virtual_seconds=world.clock(),
    )
