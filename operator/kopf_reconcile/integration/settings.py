"""Operator configuration: explicit arguments first, then the environment, then defaults.

(Over 400 lines on purpose: one parser per environment variable, next to the table of
the variables.)

One :class:`Settings` value holds everything a kopf-reconcile process reads from
outside: who it is (``POD_NAME``, ``POD_NAMESPACE``), where fenced state lives
(``KOPF_RECONCILE_DATABASE_URL``), how leases behave, which leader elector to use,
where metrics and health are served and how logs look. :meth:`Settings.load` takes
each value from the keyword argument of the same name when given, else from its
environment variable, else the default, and validates it at once: a missing or
invalid value raises :class:`~kopf_reconcile.ConfigError` naming the variable (or
argument) and the bad value, so a misconfigured operator stops at startup, never
later. Passwords in a database URL never appear in a message.

Choosing the leader elector (``KOPF_RECONCILE_LEADER``):

* ``kubernetes``: a coordination.k8s.io Lease per reconciler;
* ``postgres``: a row per reconciler in the database (needs a database URL);
* ``none``: single-process mode: always the leader, epoch 0, nothing fenced;
* ``auto`` (default): ``kubernetes`` inside a pod (``KUBERNETES_SERVICE_HOST``
  set), else ``postgres`` when a database URL is configured, else ``none``.

Values that could only fail later are refused here: numbers must be plain ASCII
decimals (``float`` and ``int`` also take other scripts' digits), a lease TTL fits a
Lease's int32 ``leaseDurationSeconds``, a renew interval is at least
:data:`MIN_RENEW_INTERVAL` (each renewal is a round trip), ``POD_NAMESPACE`` is a
namespace name. The probes listen on 127.0.0.1 by default, and on all addresses in a
pod (``KUBERNETES_SERVICE_HOST`` set), where the kubelet and Prometheus reach the pod's
IP, never its loopback.

With a leader, the reconcilers' Kubernetes API writes (``kopf_reconcile.fenced_client()``)
carry their lease for the API server's fence (``KOPF_RECONCILE_API_FENCE=on``, the default:
see :mod:`kopf_reconcile.integration.fence_policy`); ``off`` keeps the local check only, for
clusters without the fence's policy and RBAC.

With a database URL and a leader, every reconcile gets a fenced writer on
PostgreSQL. Without a leader there is no epoch to fence with, so the database
URL is then unused (and said so in the startup log).
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import math
import os
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from kopf_reconcile.api import ConfigError
from kopf_reconcile.database import is_postgres_url
from kopf_reconcile.leader.identity import unique_holder_id
from kopf_reconcile.leader.protocol import MIN_LEASE_TTL, LeaseTTL
from kopf_reconcile.leader.timing import (
    DEFAULT_LEASE_TTL,
    DEFAULT_RETRY_PERIOD,
    MAX_LEASE_TTL,
    LeaseTiming,
)
from kopf_reconcile.redaction import redact_dsn, remember_dsn

if TYPE_CHECKING:
    from kopf_reconcile.fencing.protocol import FencedRepository
    from kopf_reconcile.integration.probing import StoreProbe
    from kopf_reconcile.integration.watch_guard import BrokenWatchGuard, Candidate
    from kopf_reconcile.leader.protocol import LeaderElector

__all__ = ["ENVIRONMENT", "ApiFence", "LeaderKind", "LogFormat", "Settings", "current", "install"]

T = TypeVar("T")

DEFAULT_METRICS_HOST = "127.0.0.1"  # outside a pod, nothing else needs to reach the probes
# In a pod the kubelet probes and Prometheus scrapes the pod's IP, never its loopback.
IN_CLUSTER_METRICS_HOST = "0.0.0.0"
DEFAULT_METRICS_PORT = 8080  # controller-runtime's metrics port
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# A renewal is an API or database round trip: below this the renewal loop is a busy loop.
MIN_RENEW_INTERVAL = 0.1
# Plain ASCII decimal numbers only: float() and int() also take other scripts' digits,
# underscores and "infinity", which no operator means to write in a manifest.
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
_NON_FINITE = ("nan", "inf", "infinity")
_PORT = re.compile(r"[0-9]+", re.ASCII)
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", re.ASCII)  # an RFC 1123 label


class LeaderKind(enum.Enum):
    """Which leader elector the reconcilers of this process use."""

    AUTO = "auto"
    KUBERNETES = "kubernetes"
    POSTGRES = "postgres"
    NONE = "none"


class MetricsAuth(enum.Enum):
    """Who may read ``/metrics``: anyone, or whom the Kubernetes API allows."""

    NONE = "none"
    KUBERNETES = "kubernetes"  # TokenReview + SubjectAccessReview (see metrics_auth)


class ApiFence(enum.Enum):
    """Whether reconcilers' API writes carry their lease for the API server's fence."""

    ON = "on"  # impersonate with the lease's extras (see integration.fence_policy)
    OFF = "off"  # the local check only: no impersonation (no fence policy installed)


class LogFormat(enum.Enum):
    """How log records are written: one JSON object per line, or plain text."""

    TEXT = "text"
    JSON = "json"


@dataclasses.dataclass(frozen=True)
class _Variable:
    field: str
    env: str
    meaning: str


#: Every environment variable kopf-reconcile reads, in the order of the README table.
ENVIRONMENT: tuple[_Variable, ...] = (
    _Variable("pod_name", "POD_NAME", "base of the lease holder identity (else the host name)"),
    _Variable("pod_namespace", "POD_NAMESPACE", "namespace of the Kubernetes Leases"),
    _Variable("database_url", "KOPF_RECONCILE_DATABASE_URL", "PostgreSQL DSN of fenced state"),
    _Variable("leader", "KOPF_RECONCILE_LEADER", "auto | kubernetes | postgres | none"),
    _Variable("lease_ttl", "KOPF_RECONCILE_LEASE_TTL", "lease duration, seconds"),
    _Variable("renew_interval", "KOPF_RECONCILE_RENEW_INTERVAL", "lease renewal period, seconds"),
    _Variable("stop_timeout", "KOPF_RECONCILE_STOP_TIMEOUT", "drain time at shutdown, seconds"),
    _Variable("metrics_host", "KOPF_RECONCILE_METRICS_HOST", "address of /metrics and health"),
    _Variable("metrics_port", "KOPF_RECONCILE_METRICS_PORT", "port of /metrics and health"),
    _Variable("log_format", "KOPF_RECONCILE_LOG_FORMAT", "text | json"),
    _Variable("log_level", "KOPF_RECONCILE_LOG_LEVEL", "DEBUG | INFO | WARNING | ERROR"),
    _Variable("metrics_auth", "KOPF_RECONCILE_METRICS_AUTH", "kubernetes | none"),
    _Variable("api_fence", "KOPF_RECONCILE_API_FENCE", "on | off: API writes carry the lease"),
    _Variable("metrics_tls_cert", "KOPF_RECONCILE_METRICS_TLS_CERT", "PEM certificate of /metrics"),
    _Variable("metrics_tls_key", "KOPF_RECONCILE_METRICS_TLS_KEY", "PEM key of that certificate"),
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The validated configuration of one operator process (see the module docstring)."""

    pod_name: str | None = None
    pod_namespace: str | None = None
    database_url: str | None = dataclasses.field(default=None, repr=False)
    leader: LeaderKind = LeaderKind.AUTO
    lease_ttl: LeaseTTL = DEFAULT_LEASE_TTL
    renew_interval: float = DEFAULT_RETRY_PERIOD
    stop_timeout: float | None = None  # None: the Loop's default (30 s)
    metrics_host: str = DEFAULT_METRICS_HOST
    metrics_port: int = DEFAULT_METRICS_PORT
    log_format: LogFormat = LogFormat.TEXT
    log_level: str = "INFO"
    in_cluster: bool = False  # KUBERNETES_SERVICE_HOST is set: this process runs in a pod
    metrics_host_given: bool = False  # False: the default of where this process runs
    metrics_auth: MetricsAuth = MetricsAuth.NONE
    metrics_tls_cert: str | None = None
    metrics_tls_key: str | None = None
    api_fence: ApiFence = ApiFence.ON

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **arguments: Any) -> Settings:
        """Settings from ``arguments`` (those not None), then ``environ`` (default: os.environ)."""
        env = os.environ if environ is None else environ
        known = {v.field for v in ENVIRONMENT}
        unknown = sorted(set(arguments) - known)
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; known: {sorted(known)}")

        def raw(field: str) -> tuple[str, object]:
            """The value of a setting and the name to blame for it (argument or variable)."""
            variable = next(v for v in ENVIRONMENT if v.field == field)
            if arguments.get(field) is not None:
                return field, arguments[field]
            value = env.get(variable.env)
            if value is None or value.strip() == "":
                return variable.env, None
            return variable.env, value.strip()

        def parsed(field: str, parse: Callable[[str, object], T], default: T) -> T:
            source, value = raw(field)
            return default if value is None else parse(source, value)

        lease_ttl = parsed("lease_ttl", _lease_ttl, DEFAULT_LEASE_TTL)
        in_cluster = bool(env.get("KUBERNETES_SERVICE_HOST"))
        settings = cls(
            pod_name=parsed("pod_name", _text, None),
            pod_namespace=parsed("pod_namespace", _namespace, None),
            database_url=parsed("database_url", _database_url, None),
            leader=parsed("leader", _enum(LeaderKind), LeaderKind.AUTO),
            lease_ttl=lease_ttl,
            renew_interval=parsed("renew_interval", _renew_interval, DEFAULT_RETRY_PERIOD),
            stop_timeout=parsed("stop_timeout", _non_negative_seconds, None),
            metrics_host=parsed(
                "metrics_host",
                _host,
                IN_CLUSTER_METRICS_HOST if in_cluster else DEFAULT_METRICS_HOST,
            ),
            metrics_port=parsed("metrics_port", _port, DEFAULT_METRICS_PORT),
            log_format=parsed("log_format", _enum(LogFormat), LogFormat.TEXT),
            log_level=parsed("log_level", _log_level, "INFO"),
            in_cluster=in_cluster,
            metrics_host_given=raw("metrics_host")[1] is not None,
            metrics_auth=parsed("metrics_auth", _enum(MetricsAuth), MetricsAuth.NONE),
            metrics_tls_cert=parsed("metrics_tls_cert", _text, None),
            metrics_tls_key=parsed("metrics_tls_key", _text, None),
            api_fence=parsed("api_fence", _enum(ApiFence), ApiFence.ON),
        )
        settings._check_consistency(raw)
        return settings

    def _check_consistency(self, raw: Callable[[str], tuple[str, object]]) -> None:
        LeaseTiming.of(
            self.lease_ttl,
            self.renew_interval,
            ttl_option=raw("lease_ttl")[0],
            retry_option=raw("renew_interval")[0],
        )
        if self.leader_kind is LeaderKind.KUBERNETES and not self.lease_ttl.seconds.is_integer():
            ttl_source, _ = raw("lease_ttl")
            raise ConfigError(
                f"{ttl_source} must be a whole number of seconds with Kubernetes Leases "
                f"(spec.leaseDurationSeconds), got {self.lease_ttl.seconds:g}"
            )
        if (self.metrics_tls_cert is None) != (self.metrics_tls_key is None):
            cert_source, _ = raw("metrics_tls_cert")
            key_source, _ = raw("metrics_tls_key")
            raise ConfigError(f"{cert_source} and {key_source} go together: set both or neither")
        if self.leader is LeaderKind.POSTGRES and self.database_url is None:
            leader_source, _ = raw("leader")
            url_source, _ = raw("database_url")
            raise ConfigError(
                f"{leader_source}=postgres needs a database: set {url_source} "
                "(postgresql://user:password@host:5432/database)"
            )

    # -- what the configuration means -------------------------------------------------

    @property
    def leader_kind(self) -> LeaderKind:
        """The elector actually used: ``auto`` resolved (see the module docstring)."""
        if self.leader is not LeaderKind.AUTO:
            return self.leader
        if self.in_cluster:
            return LeaderKind.KUBERNETES
        if self.database_url is not None:
            return LeaderKind.POSTGRES
        return LeaderKind.NONE

    @property
    def fenced(self) -> bool:
        """Whether reconciles get a fenced writer (a database and a leadership epoch)."""
        return self.database_url is not None and self.leader_kind is not LeaderKind.NONE

    def new_holder_id(self) -> str:
        """A lease holder identity never reused: pod (or host) name plus a random suffix.

        A reused identity would let two processes share a lease epoch, so each
        elector gets a fresh one.
        """
        return unique_holder_id(self.pod_name or socket.gethostname())

    def build_elector(self) -> LeaderElector | None:
        """A new elector of the configured kind (None in single-process mode).

        Call it inside the running event loop: adapters may bind to it.
        """
        kind = self.leader_kind
        if kind is LeaderKind.NONE:
            return None
        if kind is LeaderKind.POSTGRES:
            from kopf_reconcile.leader.postgres import PostgresLeaseElector

            assert self.database_url is not None  # checked by load()
            return PostgresLeaseElector(
                self.database_url, ttl=self.lease_ttl, holder_id=self.new_holder_id()
            )
        from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector

        return KubernetesLeaseElector(
            namespace=self.pod_namespace, ttl=self.lease_ttl, holder_id=self.new_holder_id()
        )

    def build_fenced_repository(self) -> FencedRepository | None:
        """A PostgreSQL fenced repository when a database URL is set, else None.

        Fencing needs a leadership epoch too: give it only to a Loop with a leader.
        """
        if self.database_url is None:
            return None
        from kopf_reconcile.fencing.postgres import PostgresFencedRepository

        return PostgresFencedRepository(self.database_url)

    def store_probes(self) -> list[StoreProbe]:
        """Readiness checks of the database a replica needs to lead or write, if any."""
        if self.database_url is None or not self.fenced:
            return []
        from kopf_reconcile.integration.probing import StoreProbe

        return [StoreProbe(self.database_url, "KOPF_RECONCILE_DATABASE_URL")]

    def broken_watch_guard(
        self, problem: Callable[[], str | None], candidates: Callable[[], Iterable[Candidate]]
    ) -> BrokenWatchGuard:
        """Stands this replica's Loops aside once its watch stayed broken for one lease TTL
        (for a TTL plus a renew interval: time for a healthy candidate to take the lease)."""
        from kopf_reconcile.integration.watch_guard import BrokenWatchGuard

        ttl = self.lease_ttl.seconds
        return BrokenWatchGuard(problem, candidates, bound=ttl, hold_off=ttl + self.renew_interval)

    def describe(self) -> str:
        """One line for the startup log; the database password is redacted."""
        database = "none" if self.database_url is None else redact_dsn(self.database_url)
        return (
            f"leader={self.leader_kind.value}"
            f"{' (auto)' if self.leader is LeaderKind.AUTO else ''} "
            f"fenced={'yes' if self.fenced else 'no'} database={database} "
            f"lease_ttl={self.lease_ttl.seconds:g}s renew_interval={self.renew_interval:g}s "
            f"lease_namespace={self.pod_namespace or '(from kubeconfig)'}"
        )


