"""Bad input and misuse around the operator: Leases and fence tables edited by hand, an
identity the API server refuses Leases to (rows of the "Bad input and misuse" table in
docs/reliability.md).

Leader election trusts its store and fencing trusts its tables (docs/safety.md, "Who
must not edit what"); these rows pin down what happens when someone edits them anyway:
the elector never crashes and never leads at an epoch below one that led, a refusal
is logged on one line with the server's words and counted as permanent, and a fence
table that cannot take a write fails that write loudly (nothing is reported applied
that was not) until it is repaired, after which every entity converges.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from prometheus_client import CollectorRegistry

import kopf_reconcile as kr
from kopf_reconcile.database import check_database
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.loop import Loop
from kopf_reconcile.testing.memory import MemoryFencedRepository
from kopf_reconcile.testing.real_apiserver import RealCluster
from support import eventually

RID = "devices"
MERGE = {"Content-Type": "application/merge-patch+json"}


def lease_path(namespace: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{RID}"


def loop_of(
    reconcile: Callable[[kr.Request], Awaitable[None]],
    elector: object,
    repo: object,
    registry: CollectorRegistry | None = None,
) -> Loop:
    builder = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(elector)  # type: ignore[arg-type]
        .with_fenced_repo(repo)  # type: ignore[arg-type]
        .with_reconciler_id(RID)
        .with_renew_interval(0.2)
        .with_backoff(0.01, 0.2)
        .with_stop_timeout(2)
        .without_default_requeue()
    )
    if registry is not None:
        builder.with_metrics(kr.register_metrics(registry))
    return builder.build()


async def noop(req: kr.Request) -> None:
    return None


# -- an identity that may not use Leases ------------------------------------------------------


@pytest.mark.real_apiserver
async def test_leases_forbidden_by_rbac_are_an_error_each_attempt_counted_as_permanent(
    real_cluster: RealCluster, caplog: pytest.LogCaptureFixture
) -> None:
    registry = CollectorRegistry()
    api = real_cluster.api_client(unprivileged=True)
    elector = KubernetesLeaseElector(namespace="default", ttl=3, api=api)
    loop = loop_of(noop, elector, MemoryFencedRepository(), registry)

    def permanent() -> float:
        labels = {"controller": loop.reconciler_id, "shard": ""}
        return registry.get_sample_value("kopf_reconcile_lease_permanent_errors_total", labels) or 0

    caplog.set_level(logging.WARNING, logger="kopf_reconcile.leader")
    try:
        async with loop:
            await eventually(lambda: permanent() >= 2, timeout=15)
            assert not loop.stats().is_leader
    finally:
        await api.close()
    records = [r for r in caplog.records if f"acquiring lease {RID}" in r.getMessage()]
    assert records, caplog.text
    assert all(r.levelno == logging.ERROR for r in records), records  # not a mere warning
    lines = [r.getMessage() for r in records]
    for line in lines:
        assert "ApiException: 403 Forbidden: " in line, line
        assert 'cannot get resource "leases"' in line, line
        assert "retrying cannot help until this is fixed" in line, line


# -- Leases edited by hand --------------------------------------------------------------------


async def put_lease(kube: Any, namespace: str, spec: dict[str, Any] | None) -> tuple[int, str]:
    """Create (or replace) the reconciler's Lease with ``spec`` as someone would by hand."""
    body: dict[str, Any] = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": RID, "namespace": namespace},
    }
    if spec is not None:
        body["spec"] = spec
    async with kube.http_session() as http:
        async with http.get(lease_path(namespace)) as response:
            if response.status == 200:
                body["metadata"]["resourceVersion"] = (await response.json())["metadata"][
                    "resourceVersion"
                ]
                async with http.put(lease_path(namespace), json=body) as written:
                    return written.status, await written.text()
        collection = lease_path(namespace).rsplit("/", 1)[0]
        async with http.post(collection, json=body) as written:
            return written.status, await written.text()


