"""PostgresLeaseElector on a real PostgreSQL: contention, epochs, renewal, release, expiry.

Every test gets a database of its own on the session's PostgreSQL server.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest
import pytest_asyncio

from kopf_reconcile.api import ConfigError
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.leader.protocol import (
    LeaderElector,
    LeaseContended,
    LeaseLost,
    LeaseToken,
    LeaseTTL,
)

RECONCILER = "devices"
LONG_TTL = LeaseTTL(60)
SHORT_TTL = LeaseTTL(0.2)

ElectorFactory = Callable[..., Awaitable[PostgresLeaseElector]]


@pytest_asyncio.fixture
async def elector(dsn: str) -> AsyncIterator[ElectorFactory]:
    """Make electors on the test's database, each with its own pool; all closed afterwards."""
    made: list[PostgresLeaseElector] = []

    async def make(ttl: LeaseTTL = LONG_TTL, **options: object) -> PostgresLeaseElector:
        made.append(PostgresLeaseElector(dsn, ttl=ttl, **options))  # type: ignore[arg-type]
        return made[-1]

    yield make
    await asyncio.gather(*(each.close() for each in made))


async def lease_row(dsn: str) -> asyncpg.Record:
    connection = await asyncpg.connect(dsn)
    try:
        row = await connection.fetchrow(
            "SELECT *, clock_timestamp() AS db_now FROM kopf_reconcile_lease "
            "WHERE reconciler_id = $1",
            RECONCILER,
        )
    finally:
        await connection.close()
    assert row is not None
    return row