# -- parsers: (name to blame, raw value) -> value, or ConfigError ----------------------


def _text(source: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{source} must be a non-empty string, got {value!r}")
    return value


def _number(source: str, value: object) -> float:
    if isinstance(value, bool) or (
        isinstance(value, str)
        and not _DECIMAL.fullmatch(value)
        and value.lower().lstrip("+-") not in _NON_FINITE  # refused below, by name
    ):
        raise ConfigError(f"{source} must be a number of seconds, got {value!r}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{source} must be a number of seconds, got {value!r}") from None
    if math.isnan(number) or math.isinf(number):
        raise ConfigError(f"{source} must be a finite number of seconds, got {value!r}")
    return number


def _positive_seconds(source: str, value: object) -> float:
    number = _number(source, value)
    if number <= 0:
        raise ConfigError(f"{source} must be > 0 seconds, got {value!r}")
    return number


def _renew_interval(source: str, value: object) -> float:
    number = _positive_seconds(source, value)
    if number < MIN_RENEW_INTERVAL:
        raise ConfigError(
            f"{source} must be >= {MIN_RENEW_INTERVAL:g} seconds (each renewal is a round trip "
            f"to the API server or the database), got {value!r}"
        )
    return number


def _non_negative_seconds(source: str, value: object) -> float:
    number = _number(source, value)
    if number < 0:
        raise ConfigError(f"{source} must be >= 0 seconds, got {value!r}")
    return number


def _lease_ttl(source: str, value: object) -> LeaseTTL:
    if isinstance(value, LeaseTTL):
        return value
    number = _positive_seconds(source, value)
    if number < MIN_LEASE_TTL:  # checked here too, so that the message names the variable
        raise ConfigError(f"{source} must be >= {MIN_LEASE_TTL} seconds (1 ms), got {value!r}")
    if number > MAX_LEASE_TTL:
        raise ConfigError(
            f"{source} must be at most {MAX_LEASE_TTL} seconds (a Lease's "
            f"spec.leaseDurationSeconds is an int32), got {value!r}"
        )
    return LeaseTTL(number)


def _parses(url: str) -> bool:
    try:
        urlsplit(url)
    except ValueError:  # e.g. an unclosed '[' of an IPv6 host
        return False
    return True


def _database_url(source: str, value: object) -> str:
    if not isinstance(value, str) or not is_postgres_url(value) or not _parses(value):
        shown = redact_dsn(value) if isinstance(value, str) else value
        raise ConfigError(
            f"{source} must be a PostgreSQL URL (postgresql://user:password@host:5432/database), "
            f"got {shown!r}"
        )
    if "@" in urlsplit(value).netloc.partition("@")[2]:
        # asyncpg ends the password at the first '@' and reads the rest as hosts and ports.
        raise ConfigError(
            f"{source} has an '@' in its user name or password ({redact_dsn(value)!r}): "
            "percent-encode it as %40 (and ':' as %3A, '/' as %2F)"
        )
    remember_dsn(value)
    return value


def _host(source: str, value: object) -> str:
    try:
        return str(ipaddress.ip_address(str(value)))
    except ValueError:
        raise ConfigError(
            f"{source} must be an IP address to listen on (127.0.0.1, or 0.0.0.0 in a pod), "
            f"got {value!r}"
        ) from None


def _namespace(source: str, value: object) -> str:
    text = _text(source, value)
    if len(text) > 63 or not _NAMESPACE.fullmatch(text):
        raise ConfigError(
            f"{source} must be a Kubernetes namespace name (lowercase letters, digits and '-', "
            f"starting and ending with a letter or digit, at most 63 characters), got {value!r}"
        )
    return text


def _port(source: str, value: object) -> int:
    if isinstance(value, bool) or not (
        isinstance(value, int) or _PORT.fullmatch(str(value)) is not None
    ):
        raise ConfigError(f"{source} must be a TCP port number, got {value!r}")
    port = int(str(value))
    if not 0 <= port <= 65535:
        raise ConfigError(f"{source} must be between 0 (any free port) and 65535, got {value!r}")
    return port


def _log_level(source: str, value: object) -> str:
    level = str(value).upper()
    if level not in _LOG_LEVELS:
        raise ConfigError(f"{source} must be one of {', '.join(_LOG_LEVELS)}, got {value!r}")
    return level


def _enum(kind: type[enum.Enum]) -> Callable[[str, object], Any]:
    def parse(source: str, value: object) -> enum.Enum:
        if isinstance(value, kind):
            return value
        try:
            return kind(str(value).lower())
        except ValueError:
            choices = " | ".join(str(member.value) for member in kind)
            raise ConfigError(f"{source} must be one of {choices}, got {value!r}") from None

    return parse


_installed: Settings | None = None


def install(settings: Settings | None) -> None:
    """Make ``settings`` the configuration of this process's reconcilers (None: uninstall).

    ``kopf-reconcile run`` installs the settings it validated before starting
    kopf; under plain ``kopf run`` nothing is installed and :func:`current`
    reads the environment.
    """
    global _installed
    _installed = settings


def current() -> Settings:
    """The installed settings, or else settings loaded from the environment now."""
    return _installed if _installed is not None else Settings.load()
