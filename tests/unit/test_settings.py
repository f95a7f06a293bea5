"""Settings: arguments over environment over defaults; every bad value names its variable."""

from __future__ import annotations

import pytest

from kopf_reconcile import ConfigError
from kopf_reconcile.integration.settings import ENVIRONMENT, LeaderKind, LogFormat, Settings

DSN = "postgresql://app:s3cret-pw@db.example:5432/app"


def test_defaults_without_environment() -> None:
    settings = Settings.load({})
    assert settings.leader is LeaderKind.AUTO
    assert settings.leader_kind is LeaderKind.NONE
    assert settings.lease_ttl.seconds == 15
    assert settings.renew_interval == 2
    assert settings.stop_timeout is None
    assert (settings.metrics_host, settings.metrics_port) == ("127.0.0.1", 8080)
    assert settings.log_format is LogFormat.TEXT
    assert settings.log_level == "INFO"
    assert not settings.fenced
    assert settings.build_elector() is None
    assert settings.build_fenced_repository() is None


def test_values_come_from_the_environment() -> None:
    settings = Settings.load(
        {
            "POD_NAME": "devices-0",
            "POD_NAMESPACE": "ops",
            "KOPF_RECONCILE_DATABASE_URL": DSN,
            "KOPF_RECONCILE_LEADER": "Kubernetes",
            "KOPF_RECONCILE_LEASE_TTL": "6",
            "KOPF_RECONCILE_RENEW_INTERVAL": "0.5",
            "KOPF_RECONCILE_STOP_TIMEOUT": "12",
            "KOPF_RECONCILE_METRICS_HOST": "0.0.0.0",
            "KOPF_RECONCILE_METRICS_PORT": "9000",
            "KOPF_RECONCILE_LOG_FORMAT": "json",
            "KOPF_RECONCILE_LOG_LEVEL": "debug",
        }
    )
    assert settings.pod_name == "devices-0"
    assert settings.pod_namespace == "ops"
    assert settings.database_url == DSN
    assert settings.leader_kind is LeaderKind.KUBERNETES
    assert settings.lease_ttl.seconds == 6
    assert settings.renew_interval == 0.5
    assert settings.stop_timeout == 12
    assert (settings.metrics_host, settings.metrics_port) == ("0.0.0.0", 9000)
    assert settings.log_format is LogFormat.JSON
    assert settings.log_level == "DEBUG"
    assert settings.fenced


def test_arguments_win_over_the_environment() -> None:
    environ = {"KOPF_RECONCILE_METRICS_PORT": "9000", "KOPF_RECONCILE_LOG_FORMAT": "json"}
    settings = Settings.load(environ, metrics_port=0, log_format="text", log_level=None)
    assert settings.metrics_port == 0
    assert settings.log_format is LogFormat.TEXT
    assert settings.log_level == "INFO"  # None means "not given": environment, then default


def test_blank_variables_count_as_unset() -> None:
    assert Settings.load({"KOPF_RECONCILE_LEASE_TTL": "  "}).lease_ttl.seconds == 15