async def acquire_after_expiry(elector: PostgresLeaseElector, timeout: float = 10.0) -> LeaseToken:
    """Poll acquire until the current holder's lease expires (by the database clock)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await elector.acquire_lease(RECONCILER)
        except LeaseContended:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.02)


def test_it_is_a_leader_elector() -> None:
    assert isinstance(PostgresLeaseElector("postgresql://localhost/db"), LeaderElector)


async def test_a_second_elector_is_told_who_holds_the_lease(elector: ElectorFactory) -> None:
    first, second = await elector(), await elector()
    token = await first.acquire_lease(RECONCILER)
    assert (token.reconciler_id, token.holder_id, token.epoch) == (RECONCILER, first.holder_id, 1)
    assert token.acquired_at.tzinfo is not None and token.expires_at.tzinfo is not None
    assert token.expires_at - token.acquired_at == datetime.timedelta(seconds=60)

    with pytest.raises(LeaseContended) as contended:
        await second.acquire_lease(RECONCILER)
    message = str(contended.value)
    assert first.holder_id in message and token.expires_at.isoformat() in message


async def test_three_contenders_get_exactly_one_holder_and_a_new_epoch_per_handover(
    elector: ElectorFactory, dsn: str
) -> None:
    contenders = [await elector() for _ in range(3)]
    epochs: list[int] = []
    for _ in range(30):
        outcomes = await asyncio.gather(
            *(contender.acquire_lease(RECONCILER) for contender in contenders),
            return_exceptions=True,
        )
        tokens = [outcome for outcome in outcomes if isinstance(outcome, LeaseToken)]
        assert len(tokens) == 1, outcomes
        assert all(
            isinstance(outcome, LeaseContended) for outcome in outcomes if outcome is not tokens[0]
        ), outcomes
        [token] = tokens
        assert (await lease_row(dsn))["holder_id"] == token.holder_id
        epochs.append(token.epoch)
        await contenders[outcomes.index(token)].release_lease(token)
    assert epochs == list(range(1, 31))


async def test_the_epoch_grows_on_every_change_of_holder_and_never_goes_back(
    elector: ElectorFactory,
) -> None:
    a, b, c = await elector(), await elector(ttl=SHORT_TTL), await elector()
    token_a = await a.acquire_lease(RECONCILER)
    assert token_a.epoch == 1
    assert (await a.acquire_lease(RECONCILER)).epoch == 1  # the same holder again
    await a.release_lease(token_a)

    token_b = await b.acquire_lease(RECONCILER)  # after a release
    assert token_b.epoch == 2
    token_c = await acquire_after_expiry(c)  # after b's lease expired
    assert token_c.epoch == 3
    await c.release_lease(token_c)
    assert (await a.acquire_lease(RECONCILER)).epoch == 4  # a former holder comes back


async def test_renewal_extends_the_lease_and_keeps_the_epoch(
    elector: ElectorFactory, dsn: str
) -> None:
    a = await elector()
    token = await a.acquire_lease(RECONCILER)
    expiries = [(await lease_row(dsn))["expires_at"]]
    for _ in range(3):
        await a.renew_lease(token)
        row = await lease_row(dsn)
        assert (row["holder_id"], row["epoch"]) == (a.holder_id, token.epoch)
        expiries.append(row["expires_at"])
    assert expiries == sorted(expiries) and expiries[0] < expiries[-1]
    assert (await lease_row(dsn))["acquired_at"] == token.acquired_at


async def test_renewal_after_expiry_is_lease_lost(elector: ElectorFactory, dsn: str) -> None:
    a = await elector(ttl=SHORT_TTL)
    token = await a.acquire_lease(RECONCILER)

    async def expired() -> bool:
        row = await lease_row(dsn)
        return bool(row["db_now"] >= row["expires_at"])

    deadline = asyncio.get_running_loop().time() + 10
    while not await expired():
        assert asyncio.get_running_loop().time() < deadline, "lease never expired"
        await asyncio.sleep(0.02)

    with pytest.raises(LeaseLost, match="expired"):
        await a.renew_lease(token)


async def test_renewal_after_a_takeover_is_lease_lost_and_names_the_new_holder(
    elector: ElectorFactory,
) -> None:
    a, b = await elector(ttl=SHORT_TTL), await elector()
    token_a = await a.acquire_lease(RECONCILER)
    token_b = await acquire_after_expiry(b)

    with pytest.raises(LeaseLost, match=b.holder_id):
        await a.renew_lease(token_a)
    # Expiry was judged by the database clock: no takeover before the old expiry.
    assert token_b.acquired_at >= token_a.expires_at
    assert token_b.epoch == token_a.epoch + 1


async def test_a_token_from_an_older_epoch_can_neither_renew_nor_release(
    elector: ElectorFactory, dsn: str
) -> None:
    a, b = await elector(), await elector()
    old = await a.acquire_lease(RECONCILER)
    await a.release_lease(old)
    await b.release_lease(await b.acquire_lease(RECONCILER))
    current = await a.acquire_lease(RECONCILER)  # the same holder, two handovers later
    assert current.epoch == old.epoch + 2

    with pytest.raises(LeaseLost):
        await a.renew_lease(old)
    await a.release_lease(old)
    row = await lease_row(dsn)
    assert (row["holder_id"], row["epoch"]) == (a.holder_id, current.epoch)
    await a.renew_lease(current)


async def test_release_hands_over_at_once_and_is_idempotent(
    elector: ElectorFactory, dsn: str
) -> None:
    a, b = await elector(), await elector()
    token_a = await a.acquire_lease(RECONCILER)
    with pytest.raises(LeaseContended):
        await b.acquire_lease(RECONCILER)

    await a.release_lease(token_a)
    await a.release_lease(token_a)  # again: not an error
    token_b = await b.acquire_lease(RECONCILER)  # at once, not after the 60 s TTL
    assert token_b.epoch == token_a.epoch + 1

    await a.release_lease(token_a)  # releasing a lost lease: not an error, and harmless
    row = await lease_row(dsn)
    assert (row["holder_id"], row["epoch"]) == (b.holder_id, token_b.epoch)
    await b.renew_lease(token_b)
    with pytest.raises(LeaseLost):
        await a.renew_lease(token_a)


async def test_leases_of_different_reconcilers_are_independent(elector: ElectorFactory) -> None:
    a, b = await elector(), await elector()
    assert (await a.acquire_lease("devices")).epoch == 1
    assert (await b.acquire_lease("gadgets")).epoch == 1
    with pytest.raises(LeaseContended):
        await b.acquire_lease("devices")


async def test_schema_creation_is_idempotent_and_safe_when_concurrent(
    elector: ElectorFactory,
) -> None:
    electors = [await elector() for _ in range(8)]
    await asyncio.gather(*(each.migrate() for each in electors))
    await electors[0].migrate()
    assert (await electors[1].acquire_lease(RECONCILER)).epoch == 1


async def test_a_borrowed_pool_is_shared_and_left_open(dsn: str) -> None:
    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        a = PostgresLeaseElector(pool, ttl=LONG_TTL)
        b = PostgresLeaseElector(pool, ttl=LONG_TTL)
        token = await a.acquire_lease(RECONCILER)
        with pytest.raises(LeaseContended):
            await b.acquire_lease(RECONCILER)
        await a.close()
        assert not pool.is_closing()
        await b.renew_lease(token)  # any elector's pool can renew a token: the row decides
        with pytest.raises(RuntimeError, match="closed"):
            await a.acquire_lease(RECONCILER)


def test_holder_ids_are_unique_per_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "devices-7d4f9")
    first = PostgresLeaseElector("postgresql://localhost/db")
    second = PostgresLeaseElector("postgresql://localhost/db")
    assert first.holder_id.startswith("devices-7d4f9-")
    assert second.holder_id.startswith("devices-7d4f9-")
    assert first.holder_id != second.holder_id
    assert PostgresLeaseElector("postgresql://localhost/db", holder_id="fixed").holder_id == "fixed"


@pytest.mark.parametrize(
    "options",
    [
        {"ttl": 0.0001},
        {"ttl": LeaseTTL(1), "holder_id": ""},
        {"ttl": LeaseTTL(1), "table": "lease; DROP TABLE x"},
    ],
    ids=["sub-millisecond-ttl", "empty-holder", "bad-table"],
)
def test_bad_configuration_is_a_config_error(options: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PostgresLeaseElector("postgresql://localhost/db", **options)  # type: ignore[arg-type]


def test_a_bad_dsn_is_a_config_error_that_does_not_show_the_password() -> None:
    with pytest.raises(ConfigError) as error:
        PostgresLeaseElector("mysql://admin:hunter2@db/leases")
    assert "hunter2" not in str(error.value) and "admin:***@db" in str(error.value)
    elector = PostgresLeaseElector("postgresql://admin:hunter2@db/leases?sslpassword=s3cret")
    assert "hunter2" not in repr(elector) and "s3cret" not in repr(elector)


# -- separate processes ---------------------------------------------------------------------

# A contender in its own process: acquire, keep renewing, report every change on stdout.
CONTENDER = """
import asyncio, sys
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.leader.protocol import LeaseContended, LeaseLost

