"""A real kube-apiserver for tests: the project's counterpart of controller-runtime's envtest.

The embedded cluster imitates kube-apiserver; this module runs the real one, so
the same tests can prove the imitation right. ``RealCluster`` starts etcd and
kube-apiserver of the release :mod:`kube_release` selects (the newest by
default; both built once by ``scripts/real_apiserver.py`` into a cache outside
the work tree) on free loopback ports, with fresh data in a temporary
directory, and offers the interface of the embedded cluster: ``.url``,
``.kubeconfig``, ``.api_client()`` and ``.http_session()``.

Only the API server runs: no controller-manager, scheduler or kubelet, so pods
never run and deleted namespaces never finish terminating. Authentication is by
static bearer tokens: an administrator (group ``system:masters``) and a user
with no rights, for RBAC tests. Authorization is RBAC, as in production.
TLS is verified against the serving certificate the API server generates.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import aiohttp
import yaml
from kubernetes_asyncio.client import ApiClient, Configuration

from kopf_reconcile.testing.kube_release import (
    apiserver_feature_flags,
    etcd_binary,
    kube_binary,
    kube_version,
)

#: The Kubernetes release the real tier runs, as ``kube-apiserver --version`` reports it.
KUBE_VERSION = kube_version()
#: The user that may do anything (group ``system:masters``) and the one that may do nothing.
ADMIN_USER = "admin"
UNPRIVILEGED_USER = "nobody"
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"  # allocated in etcd only; nothing is routed there

#: What the audit log records (the embedded API's ``audit_log`` records the same): no reads;
#: writes of Leases with their request and response bodies; other writes, their metadata.
AUDIT_POLICY: dict[str, Any] = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted", "Panic"],
    "rules": [
        {"level": "None", "verbs": ["get", "list", "watch"]},
        {
            "level": "RequestResponse",
            "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}],
        },
        {"level": "Metadata"},
    ],
}

#: Tells, over a given HTTP session, whether a starting server is ready.
ReadinessCheck = Callable[[aiohttp.ClientSession], Awaitable[bool]]


class RealClusterError(RuntimeError):
    """etcd or kube-apiserver could not be started; the message says why."""


def apiserver_binary() -> Path:
    """The cached kube-apiserver build (made by ``scripts/real_apiserver.py``)."""
    return kube_binary("kube-apiserver", KUBE_VERSION)


def dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGTERM if the test process dies: none is left behind.

    util-linux's ``setpriv`` sets the parent-death signal and execs the command,
    so the PID stays the command's own.
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else argv


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def scratch_parent() -> str | None:
    """A tmpfs when there is one: etcd syncs every write, which is costly on a disk."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def token_api_client(url: str, token: str, ca_file: Path) -> ApiClient:
    """A kubernetes-asyncio client of an API server, with a bearer token, verifying TLS."""
    configuration = Configuration(
        host=url,
        api_key={"BearerToken": token},
        api_key_prefix={"BearerToken": "Bearer"},
        ssl_ca_cert=str(ca_file),
    )
    return ApiClient(configuration)


def token_http_session(url: str, token: str, ca_file: Path, **kwargs: Any) -> aiohttp.ClientSession:
    """An aiohttp session on ``url`` with a bearer token (added to given ``headers``) and TLS
    verified against ``ca_file``; other keyword arguments go to ``aiohttp.ClientSession``."""
    headers = {**kwargs.pop("headers", {}), "Authorization": f"Bearer {token}"}
    tls = ssl.create_default_context(cafile=str(ca_file))
    kwargs.setdefault("connector", aiohttp.TCPConnector(ssl=tls))
    return aiohttp.ClientSession(base_url=url, headers=headers, **kwargs)


