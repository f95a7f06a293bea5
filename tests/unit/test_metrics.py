"""Prometheus instruments: names, labels, buckets, zero-initialised series."""

from __future__ import annotations

import asyncio

import prometheus_client

import kopf_reconcile as kr
from kopf_reconcile.metrics import RECONCILE_TIME_BUCKETS, RESULTS
from kopf_reconcile.sharded_loop import ShardedLoop
from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore
from support import eventually

HISTOGRAM_SAMPLES = ("_bucket", "_sum", "_count")


def sample(
    registry: prometheus_client.CollectorRegistry, metric: str, **labels: str
) -> float | None:
    """A sample's value; counters and gauges of an unsharded Loop carry ``shard=""``."""
    if not metric.endswith(HISTOGRAM_SAMPLES):
        labels.setdefault("shard", "")
    return registry.get_sample_value(f"kopf_reconcile_{metric}", labels)


async def test_every_series_is_initialised_to_zero_at_start() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = kr.register_metrics(registry)

    async def reconcile(req: kr.Request) -> None:
        return None

    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_metrics(metrics)
        .with_name("devices")
        .with_concurrency(3)
        .build()
    )
    async with loop:
        for result in RESULTS:
            assert sample(registry, "reconcile_total", controller="devices", result=result) == 0
        for outcome in ("accepted", "stale", "error"):
            assert (
                sample(registry, "fenced_writes_total", controller="devices", outcome=outcome) == 0
            )
        for metric in ("reconcile_errors_total", "lease_transitions_total", "lease_errors_total"):
            assert sample(registry, metric, controller="devices") == 0
        for metric in ("workqueue_adds_total", "workqueue_retries_total"):
            assert sample(registry, metric, name="devices") == 0
        assert sample(registry, "workqueue_depth", name="devices") == 0
        assert sample(registry, "active_workers", controller="devices") == 0
        assert sample(registry, "dead_letter_entities", controller="devices") == 0
        assert sample(registry, "epoch", controller="devices") == 0
        assert sample(registry, "max_concurrent_reconciles", controller="devices") == 3
        assert sample(registry, "leader", controller="devices") == 1


async def test_outcomes_are_counted() -> None:
    registry = prometheus_client.CollectorRegistry()
    failures = {"flaky": 1}

    async def reconcile(req: kr.Request) -> kr.Result | None:
        if req.entity_id == "bad":
            raise kr.PermanentError("no")
        if failures.get(req.entity_id, 0) > 0:
            failures[req.entity_id] -= 1
            raise RuntimeError("once")
        if req.entity_id == "later":
            return kr.Result(requeue_after=3600)
        return None

    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_metrics(kr.register_metrics(registry))
        .with_name("devices")
        .with_backoff(0.001, 0.01)
        .build()
    )
    async with loop:
        for entity in ("ok", "bad", "flaky", "later"):
            await loop.enqueue(kr.Request(entity))

        def count(result: str) -> float | None:
            return sample(registry, "reconcile_total", controller="devices", result=result)

        await eventually(lambda: count("success") == 2)  # ok, and flaky after its retry
        assert count("permanent") == 1
        assert count("error") == 1
        assert count("requeue_after") == 1
        assert sample(registry, "reconcile_errors_total", controller="devices") == 1
        assert sample(registry, "workqueue_retries_total", name="devices") == 1
        assert sample(registry, "workqueue_adds_total", name="devices") == 4
        assert sample(registry, "dead_letter_entities", controller="devices") == 1
        assert sample(registry, "reconcile_time_seconds_count", controller="devices") == 5


def test_reconcile_time_buckets_reach_sixty_seconds() -> None:
    assert RECONCILE_TIME_BUCKETS[-1] == 60
    registry = prometheus_client.CollectorRegistry()
    metrics = kr.register_metrics(registry)
    assert metrics.reconcile_time_seconds is not None
    metrics.reconcile_time_seconds.labels("x").observe(45)
    assert sample(registry, "reconcile_time_seconds_bucket", controller="x", le="40.0") == 0
    assert sample(registry, "reconcile_time_seconds_bucket", controller="x", le="50.0") == 1


async def test_a_none_field_disables_that_instrument() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = kr.register_metrics(registry)
    metrics.reconcile_total = None

    async def reconcile(req: kr.Request) -> None:
        return None

    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_metrics(metrics)
        .with_name("devices")
        .build()
    )
    async with loop:
        await loop.enqueue(kr.Request("a"))
        await eventually(
            lambda: sample(registry, "reconcile_time_seconds_count", controller="devices") == 1
        )
    assert sample(registry, "reconcile_total", controller="devices", result="success") is None