@pytest.mark.parametrize(
    ("environ", "leader"),
    [
        ({}, LeaderKind.NONE),
        ({"KOPF_RECONCILE_DATABASE_URL": DSN}, LeaderKind.POSTGRES),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, LeaderKind.KUBERNETES),
        (
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KOPF_RECONCILE_DATABASE_URL": DSN},
            LeaderKind.KUBERNETES,
        ),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KOPF_RECONCILE_LEADER": "none"}, LeaderKind.NONE),
    ],
)
def test_auto_leader(environ: dict[str, str], leader: LeaderKind) -> None:
    assert Settings.load(environ).leader_kind is leader


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("KOPF_RECONCILE_LEASE_TTL", "soon", "KOPF_RECONCILE_LEASE_TTL must be a number"),
        ("KOPF_RECONCILE_LEASE_TTL", "-1", "KOPF_RECONCILE_LEASE_TTL must be > 0"),
        ("KOPF_RECONCILE_LEASE_TTL", "0.0001", "KOPF_RECONCILE_LEASE_TTL must be >= 0.001"),
        ("KOPF_RECONCILE_LEASE_TTL", "nan", "KOPF_RECONCILE_LEASE_TTL must be a finite"),
        ("KOPF_RECONCILE_RENEW_INTERVAL", "0", "KOPF_RECONCILE_RENEW_INTERVAL must be > 0"),
        ("KOPF_RECONCILE_STOP_TIMEOUT", "-3", "KOPF_RECONCILE_STOP_TIMEOUT must be >= 0"),
        ("KOPF_RECONCILE_LEADER", "zookeeper", "KOPF_RECONCILE_LEADER must be one of auto |"),
        ("KOPF_RECONCILE_METRICS_PORT", "http", "KOPF_RECONCILE_METRICS_PORT must be a TCP port"),
        ("KOPF_RECONCILE_METRICS_PORT", "70000", "KOPF_RECONCILE_METRICS_PORT must be between"),
        ("KOPF_RECONCILE_METRICS_HOST", "localhost", "KOPF_RECONCILE_METRICS_HOST must be an IP"),
        (
            "KOPF_RECONCILE_LOG_FORMAT",
            "xml",
            "KOPF_RECONCILE_LOG_FORMAT must be one of text | json",
        ),
        ("KOPF_RECONCILE_LOG_LEVEL", "loud", "KOPF_RECONCILE_LOG_LEVEL must be one of DEBUG"),
        (
            "KOPF_RECONCILE_DATABASE_URL",
            "mysql://db/x",
            "KOPF_RECONCILE_DATABASE_URL must be a Post",
        ),
    ],
)
def test_a_bad_value_names_its_variable(variable: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.load({variable: value})
    assert str(raised.value).startswith(expected)
    assert repr(value) in str(raised.value)


def test_a_bad_argument_names_the_argument() -> None:
    with pytest.raises(ConfigError, match=r"^metrics_port must be a TCP port number, got 'x'"):
        Settings.load({}, metrics_port="x")
    with pytest.raises(ConfigError, match="unknown setting"):
        Settings.load({}, metric_port=1)


def test_a_password_never_appears_in_an_error() -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.load({"KOPF_RECONCILE_DATABASE_URL": "mysql://app:s3cret-pw@db/app"})
    assert "s3cret-pw" not in str(raised.value)
    assert "app:***@db" in str(raised.value)


def test_renew_interval_must_leave_room_before_the_lease_expires() -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.load({"KOPF_RECONCILE_LEASE_TTL": "3", "KOPF_RECONCILE_RENEW_INTERVAL": "2"})
    message = str(raised.value)
    assert "KOPF_RECONCILE_RENEW_INTERVAL (2 s)" in message
    assert "KOPF_RECONCILE_LEASE_TTL (3 s)" in message


def test_postgres_leader_needs_a_database() -> None:
    with pytest.raises(ConfigError, match="KOPF_RECONCILE_LEADER=postgres needs a database"):
        Settings.load({"KOPF_RECONCILE_LEADER": "postgres"})


def test_kubernetes_leases_need_whole_seconds() -> None:
    with pytest.raises(ConfigError, match="KOPF_RECONCILE_LEASE_TTL must be a whole number"):
        Settings.load({"KOPF_RECONCILE_LEADER": "kubernetes", "KOPF_RECONCILE_LEASE_TTL": "4.5"})
    assert Settings.load({"KOPF_RECONCILE_LEASE_TTL": "4.5"}).lease_ttl.seconds == 4.5


async def test_adapters_follow_the_leader_kind() -> None:
    from kopf_reconcile.fencing.postgres import PostgresFencedRepository
    from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector
    from kopf_reconcile.leader.postgres import PostgresLeaseElector

    postgres = Settings.load({"KOPF_RECONCILE_DATABASE_URL": DSN, "POD_NAME": "op-0"})
    elector = postgres.build_elector()
    assert isinstance(elector, PostgresLeaseElector)
    assert elector.holder_id.startswith("op-0-")
    assert isinstance(postgres.build_fenced_repository(), PostgresFencedRepository)
    other = postgres.build_elector()
    assert isinstance(other, PostgresLeaseElector)
    assert other.holder_id != elector.holder_id  # identities are never reused

    kubernetes = Settings.load({"KOPF_RECONCILE_LEADER": "kubernetes", "POD_NAMESPACE": "ops"})
    lease_elector = kubernetes.build_elector()
    assert isinstance(lease_elector, KubernetesLeaseElector)
    assert lease_elector.namespace == "ops"
    assert lease_elector.ttl.seconds == 15


def test_describe_redacts_the_password() -> None:
    text = Settings.load({"KOPF_RECONCILE_DATABASE_URL": DSN}).describe()
    assert "s3cret-pw" not in text
    assert "leader=postgres (auto)" in text
    assert "fenced=yes" in text


def test_every_variable_is_documented_in_the_readme() -> None:
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    missing = [v.env for v in ENVIRONMENT if f"`{v.env}`" not in readme]
    assert missing == []


def test_in_a_pod_the_probes_listen_on_every_address_by_default() -> None:
    in_pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    settings = Settings.load(in_pod)
    assert settings.metrics_host == "0.0.0.0"
    assert not settings.metrics_host_given
    given = Settings.load({**in_pod, "KOPF_RECONCILE_METRICS_HOST": "127.0.0.1"})
    assert (given.metrics_host, given.metrics_host_given) == ("127.0.0.1", True)
    assert Settings.load({}).metrics_host == "127.0.0.1"  # outside a pod: loopback


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("KOPF_RECONCILE_LEASE_TTL", "3000000000", "must be at most 2147483647 seconds"),
        ("KOPF_RECONCILE_LEASE_TTL", "\u0661\u0665", "must be a number of seconds"),
        ("KOPF_RECONCILE_LEASE_TTL", "1_5", "must be a number of seconds"),
        ("KOPF_RECONCILE_RENEW_INTERVAL", "0.000001", "must be >= 0.1 seconds"),
        ("KOPF_RECONCILE_STOP_TIMEOUT", "\uff13\uff10", "must be a number of seconds"),
        ("KOPF_RECONCILE_METRICS_PORT", "\u0668\u0660\u0668\u0660", "must be a TCP port number"),
        ("KOPF_RECONCILE_METRICS_PORT", "+80", "must be a TCP port number"),
        ("POD_NAMESPACE", "Not A Namespace", "must be a Kubernetes namespace name"),
        ("POD_NAMESPACE", "a" * 64, "must be a Kubernetes namespace name"),
    ],
)
def test_values_that_would_fail_later_are_refused_at_startup(
    variable: str, value: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.load({variable: value})
    assert str(raised.value).startswith(f"{variable} {expected}")
    assert repr(value) in str(raised.value)