def now_micro() -> str:
    import datetime

    from kopf_reconcile.leader.kubernetes import format_micro_time

    return format_micro_time(datetime.datetime.now(datetime.UTC))


HAND_EDITED = {
    "no-spec": None,
    "empty-spec": {},
    "holder-only": {"holderIdentity": "someone"},
    "garbage-holder": {
        "holderIdentity": "\x1b[2J\u202e\U0001f4a5 not a replica " + "x" * 2000,
        "leaseDurationSeconds": 1,
        "leaseTransitions": 4,
        "renewTime": "now",
    },
}


@pytest.mark.parametrize("edit", list(HAND_EDITED), ids=list(HAND_EDITED))
async def test_a_hand_made_lease_is_taken_over_above_every_epoch_known_without_a_crash(
    kube: Any, api: Any, kube_namespace: str, edit: str
) -> None:
    spec = HAND_EDITED[edit]
    if spec is not None and spec.get("renewTime") == "now":
        spec = {**spec, "renewTime": now_micro()}
    status, text = await put_lease(kube, kube_namespace, spec)
    assert status == 201, text
    repo = MemoryFencedRepository()
    repo.recorded_epoch = 7  # epochs up to 7 have led this scope
    led: list[int] = []

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id == "":
            return
        writer = kr.fenced_writer()
        assert writer is not None
        led.append(writer.epoch)
        await writer.write("x", {"by": writer.epoch})

    # A TTL of 2 s: a Lease that names a holder is waited out for (its duration, or
    # ours when it has none) as observed here, then taken over.
    elector = KubernetesLeaseElector(namespace=kube_namespace, ttl=2, api=api)
    loop = loop_of(reconcile, elector, repo)
    async with loop:
        await eventually(lambda: loop.stats().is_leader, timeout=15)
        await loop.enqueue(kr.Request("x"))
        await eventually(lambda: repo.states.get("x") is not None, timeout=10)
    assert loop.stats().epoch == 8  # above the floor (7) and the Lease's transitions
    assert set(led) == {8}


@pytest.mark.parametrize(
    "edit",
    [
        ("leaseDurationSeconds", -5, "must be greater than 0"),
        ("leaseDurationSeconds", 0, "must be greater than 0"),
        ("leaseTransitions", -1, "must be greater than or equal to 0"),
    ],
    ids=["negative-duration", "zero-duration", "negative-transitions"],
)
async def test_a_negative_lease_field_is_refused_by_the_api_and_the_leader_keeps_leading(
    kube: Any, api: Any, kube_namespace: str, edit: tuple[str, int, str]
) -> None:
    field, value, message = edit
    elector = KubernetesLeaseElector(namespace=kube_namespace, ttl=3, api=api)
    loop = loop_of(noop, elector, MemoryFencedRepository())
    async with loop:
        await eventually(lambda: loop.stats().is_leader, timeout=15)
        epoch = loop.stats().epoch
        async with (
            kube.http_session() as http,
            http.patch(
                lease_path(kube_namespace), json={"spec": {field: value}}, headers=MERGE
            ) as response,
        ):
            assert response.status == 422, await response.text()
            assert message in await response.text()
        await asyncio.sleep(1)  # renewals continue (every 0.2 s)
        assert loop.stats().is_leader and loop.stats().epoch == epoch


