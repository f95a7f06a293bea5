"""``EmbeddedCluster``: an embedded Kubernetes API on 127.0.0.1, as an async context manager.

It assembles the store, the resource registry, the API verbs and the HTTP server, listens
on an ephemeral (or given) port of 127.0.0.1, and writes a kubeconfig for it. Tests talk to
it exactly as to a real cluster: kubernetes-asyncio (:meth:`api_client`), raw HTTP
(:meth:`http_session`), kopf and kubectl (:attr:`kubeconfig`). Faults are injected with
:meth:`inject_fault` and watch streams are cut with :meth:`cut_watches`.
"""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from kopf_reconcile.testing.emulated_apiserver.audit import AuditLog
from kopf_reconcile.testing.emulated_apiserver.faults import Fault, FaultInjector
from kopf_reconcile.testing.emulated_apiserver.kubeconfig import write_kubeconfig
from kopf_reconcile.testing.emulated_apiserver.registry import ResourceAPI
from kopf_reconcile.testing.emulated_apiserver.resources import ResourceRegistry
from kopf_reconcile.testing.emulated_apiserver.reviews import TokenUser
from kopf_reconcile.testing.emulated_apiserver.server import ApiServer
from kopf_reconcile.testing.emulated_apiserver.store import Store

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

#: Defaults, each bounded so that memory stays flat however long the cluster runs.
DEFAULT_HISTORY_SIZE = 10_000  # changes a watch can resume from (older: 410 Expired)
DEFAULT_WATCH_QUEUE_SIZE = 10_000  # events queued for one slow watcher before it is cut off
DEFAULT_MAX_EVENTS = 5_000  # core Events kept (kube-apiserver expires them after 1 h)
DEFAULT_BOOKMARK_INTERVAL = 60.0  # seconds between BOOKMARKs, about kube-apiserver's pace
DEFAULT_WATCH_TIMEOUT = (
    1800.0  # seconds a watch lasts without timeoutSeconds (--min-request-timeout)
)
#: Seconds a deleted namespace stays Terminating with its content before it is emptied and
#: removed: about what kube-controller-manager's namespace controller takes; 0 does it at once.
DEFAULT_NAMESPACE_TERMINATION_DELAY = 1.0


