"""Every invalid option is a ConfigError naming the option and the value."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable

import pytest

import kopf_reconcile as kr
from kopf_reconcile.testing.memory import (
    MemoryFencedRepository,
    MemoryLeaseElector,
    MemoryLeaseStore,
)


async def noop(req: kr.Request) -> None:
    return None


def base() -> kr.Builder:
    return kr.Builder(noop, kr.Tenancy.SINGLE_TENANT).with_trigger(
        kr.ChannelTrigger(asyncio.Queue())
    )


BUILD_ERRORS: list[tuple[str, Callable[[], kr.Builder], str]] = [
    ("reconciler None", lambda: kr.Builder(None, kr.Tenancy.SINGLE_TENANT), "reconciler"),  # type: ignore[arg-type]
    ("reconciler not callable", lambda: kr.Builder(42, kr.Tenancy.SINGLE_TENANT), "reconciler"),  # type: ignore[arg-type]
    ("tenancy None", lambda: kr.Builder(noop, None), "tenancy"),  # type: ignore[arg-type]
    ("tenancy string", lambda: kr.Builder(noop, "single-tenant"), "tenancy"),  # type: ignore[arg-type]
    ("no trigger", lambda: kr.Builder(noop, kr.Tenancy.SINGLE_TENANT), "trigger"),
    (
        "fenced without leader",
        lambda: base().with_fenced_repo(MemoryFencedRepository()),
        "fenced repo",
    ),
    ("leader without methods", lambda: base().with_leader(object()), "leader"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("case", "make", "option"), BUILD_ERRORS, ids=[c[0] for c in BUILD_ERRORS])
def test_build_time_errors(case: str, make: Callable[[], kr.Builder], option: str) -> None:
    with pytest.raises(kr.ConfigError, match=option):
        make().build()


def test_config_error_is_a_value_error() -> None:
    assert issubclass(kr.ConfigError, ValueError)


def test_trigger_without_run_is_rejected_at_once() -> None:
    with pytest.raises(kr.ConfigError, match="trigger"):
        kr.Builder(noop, kr.Tenancy.SINGLE_TENANT).with_trigger(object())  # type: ignore[arg-type]


def elector(ttl: float = 15) -> MemoryLeaseElector:
    return MemoryLeaseElector(MemoryLeaseStore(), ttl=kr.LeaseTTL(ttl))


VALUE_ERRORS: list[tuple[str, Callable[[], kr.Builder], str]] = [
    ("concurrency 0", lambda: base().with_concurrency(0), "concurrency"),
    ("concurrency float", lambda: base().with_concurrency(1.5), "concurrency"),  # type: ignore[arg-type]
    ("interval 0", lambda: base().with_interval(0), "interval"),
    ("interval negative", lambda: base().with_interval(-1), "interval"),
    ("backoff base 0", lambda: base().with_backoff(0, 1), "backoff base"),
    ("backoff inverted", lambda: base().with_backoff(2, 1), "backoff base"),
    ("reconciler id uppercase", lambda: base().with_reconciler_id("Devices"), "reconciler_id"),
    ("reconciler id underscore", lambda: base().with_reconciler_id("a_b"), "reconciler_id"),
    ("reconciler id too long", lambda: base().with_reconciler_id("a" * 254), "reconciler_id"),
    ("reconciler id empty", lambda: base().with_reconciler_id(""), "reconciler_id"),
    ("intake capacity 0", lambda: base().with_intake_capacity(0), "intake capacity"),
    (
        "renew >= ttl",
        lambda: base().with_leader(elector(1)).with_renew_interval(1),
        "renew_interval",
    ),
    (
        "renew >= deadline",
        lambda: base().with_leader(elector(3)).with_renew_interval(2.5),
        "renew_interval",
    ),
    ("renew 0", lambda: base().with_leader(elector()).with_renew_interval(0), "renew_interval"),
]


@pytest.mark.parametrize(("case", "make", "option"), VALUE_ERRORS, ids=[c[0] for c in VALUE_ERRORS])
def test_value_errors_fail_the_build(
    case: str, make: Callable[[], kr.Builder], option: str
) -> None:
    """LoopConfig.validate() runs in build(): no Loop exists with a bad value."""
    with pytest.raises(kr.ConfigError, match=option):
        make().build()


@pytest.mark.parametrize(
    ("make", "option"),
    [
        (lambda: base().with_interval("10s"), "interval"),  # type: ignore[arg-type]
        (lambda: base().with_backoff(None, 1), "backoff base"),  # type: ignore[arg-type]
        (lambda: base().with_renew_interval(float("nan")), "renew_interval"),
        (lambda: base().with_name(""), "name"),
        (lambda: base().with_metrics({}), "metrics"),  # type: ignore[arg-type]
        (lambda: kr.TickerTrigger(0), "TickerTrigger interval"),
        (lambda: kr.ChannelTrigger([1, 2]), "ChannelTrigger"),  # type: ignore[arg-type]
        (lambda: kr.LeaseTTL(0.0009), "lease ttl"),
        (lambda: kr.LeaseTTL(-1), "lease ttl"),
        (lambda: kr.Result(requeue_after=-1), "requeue_after"),
    ],
)
def test_eager_value_errors(make: Callable[[], object], option: str) -> None:
    with pytest.raises(kr.ConfigError, match=option):
        make()


def test_timedelta_is_accepted_for_durations() -> None:
    assert kr.Result(requeue_after=datetime.timedelta(milliseconds=1500)).requeue_after == 1.5  # type: ignore[arg-type]
    assert kr.LeaseTTL(datetime.timedelta(seconds=2)).milliseconds == 2000


def test_lease_ttl_milliseconds_is_never_zero() -> None:
    assert kr.LeaseTTL(0.001).milliseconds == 1
    assert kr.LeaseTTL(15).seconds == 15.0


def test_default_reconciler_id_is_derived_from_the_name() -> None:
    async def reconcile_device(req: kr.Request) -> None:
        return None

    loop = (
        kr.Builder(reconcile_device, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .build()
    )
    assert loop.reconciler_id == "reconcile-device"