# -- PostgreSQL lease rows edited by hand -----------------------------------------------------


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE kopf_reconcile_lease SET holder_id = E'\\\\x1b[2J garbage', "
        "expires_at = now() - interval '1 hour'",
        "UPDATE kopf_reconcile_lease SET expires_at = now() - interval '100 years'",
        "UPDATE kopf_reconcile_lease SET epoch = 3",
    ],
    ids=["garbage-holder", "expired-a-century-ago", "epoch-lowered"],
)
async def test_a_hand_edited_lease_row_never_leads_below_an_epoch_that_led(
    dsn: str, edit: str
) -> None:
    repo = PostgresFencedRepository(dsn)
    elector = PostgresLeaseElector(dsn, ttl=2)
    other = PostgresLeaseElector(dsn, ttl=2)
    epochs: list[int] = []

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id == "":
            return
        writer = kr.fenced_writer()
        assert writer is not None
        epochs.append(writer.epoch)
        await writer.write(req.entity_id, {"epoch": writer.epoch})

    try:
        first = loop_of(reconcile, elector, repo)
        async with first:
            await eventually(lambda: first.stats().is_leader, timeout=10)
            for epoch in range(2, 6):  # take the epoch up to 5 by handovers
                first._holder.step_down_soon("a handover")  # type: ignore[union-attr]
                await eventually(
                    lambda e=epoch: first.stats().is_leader and first.stats().epoch == e,  # type: ignore[misc]
                    timeout=10,
                )
            await first.enqueue(kr.Request("x"))
            await eventually(lambda: bool(epochs), timeout=10)
        high = max(epochs)
        connection = await asyncpg.connect(dsn)
        try:
            await connection.execute(edit)
        finally:
            await connection.close()
        second = loop_of(reconcile, other, PostgresFencedRepository(dsn))
        async with second:
            await eventually(lambda: second.stats().is_leader, timeout=15)
            await second.enqueue(kr.Request("x"))
            await eventually(lambda: len(epochs) >= 2, timeout=10)
            assert second.stats().epoch > high
        assert epochs[-1] > high
    finally:
        await repo.close()
        await elector.close()
        await other.close()


# -- fence tables edited by hand ------------------------------------------------------------


async def sql(dsn: str, statement: str) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


@pytest.mark.parametrize(
    "column",
    [
        ("kopf_reconcile_fence", "state", "jsonb"),
        ("kopf_reconcile_fence", "last_epoch", "bigint NOT NULL DEFAULT 0"),
        ("kopf_reconcile_fence_epochs", "epoch", "bigint NOT NULL DEFAULT 0"),
    ],
    ids=lambda column: ".".join(column[:2]),
)
async def test_a_dropped_fence_column_fails_writes_loudly_until_it_is_restored(
    dsn: str, column: tuple[str, str, str], caplog: pytest.LogCaptureFixture
) -> None:
    table, name, definition = column
    repo = PostgresFencedRepository(dsn)
    elector = PostgresLeaseElector(dsn, ttl=3)
    desired = {"x": 1, "y": 1}

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id == "":
            return
        writer = kr.fenced_writer()
        assert writer is not None
        await writer.write(req.entity_id, {"v": desired[req.entity_id]})

    try:
        loop = loop_of(reconcile, elector, repo)
        async with loop:
            await eventually(lambda: loop.stats().is_leader, timeout=10)
            await loop.enqueue(kr.Request("x"))
            await eventually(lambda: _state(repo, "x", {"v": 1}), timeout=10)
            await sql(dsn, f"ALTER TABLE {table} DROP COLUMN {name}")
            desired.update(x=2, y=2)
            await loop.enqueue(kr.Request("x"))
            await loop.enqueue(kr.Request("y"))
            await eventually(
                lambda: (
                    f'UndefinedColumnError: column "{name}"' in caplog.text
                    or f'UndefinedColumnError(\'column "{name}"' in caplog.text
                ),
                timeout=10,
            )
            assert "'x' by reconcile failed; retrying in" in caplog.text
            assert loop.stats().is_leader  # a broken table is not a lost lease
            await sql(dsn, f"ALTER TABLE {table} ADD COLUMN {name} {definition}")
            await eventually(lambda: _state(repo, "x", {"v": 2}), timeout=10)
            await eventually(lambda: _state(repo, "y", {"v": 2}), timeout=10)
    finally:
        await repo.close()
        await elector.close()


async def _state(repo: PostgresFencedRepository, entity: str, expected: object) -> bool:
    try:
        return await repo.get_state(entity) == expected
    except asyncpg.PostgresError:
        return False


