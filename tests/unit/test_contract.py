"""The public contract: exact field sets, method sets and exported names.

A change here is a change of the public API and must be deliberate.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import kopf_reconcile as kr


def fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def protocol_methods(proto: type) -> dict[str, list[str]]:
    return {
        name: list(inspect.signature(member).parameters)
        for name, member in vars(proto).items()
        if callable(member) and not name.startswith("_")
    }


def test_request_fields() -> None:
    assert fields(kr.Request) == ["entity_id"]
    assert dataclasses.is_dataclass(kr.Request)
    assert kr.Request.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_result_fields() -> None:
    assert fields(kr.Result) == ["requeue_after"]
    assert kr.Result().requeue_after == 0
    assert kr.Result.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_lease_token_fields() -> None:
    assert fields(kr.LeaseToken) == [
        "reconciler_id",
        "holder_id",
        "epoch",
        "acquired_at",
        "expires_at",
    ]
    assert kr.LeaseToken.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_loop_stats_fields() -> None:
    assert fields(kr.LoopStats) == ["queued", "in_flight", "dead_letters", "is_leader", "epoch"]


def test_reconciler_protocol() -> None:
    assert protocol_methods(kr.Reconciler) == {"reconcile": ["self", "req"]}
    assert inspect.iscoroutinefunction(kr.Reconciler.reconcile)


def test_trigger_protocol() -> None:
    assert protocol_methods(kr.Trigger) == {"run": ["self", "emit"]}


def test_leader_elector_protocol() -> None:
    assert protocol_methods(kr.LeaderElector) == {
        "acquire_lease": ["self", "reconciler_id"],
        "renew_lease": ["self", "token"],
        "release_lease": ["self", "token"],
    }


def test_fenced_repository_protocol() -> None:
    assert protocol_methods(kr.FencedRepository) == {
        "apply_fenced": ["self", "entity_id", "epoch", "mutation"]
    }


def test_builder_options() -> None:
    options = {n for n in vars(kr.Builder) if n.startswith("with") or n == "build"}
    assert options == {
        "with_trigger",
        "with_concurrency",
        "with_interval",
        "with_backoff",
        "with_leader",
        "with_fenced_repo",
        "with_metrics",
        "with_name",
        "with_reconciler_id",
        "with_renew_interval",
        "with_intake_capacity",
        "with_stop_timeout",
        "with_random",
        "with_shards",
        "with_events",
        "with_redrive_interval",
        "without_default_requeue",
        "build",
    }


def test_tenancy_is_a_closed_set() -> None:
    assert [t.name for t in kr.Tenancy] == ["SINGLE_TENANT", "TENANT_SCOPED"]


def test_exported_names() -> None:
    for name in kr.__all__:
        assert hasattr(kr, name), name
    for name in (
        "Request", "Result", "PermanentError", "Reconciler", "Tenancy", "Builder", "new",
        "Loop", "Trigger", "TickerTrigger", "ChannelTrigger", "LeaderElector", "LeaseToken",
        "LeaseLost", "LeaseTTL", "FencedRepository", "FencedWriter", "fenced_writer",
        "StaleEpochError", "register_metrics", "ConfigError",
    ):  # fmt: skip
        assert name in kr.__all__, name


def test_adapters_are_exported_lazily() -> None:
    code = (
        "import sys, kopf_reconcile as kr\n"
        "heavy = [m for m in ('kopf', 'asyncpg', 'kubernetes_asyncio') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert kr.PostgresFencedRepository.__name__ == 'PostgresFencedRepository'\n"
        "assert kr.PostgresLeaseElector.__name__ == 'PostgresLeaseElector'\n"
        "assert kr.KubernetesLeaseElector.__name__ == 'KubernetesLeaseElector'\n"
        "assert callable(kr.reconciler)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