class ChildProcess:
    """A child process started by the cluster, its log, and how to stop exactly it."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        try:
            self.popen = subprocess.Popen(
                dying_with_parent(argv),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )
        except OSError:
            self._log.close()
            raise

    def exited(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; by PID, only this process."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.popen.wait, grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                await asyncio.to_thread(self.popen.wait)
        self._log.close()


class RealCluster:
    """etcd plus kube-apiserver on 127.0.0.1, for one ``async with`` block.

    ``startup_seconds`` tells how long the API server took to become ready.
    """

    def __init__(
        self,
        *,
        apiserver: Path | None = None,
        etcd: Path | None = None,
        ready_timeout: float = 90.0,
        feature_flags: list[str] | None = None,
        audit_log: bool = False,
    ) -> None:
        """``feature_flags`` replace the tests' ``--feature-gates`` and ``--runtime-config``
        (:func:`~kopf_reconcile.testing.kube_release.apiserver_feature_flags`): ``[]`` runs
        the server with its defaults, as a cluster without the alpha gates is.

        ``audit_log``: keep an audit log (:attr:`audit_log`) by :data:`AUDIT_POLICY`."""
        self._audit = audit_log
        self.apiserver_path = apiserver or apiserver_binary()
        self.feature_flags = (
            apiserver_feature_flags(KUBE_VERSION) if feature_flags is None else feature_flags
        )
        self.etcd_path = etcd or etcd_binary()
        self.ready_timeout = ready_timeout
        self.admin_token = secrets.token_hex(16)
        self.unprivileged_token = secrets.token_hex(16)
        self.startup_seconds = 0.0
        self._port = 0
        self._workdir: Path | None = None
        self._processes: list[ChildProcess] = []

    # --- what tests use ------------------------------------------------------

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self._port}"

    @property
    def kubeconfig(self) -> str:
        """The path of a kubeconfig for the administrator (kubectl, kopf, kubernetes-asyncio)."""
        return str(self._dir / "kubeconfig")

    @property
    def unprivileged_kubeconfig(self) -> str:
        """The path of a kubeconfig for a user who has no rights beyond discovery."""
        return str(self._dir / "kubeconfig-unprivileged")

    @property
    def audit_log(self) -> Path | None:
        """The audit log (JSON lines of audit.k8s.io/v1 Events, by :data:`AUDIT_POLICY`,
        written as each request completes), if the cluster keeps one."""
        return self._dir / "audit.log" if self._audit else None

    @property
    def ca_file(self) -> Path:
        """The API server's serving certificate chain; trust it to verify TLS."""
        return self._dir / "certs" / "apiserver.crt"

    def api_client(self, *, unprivileged: bool = False) -> ApiClient:
        """A kubernetes-asyncio client for the administrator (or the user with no rights)."""
        return token_api_client(self.url, self._token(unprivileged), self.ca_file)

    def http_session(self, *, unprivileged: bool = False, **kwargs: Any) -> aiohttp.ClientSession:
        """An aiohttp session on ``url`` that authenticates and verifies TLS, for raw HTTP.

        Other keyword arguments go to ``aiohttp.ClientSession``; given ``headers``
        are sent along with the token.
        """
        return token_http_session(self.url, self._token(unprivileged), self.ca_file, **kwargs)

    # --- lifecycle -----------------------------------------------------------

    async def __aenter__(self) -> RealCluster:
        self._check_binaries()
        self._workdir = Path(
            tempfile.mkdtemp(prefix="kopf-reconcile-apiserver-", dir=scratch_parent())
        )
        try:
            started = time.monotonic()
            await self._start()
            self.startup_seconds = time.monotonic() - started
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop the API server, then etcd, and remove their data. Idempotent."""
        while self._processes:
            await self._processes.pop().stop()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    # --- internals -----------------------------------------------------------

    @property
    def _dir(self) -> Path:
        if self._workdir is None:
            raise RuntimeError("the real cluster is not running")
        return self._workdir

    def _token(self, unprivileged: bool) -> str:
        return self.unprivileged_token if unprivileged else self.admin_token

    def _ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def _check_binaries(self) -> None:
        if not os.access(self.apiserver_path, os.X_OK):
            raise RealClusterError(
                f"no kube-apiserver at {self.apiserver_path}: "
                "build it with `python scripts/real_apiserver.py` (or `make test`)"
            )
        if not os.access(self.etcd_path, os.X_OK):
            raise RealClusterError(
                f"no etcd at {self.etcd_path}: build it with "
                "`python scripts/real_apiserver.py` (or `make test`)"
            )

    async def _start(self) -> None:
        etcd_url = await self._start_etcd()
        self._write_credentials()
        self._port = free_loopback_port()
        apiserver = self._spawn(
            "kube-apiserver",
            [
                str(self.apiserver_path),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self._port}",
                f"--cert-dir={self._dir / 'certs'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={self._dir / 'service-account.key'}",
                f"--service-account-signing-key-file={self._dir / 'service-account.key'}",
                f"--token-auth-file={self._dir / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--endpoint-reconciler-type=none",
                *self._audit_flags(),
                *self.feature_flags,
            ],
        )
        await self._wait_until_ready(apiserver)
        self._write_kubeconfig(self.kubeconfig, ADMIN_USER, self.admin_token)
        self._write_kubeconfig(
            self.unprivileged_kubeconfig, UNPRIVILEGED_USER, self.unprivileged_token
        )

    def _audit_flags(self) -> list[str]:
        if not self._audit:
            return []
        policy = self._dir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(AUDIT_POLICY, sort_keys=False))
        return [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self._dir / 'audit.log'}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",  # each event written before the response: no batching
        ]

    def _spawn(self, name: str, argv: list[str]) -> ChildProcess:
        process = ChildProcess(name, argv, self._dir / f"{name}.log")
        self._processes.append(process)
        return process

    async def _start_etcd(self) -> str:
        client_url = f"http://127.0.0.1:{free_loopback_port()}"
        peer_url = f"http://127.0.0.1:{free_loopback_port()}"
        etcd = self._spawn(
            "etcd",
            [
                str(self.etcd_path),
                "--name=default",
                f"--data-dir={self._dir / 'etcd'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--logger=zap",
                "--log-level=warn",
            ],
        )

        async def healthy(session: aiohttp.ClientSession) -> bool:
            async with session.get(f"{client_url}/health") as response:
                return response.status == 200

        await self._poll_until(etcd, healthy)
        return client_url

    async def _wait_until_ready(self, apiserver: ChildProcess) -> None:
        """Ready, and bootstrapped: ``/readyz`` does not wait for the ``default`` namespace."""
        headers = {"Authorization": f"Bearer {self.admin_token}"}

        async def ready(session: aiohttp.ClientSession) -> bool:
            if not self.ca_file.exists():  # written once the server has generated it
                return False
            tls = self._ssl_context()
            for path in ("/readyz", "/api/v1/namespaces/default"):
                async with session.get(f"{self.url}{path}", headers=headers, ssl=tls) as response:
                    if response.status != 200:
                        return False
            return True

        await self._poll_until(apiserver, ready)

    async def _poll_until(self, process: ChildProcess, check: ReadinessCheck) -> None:
        """Poll ``check`` until it holds; fail early if the process dies, or at the deadline."""
        deadline = time.monotonic() + self.ready_timeout
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                code = process.exited()
                if code is not None:
                    raise RealClusterError(
                        f"{process.name} exited with code {code} while starting; "
                        f"its log ends with:\n{process.log_tail()}"
                    )
                try:
                    if await check(session):
                        return
                except (aiohttp.ClientError, OSError, TimeoutError):
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise RealClusterError(
                        f"{process.name} not ready after {self.ready_timeout:.0f} s; "
                        f"its log ends with:\n{process.log_tail()}"
                    )
                await asyncio.sleep(0.1)

    def _write_credentials(self) -> None:
        key = self._dir / "service-account.key"
        subprocess.run(
            ["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True
        )
        (self._dir / "tokens.csv").write_text(
            f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
            f"{self.unprivileged_token},{UNPRIVILEGED_USER},{UNPRIVILEGED_USER}\n"
        )

    def _write_kubeconfig(self, path: str, user: str, token: str) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "real",
                    "cluster": {"server": self.url, "certificate-authority": str(self.ca_file)},
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {
                    "name": f"{user}@real",
                    "context": {"cluster": "real", "user": user, "namespace": "default"},
                }
            ],
            "current-context": f"{user}@real",
        }
        Path(path).write_text(yaml.safe_dump(config, sort_keys=False))
