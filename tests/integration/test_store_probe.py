"""Readiness covers the database a replica needs to lead or write, with the watch probe's
hysteresis: a refusal at once, other failures after a few rounds."""

from __future__ import annotations

from typing import Any

import aiohttp

from kopf_reconcile.integration import probing
from kopf_reconcile.integration.endpoints import Endpoints
from kopf_reconcile.integration.probing import PeriodicProbe, StoreProbe, first_problem
from kopf_reconcile.integration.settings import Settings
from support import eventually

PASSWORD = "st0re-Pr0be-s3cret"
# Nothing listens on port 1: connecting fails at once, as with a network cut.
UNREACHABLE = f"postgresql://app:{PASSWORD}@127.0.0.1:1/app"


async def test_a_reachable_database_passes(dsn: str) -> None:
    assert await StoreProbe(dsn, "KOPF_RECONCILE_DATABASE_URL").check_once() is None


async def test_an_unreachable_database_is_named_without_its_password() -> None:
    problem = await StoreProbe(UNREACHABLE, "KOPF_RECONCILE_DATABASE_URL").check_once()
    assert problem is not None
    assert problem.startswith("PostgreSQL at postgresql://app:***@127.0.0.1:1/app cannot be")
    assert PASSWORD not in problem


async def test_a_refused_url_is_not_ready_at_once(dsn: str) -> None:
    base, query = dsn.split("?", 1)
    wrong = f"{base.rsplit('/', 1)[0]}/no_such_database?{query}"
    probe = StoreProbe(wrong, "KOPF_RECONCILE_DATABASE_URL", interval=60)
    await probe.start()
    try:
        await eventually(lambda: probe.rounds >= 1, message="one round")
        problem = probe.problem()
        assert problem is not None and "KOPF_RECONCILE_DATABASE_URL" in problem
        assert "refused by the database" in problem
    finally:
        await probe.stop()


class Scripted(PeriodicProbe):
    """Answers from a script; the last answer repeats."""

    subject = "the script"

    def __init__(self, answers: list[str | None]) -> None:
        super().__init__(interval=0.01)
        self.answers = answers

    async def check_once(self) -> str | None:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


async def test_a_ready_replica_turns_not_ready_after_transient_rounds(monkeypatch: Any) -> None:
    monkeypatch.setattr(probing, "RECHECK", 0.01)
    rounds = probing.TRANSIENT_ROUNDS
    probe = Scripted([None, *["timed out"] * (rounds - 1), None, *["timed out"] * rounds])
    seen: list[str | None] = []
    original = probe.check_once

    async def recorded() -> str | None:
        answer = await original()
        seen.append(probe.problem())
        return answer

    monkeypatch.setattr(probe, "check_once", recorded)
    await probe.start()
    try:
        await eventually(lambda: probe.problem() == "timed out", message="not ready")
        # Ready throughout the first run of failures, which stopped one round short.
        assert seen[: rounds + 1] == [seen[0], *[None] * rounds]
        assert probe.rounds >= 2 * rounds + 1
    finally:
        await probe.stop()


async def test_readyz_is_503_while_the_database_cannot_be_reached() -> None:
    store = StoreProbe(UNREACHABLE, "KOPF_RECONCILE_DATABASE_URL", interval=60)
    ready = Scripted([None])
    endpoints = Endpoints(
        "127.0.0.1", 0, ready=lambda: True, report=dict, problem=first_problem(ready, store)
    )
    url = await endpoints.start()
    await ready.start()
    await store.start()
    try:
        await eventually(lambda: store.rounds >= 1 and ready.rounds >= 1, message="checked")
        async with aiohttp.ClientSession() as http, http.get(f"{url}/readyz") as response:
            assert response.status == 503
            assert PASSWORD not in await response.text()
    finally:
        await store.stop()
        await ready.stop()
        await endpoints.stop()


def test_a_fenced_replica_probes_its_database() -> None:
    fenced = Settings.load({"KOPF_RECONCILE_DATABASE_URL": UNREACHABLE})
    assert [type(p) for p in fenced.store_probes()] == [StoreProbe]
    assert Settings.load({}).store_probes() == []