class EmbeddedCluster:
    """A Kubernetes API served on 127.0.0.1 for tests and the demo."""

    def __init__(
        self,
        *,
        port: int = 0,
        history_size: int = DEFAULT_HISTORY_SIZE,
        watch_queue_size: int = DEFAULT_WATCH_QUEUE_SIZE,
        max_events: int = DEFAULT_MAX_EVENTS,
        bookmark_interval: float = DEFAULT_BOOKMARK_INTERVAL,
        watch_timeout: float = DEFAULT_WATCH_TIMEOUT,
        namespace_termination_delay: float = DEFAULT_NAMESPACE_TERMINATION_DELAY,
        sharded_list_and_watch: bool = True,
        audit_log: str | Path | None = None,
    ) -> None:
        """``sharded_list_and_watch``: serve KEP-5866's ``shardSelector`` (the feature gate
        the real tier turns on); off, the parameter is ignored, as by a server without it.

        ``audit_log``: append an audit log there (JSON lines, see :mod:`.audit`)."""
        self._port = port
        self._audit_path = Path(audit_log) if audit_log is not None else None
        self.store = Store(history_size=history_size, watch_queue_size=watch_queue_size)
        self.registry = ResourceRegistry()
        self.api = ResourceAPI(
            self.store,
            self.registry,
            max_events=max_events,
            namespace_termination_delay=namespace_termination_delay,
        )
        self.faults = FaultInjector()
        self.server = ApiServer(
            self.api,
            self.faults,
            bookmark_interval=bookmark_interval,
            watch_timeout=watch_timeout,
            sharded_list_and_watch=sharded_list_and_watch,
        )
        # Static tokens for TokenReviews, as the real tier's: an administrator, a nobody.
        self.admin_token = secrets.token_hex(16)
        self.unprivileged_token = secrets.token_hex(16)
        self.add_token(self.admin_token, "admin", ("system:masters",))
        self.add_token(self.unprivileged_token, "nobody")
        self._runner: web.AppRunner | None = None
        self._tempdir: tempfile.TemporaryDirectory[str] | None = None
        self._url: str | None = None
        self._kubeconfig: Path | None = None

    # Lifecycle.

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("the embedded cluster is already running")
        runner = web.AppRunner(
            self.server.app,
            access_log=None,  # no per-request log: memory stays flat
            handle_signals=False,
            shutdown_timeout=1.0,
            # A client that hangs up ends its handler at once, so an idle watch whose client
            # went away does not linger until its timeout (kube-apiserver notices too).
            handler_cancellation=True,
        )
        if self._audit_path is not None:
            self.enable_audit_log(self._audit_path)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self._port)
        await site.start()
        self._runner = runner
        port = runner.addresses[0][1]
        self._url = f"http://127.0.0.1:{port}"
        self.server.server_address = f"127.0.0.1:{port}"
        self._tempdir = tempfile.TemporaryDirectory(prefix="kopf-reconcile-cluster-")
        self._kubeconfig = write_kubeconfig(Path(self._tempdir.name) / "kubeconfig", self._url)

    async def stop(self) -> None:
        if self._runner is None:
            return
        self.api.close()
        self.server.close_watches()
        await self._runner.cleanup()
        self._runner = None
        if self.server.audit_log is not None:
            self.server.audit_log.close()
            self.server.audit_log = None
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None

    async def __aenter__(self) -> EmbeddedCluster:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    # Where it is and how to talk to it.

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the embedded cluster is not started")
        return self._url

    @property
    def kubeconfig(self) -> str:
        if self._kubeconfig is None:
            raise RuntimeError("the embedded cluster is not started")
        return str(self._kubeconfig)

    @property
    def audit_log(self) -> Path | None:
        """The audit log's path (given as ``audit_log``), if the cluster keeps one."""
        return self._audit_path

    def enable_audit_log(self, path: str | Path) -> Path:
        """Start appending the audit log to ``path`` (from the next request on)."""
        if self.server.audit_log is not None:
            self.server.audit_log.close()
        self._audit_path = Path(path)
        self.server.audit_log = AuditLog(self._audit_path)
        return self._audit_path

    def add_token(self, token: str, username: str, groups: tuple[str, ...] = ()) -> None:
        """Have TokenReviews authenticate ``token`` as ``username`` in ``groups``."""
        # The real tier's token file gives each static user its name as uid.
        self.server.reviews.add_token(token, TokenUser(username, username, groups))

    def api_client(self, *, unprivileged: bool = False) -> ApiClient:
        """A kubernetes-asyncio client for this cluster; the caller closes it.

        ``unprivileged``: it sends the token of ``nobody`` (else no token: the administrator).
        """
        from kubernetes_asyncio.client import ApiClient, Configuration

        configuration = Configuration(host=self.url)
        if unprivileged:
            configuration.api_key = {"BearerToken": self.unprivileged_token}
            configuration.api_key_prefix = {"BearerToken": "Bearer"}
        return ApiClient(configuration=configuration)

    def http_session(self, *, unprivileged: bool = False, **kwargs: Any) -> aiohttp.ClientSession:
        """A raw HTTP session with this cluster as its base URL; the caller closes it.

        ``unprivileged``: it sends the token of ``nobody`` (else no token: the administrator);
        given ``headers`` are sent along."""
        if unprivileged:
            token = {"Authorization": f"Bearer {self.unprivileged_token}"}
            kwargs["headers"] = {**kwargs.pop("headers", {}), **token}
        return aiohttp.ClientSession(base_url=self.url, **kwargs)

    # Faults.

    def inject_fault(
        self,
        method: str,
        path_pattern: str,
        status: int | None = None,
        delay: float | None = None,
        times: int | None = 1,
    ) -> Fault:
        """Fail (``status``) and/or delay (``delay`` seconds) the next ``times`` matching requests.

        ``method`` is an HTTP method or ``*``; ``path_pattern`` is a regular expression that
        must match the whole path (no query). ``times=None`` keeps the fault until cleared.
        """
        return self.faults.add(method, path_pattern, status=status, delay=delay, times=times)

    def clear_faults(self) -> None:
        self.faults.clear()

    def cut_watches(self, path_pattern: str | None = None) -> int:
        """Abruptly drop open watch connections (matching ``path_pattern``); returns how many."""
        return self.server.cut_watches(path_pattern)

    # Introspection.

    def sizes(self) -> dict[str, int]:
        """Sizes of the internal structures, for boundedness checks."""
        return {
            **self.store.sizes(),
            "faults": len(self.faults.active()),
            "streams": len(self.server.streams),
        }