async def main(dsn):
    async with PostgresLeaseElector(dsn, ttl=1.0) as elector:
        while True:
            try:
                token = await elector.acquire_lease("devices")
            except LeaseContended:
                await asyncio.sleep(0.05)
                continue
            print("acquired", token.epoch, elector.holder_id, flush=True)
            try:
                while True:
                    await asyncio.sleep(0.2)
                    await elector.renew_lease(token)
            except LeaseLost:
                print("lost", token.epoch, flush=True)

asyncio.run(main(sys.argv[1]))
"""


class Contender:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, dsn: str) -> Contender:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CONTENDER, dsn, stdout=asyncio.subprocess.PIPE
        )
        return cls(process)

    async def next_event(self, timeout: float = 10.0) -> list[str]:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        assert line, f"contender {self.process.pid} exited ({self.process.returncode})"
        return line.decode().split()

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()


@pytest.mark.slow
async def test_processes_take_over_from_a_paused_and_from_a_killed_holder(dsn: str) -> None:
    first = await Contender.start(dsn)
    second: Contender | None = None
    try:
        assert (await first.next_event())[:2] == ["acquired", "1"]
        second = await Contender.start(dsn)

        first.signal(signal.SIGSTOP)  # paused past its TTL: the other process takes over
        event, epoch, holder = await second.next_event()
        assert (event, epoch) == ("acquired", "2")
        first.signal(signal.SIGCONT)  # the paused holder learns it lost, at its next renewal
        assert await first.next_event() == ["lost", "1"]

        await second.kill()  # killed without a release: taken over once its lease expires
        event, epoch, new_holder = await first.next_event()
        assert (event, epoch) == ("acquired", "3") and new_holder != holder
    finally:
        for contender in (first, second):
            if contender is not None:
                await contender.kill()


async def test_the_elector_lists_its_leases_and_creates_no_table_to_do_so(
    elector: ElectorFactory,
) -> None:
    reader = await elector()
    assert await reader.list_leases() == []  # no table yet: nothing, and none made
    holder = await elector()
    token = await holder.acquire_lease(RECONCILER)
    (record,) = await reader.list_leases()
    assert (record.namespace, record.reconciler_id, record.holder_id, record.epoch) == (
        None,
        RECONCILER,
        holder.holder_id,
        token.epoch,
    )
    assert record.acquired_at is not None and record.expires_at is not None
    await holder.release_lease(token)
    (released,) = await reader.list_leases()
    assert released.holder_id == "" and released.epoch == token.epoch