async def test_a_follower_exports_its_backlog_apart_from_the_work_queue() -> None:
    from kopf_reconcile.testing.memory import MemoryLeaseElector, MemoryLeaseStore

    # Two replicas in one process: each exports on a registry of its own, as processes do.
    registries = {
        "a": prometheus_client.CollectorRegistry(),
        "b": prometheus_client.CollectorRegistry(),
    }
    store = MemoryLeaseStore()
    rid = "devices"
    requests: dict[str, asyncio.Queue[kr.Request]] = {"a": asyncio.Queue(), "b": asyncio.Queue()}
    release = asyncio.Event()

    async def reconcile(req: kr.Request) -> None:
        await release.wait()  # the leader's entities stay in flight or queued

    def loop(name: str) -> kr.Loop:
        return (
            kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
            .with_trigger(kr.ChannelTrigger(requests[name]))
            .with_leader(MemoryLeaseElector(store, kr.LeaseTTL(1)))
            .with_reconciler_id(rid)
            .with_renew_interval(0.1)
            .with_metrics(kr.register_metrics(registries[name]))
            .build()
        )

    leader, follower = loop("a"), loop("b")
    async with leader:
        await eventually(lambda: leader.stats().is_leader)
        async with follower:
            try:
                for i in range(5):
                    await requests["a"].put(kr.Request(f"e{i}"))
                    await requests["b"].put(kr.Request(f"e{i}"))
                # The leader works one entity at a time: the others wait in its queue.
                await eventually(lambda: sample(registries["a"], "workqueue_depth", name=rid) == 5)
                await eventually(lambda: sample(registries["b"], "follower_backlog", name=rid) == 5)
                assert not follower.stats().is_leader
                assert sample(registries["b"], "workqueue_depth", name=rid) == 0
                assert sample(registries["a"], "follower_backlog", name=rid) == 0
            finally:
                release.set()


async def test_a_sharded_reconcilers_series_carry_its_name_and_a_shard_label() -> None:
    registry = prometheus_client.CollectorRegistry()

    async def reconcile(req: kr.Request) -> None:
        return None

    loop = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(MemoryLeaseElector(MemoryLeaseStore(), kr.LeaseTTL(2)))
        .with_renew_interval(0.05)
        .with_metrics(kr.register_metrics(registry))
        .with_name("devices")
        .with_reconciler_id("devices")
        .with_shards(3)
        .build()
    )
    assert isinstance(loop, ShardedLoop)
    shards = ("0", "1", "2")

    def value(metric: str, k: str, **labels: str) -> float:
        return sample(registry, metric, shard=k, **labels) or 0

    def successes(k: str) -> float:
        return value("reconcile_total", k, controller="devices", result="success")

    async with loop:
        await eventually(
            lambda: all(value("leader", k, controller="devices") == 1 for k in shards), timeout=10
        )
        for k in shards:
            assert value("epoch", k, controller="devices") >= 1
            assert sample(registry, "workqueue_depth", name="devices", shard=k) == 0
        # Each shard's new leader resyncs its shard first: count from there.
        await eventually(lambda: sum(successes(k) for k in shards) == 3)
        before = {k: successes(k) for k in shards}
        home = str(loop.shard_of("e1"))
        await loop.enqueue(kr.Request("e1"))
        await eventually(lambda: successes(home) == before[home] + 1)
        for k in shards:
            assert successes(k) == before[k] + (k == home), k
        # The histograms: one series for the reconciler, whichever shard observed.
        assert sample(registry, "reconcile_time_seconds_count", controller="devices") == 4
    # No series under a shard's Loop name, nor an unsharded one.
    assert sample(registry, "leader", controller="devices-shard-0", shard="0") is None
    assert sample(registry, "leader", controller="devices") is None


async def test_two_reconcilers_of_one_name_have_series_of_their_own() -> None:
    """``controller`` is the reconciler id: two functions both called ``reconcile`` (with
    distinct ids, as two reconcilers of one operator must have) never share a series."""
    registry = prometheus_client.CollectorRegistry()
    metrics = kr.register_metrics(registry)

    async def reconcile(req: kr.Request) -> None:
        return None

    def loop_of(reconciler_id: str) -> kr.Loop:
        return (
            kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
            .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
            .with_metrics(metrics)
            .with_reconciler_id(reconciler_id)
            .build()
        )

    websites, databases = loop_of("websites-operator"), loop_of("databases-operator")
    async with websites, databases:
        await websites.enqueue(kr.Request("a"))
        await eventually(
            lambda: (
                sample(
                    registry, "reconcile_total", controller="websites-operator", result="success"
                )
                == 1
            )
        )
        await eventually(lambda: websites.stats().in_flight == 0)
        assert (
            sample(registry, "reconcile_total", controller="databases-operator", result="success")
            == 0
        )
        assert sample(registry, "workqueue_adds_total", name="websites-operator") == 1
        assert sample(registry, "workqueue_adds_total", name="databases-operator") == 0
    assert sample(registry, "reconcile_total", controller="reconcile", result="success") is None