async def test_an_absurd_last_epoch_on_one_row_costs_one_handover_and_nothing_else(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    repo = PostgresFencedRepository(dsn)
    elector = PostgresLeaseElector(dsn, ttl=3)
    entities = [f"e{i}" for i in range(5)]

    async def reconcile(req: kr.Request) -> None:
        if req.entity_id == "":
            return
        writer = kr.fenced_writer()
        assert writer is not None
        await writer.write(req.entity_id, {"epoch": writer.epoch})

    try:
        loop = loop_of(reconcile, elector, repo)
        async with loop:
            await eventually(lambda: loop.stats().is_leader, timeout=10)
            for entity in entities:
                await loop.enqueue(kr.Request(entity))
            await eventually(lambda: _state(repo, "e4", {"epoch": 1}), timeout=10)
            absurd = 1_000_000_000
            await sql(
                dsn,
                f"UPDATE kopf_reconcile_fence SET last_epoch = {absurd} WHERE entity_id = 'e0'",
            )
            for entity in entities:
                await loop.enqueue(kr.Request(entity))

            async def all_written_above() -> bool:
                for entity in entities:
                    state = await repo.get_state(entity)
                    if not state or state["epoch"] <= absurd:
                        return False
                return True

            await eventually(all_written_above, timeout=20)
            assert loop.stats().epoch == absurd + 1
    finally:
        await repo.close()
        await elector.close()
    assert "was fenced" in caplog.text


async def test_a_fence_row_at_the_bigint_bound_stops_leadership_with_a_repair_message(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    repo = PostgresFencedRepository(dsn)
    await repo.migrate()
    await sql(
        dsn,
        "INSERT INTO kopf_reconcile_fence (scope, entity_id, tenant, last_epoch) "
        f"VALUES ('{RID}', 'e0', '_notenant', {2**63 - 1})",
    )
    elector = PostgresLeaseElector(dsn, ttl=3)
    registry = CollectorRegistry()
    caplog.set_level(logging.WARNING, logger="kopf_reconcile.leader")
    try:
        loop = loop_of(noop, elector, repo, registry)

        def permanent() -> float:
            labels = {"controller": loop.reconciler_id, "shard": ""}
            sample = "kopf_reconcile_lease_permanent_errors_total"
            return registry.get_sample_value(sample, labels) or 0

        async with loop:
            await eventually(lambda: permanent() >= 1, timeout=10)
            assert not loop.stats().is_leader
    finally:
        await repo.close()
        await elector.close()
    records = [r for r in caplog.records if "LeaseEpochExhausted" in r.getMessage()]
    assert records and all(r.levelno == logging.ERROR for r in records), caplog.text
    message = records[0].getMessage()
    assert "lower the fenced store's epochs for this scope" in message, message
    assert "retrying cannot help until the record is repaired" in message, message


# -- the database check at startup ----------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("postgresql://postgres@", "postgresql://nobody@"), 'role "nobody" does not exist'),
        (("@/test_", "@/missing_"), "InvalidCatalogNameError: database"),
    ],
    ids=["unknown-role", "unknown-database"],
)
async def test_a_url_the_database_refuses_is_a_configuration_error_naming_it(
    dsn: str, change: tuple[str, str], expected: str
) -> None:
    wrong = dsn.replace(*change)
    assert wrong != dsn
    with pytest.raises(kr.ConfigError) as raised:
        await check_database(wrong, "KOPF_RECONCILE_DATABASE_URL", 5)
    assert str(raised.value).startswith("KOPF_RECONCILE_DATABASE_URL (postgresql://")
    assert "is refused by the database" in str(raised.value)
    assert expected in str(raised.value)
    assert await check_database(dsn, "KOPF_RECONCILE_DATABASE_URL", 5) is None


async def test_a_database_that_does_not_answer_is_reported_not_refused() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dsn = f"postgresql://app:s3cret@127.0.0.1:{port}/app"
    problem = await check_database(dsn, "KOPF_RECONCILE_DATABASE_URL", 5)
    assert problem is not None and "Connect call failed" in problem, problem
    assert "s3cret" not in problem
