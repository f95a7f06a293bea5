"""A real single-node Kubernetes cluster with pods, inside a network namespace of its own.

The pod tier runs what users run: etcd and kube-apiserver (the real tier's
build), kube-controller-manager, kube-scheduler and a kubelet of the same
release built by the same recipe (``scripts/pod_tier.py``), with Debian's
containerd, runc and CNI plugins. Everything runs inside a network namespace the node creates;
pods sit on a bridge that exists only there. The host reaches the API server
through a forwarder on its loopback (``netns.py``); pods reach what a test
exposes (:meth:`PodNode.expose`, e.g. PostgreSQL) at the node's address.

Addresses (inside the namespace): the node is ``10.88.0.1`` on a bridge of its
own, the API server listens on ``10.88.0.1:6443``, pods get ``10.244.0.0/24`` on
the CNI bridge, whose gateway routes them to the node. There is no kube-proxy
and no DNS: pods reach the API server through the chart's ``apiServer.host``.

``node_files.py`` writes what the components read (certificates,
configuration); ``host.py`` remembers the host state the kubelet and containerd
change and puts it back at teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
from host import HostState, kill_kubepods, kill_shims, unmount_under
from kubernetes_asyncio.client import ApiClient
from netns import Forwarder, socket_in_namespace
from node_files import (
    APISERVER_PORT,
    CNI_PLUGINS,
    NODE_IP,
    NODE_NAME,
    PAUSE_IMAGE,
    SERVICE_CLUSTER_IP_RANGE,
    issue_certificates,
    write_configuration,
    write_kubeconfig,
)

from kopf_reconcile.testing.kube_release import (
    apiserver_feature_flags,
    etcd_binary,
    kube_binary,
    pause_archive,
)
from kopf_reconcile.testing.real_apiserver import (
    ChildProcess,
    RealClusterError,
    apiserver_binary,
    token_api_client,
    token_http_session,
)


class NodeError(RealClusterError):
    """The node could not be started or did not become Ready; the message says why."""


def missing_parts() -> list[str]:
    """What the pod tier lacks on this machine (empty: it can run)."""
    needed = [
        apiserver_binary(),
        etcd_binary(),
        *(kube_binary(name) for name in ("kubelet", "kube-controller-manager", "kube-scheduler")),
        pause_archive(),
        CNI_PLUGINS / "bridge",
        CNI_PLUGINS / "host-local",
        CNI_PLUGINS / "loopback",
    ]
    missing = [str(path) for path in needed if not path.exists()]
    missing += [
        tool for tool in ("containerd", "runc", "ctr", "ip", "nsenter") if not shutil.which(tool)
    ]
    if os.geteuid() != 0:
        missing.append("root (a kubelet and network namespaces need it)")
    return missing


# --- the node ----------------------------------------------------------------


class PodNode:
    """One node that runs pods, for one ``async with`` block.

    ``kubeconfig`` is an administrator's, for kubectl and helm on the host; ``url``
    is the host-side forwarder to the API server; ``api_client()`` is a
    kubernetes-asyncio client on it. ``timings`` records how long each phase took.
    """

    def __init__(self, *, ready_timeout: float = 120.0) -> None:
        self.ready_timeout = ready_timeout
        self.admin_token = secrets.token_hex(16)
        self.kubelet_token = secrets.token_hex(16)
        self.namespace_name = f"kr-pods-{secrets.token_hex(4)}"
        self.timings: dict[str, float] = {}
        self._workdir: Path | None = None
        self._processes: list[ChildProcess] = []
        self._forwarders: list[Forwarder] = []
        self._host = HostState()
        self._namespace_made = False
        self._api_forwarder: Forwarder | None = None

    # --- what tests use ------------------------------------------------------

    @property
    def namespace(self) -> Path:
        """The node's network namespace (a file to ``setns`` into)."""
        return Path("/run/netns") / self.namespace_name

    @property
    def url(self) -> str:
        assert self._api_forwarder is not None
        return f"https://127.0.0.1:{self._api_forwarder.port}"

    @property
    def kubeconfig(self) -> str:
        return str(self._dir / "kubeconfig")

    @property
    def ca_file(self) -> Path:
        return self._dir / "pki" / "ca.crt"

    @property
    def log_dir(self) -> Path:
        return self._dir

    def api_client(self) -> ApiClient:
        return token_api_client(self.url, self.admin_token, self.ca_file)

    def http_session(self, **kwargs: Any) -> aiohttp.ClientSession:
        return token_http_session(self.url, self.admin_token, self.ca_file, **kwargs)

    async def expose(self, target: str | tuple[str, int], port: int) -> None:
        """Make ``target`` (a Unix socket path or a host loopback address) reachable by pods.

        It is served at ``NODE_IP:port`` inside the node's namespace.
        """
        forwarder = Forwarder(
            listen=lambda: socket_in_namespace(self.namespace),
            listen_address=(NODE_IP, port),
            connect=lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM),
            connect_address=target,
        )
        await forwarder.start()
        self._forwarders.append(forwarder)

    async def import_image(self, archive: Path, name: str) -> None:
        """Load an OCI archive into the node's containerd as ``name`` (never pulled)."""
        await self._ctr("images", "import", "--base-name", name, str(archive))

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (JSON lines, audit.k8s.io/v1 Events)."""
        return self._dir / "audit.log"

    async def freeze(self, namespace: str, pod: str, container: str) -> str:
        """Pause a running container's processes with the cgroup freezer (a SIGSTOP of all
        of them, which they cannot notice); its task id, for :meth:`thaw`."""
        for line in (await self._ctr("tasks", "ls")).splitlines()[1:]:
            task, _, status = line.split()
            if status != "RUNNING":
                continue
            labels = json.loads(await self._ctr("containers", "info", task)).get("Labels") or {}
            if (
                labels.get("io.cri-containerd.kind") == "container"
                and labels.get("io.kubernetes.pod.namespace") == namespace
                and labels.get("io.kubernetes.pod.name") == pod
                and labels.get("io.kubernetes.container.name") == container
            ):
                await self._ctr("tasks", "pause", task)
                return task
        raise NodeError(f"no running container {container} in pod {namespace}/{pod}")

    async def thaw(self, task: str) -> None:
        await self._ctr("tasks", "resume", task)

    def audit_events(self) -> list[dict[str, Any]]:
        """Every request the API server has answered so far (its audit log, metadata only)."""
        path = self._dir / "audit.log"
        if not path.exists():
            return []
        lines = path.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    async def running_containers(self) -> list[str]:
        """``namespace/pod/container`` of every running container but the pods' sandboxes."""
        running = []
        for line in (await self._ctr("tasks", "ls")).splitlines()[1:]:
            task, _, status = line.split()
            if status != "RUNNING":
                continue
            info = json.loads(await self._ctr("containers", "info", task))
            labels = info.get("Labels") or {}
            if labels.get("io.cri-containerd.kind") == "container":
                running.append(
                    f"{labels.get('io.kubernetes.pod.namespace')}/"
                    f"{labels.get('io.kubernetes.pod.name')}/"
                    f"{labels.get('io.kubernetes.container.name')}"
                )
        return running

    def container_logs(self, namespace: str, container: str) -> dict[str, str]:
        """The kubelet's log files of ``container`` in every pod of ``namespace``, by pod.

        The kubelet keeps them under the fixed ``/var/log/pods``, in CRI's format (time,
        stream, tag, message); this returns the messages. Deleted pods' logs are there
        until the kubelet's container garbage collection removes them.
        """
        logs: dict[str, str] = {}
        for directory in Path("/var/log/pods").glob(f"{namespace}_*"):
            lines = []
            for file in sorted((directory / container).glob("*.log")):
                with contextlib.suppress(OSError):
                    lines += [
                        parts[3]
                        for line in file.read_text(errors="replace").splitlines()
                        if len(parts := line.split(" ", 3)) == 4
                    ]
            logs[directory.name.split("_")[1]] = "\n".join(lines)
        return logs

    def component_log(self, name: str, lines: int = 40) -> str:
        for process in self._processes:
            if process.name == name:
                return process.log_tail(lines)
        return ""

    # --- lifecycle -----------------------------------------------------------

    async def __aenter__(self) -> PodNode:
        missing = missing_parts()
        if missing:
            raise NodeError(f"the pod tier cannot run here; missing: {', '.join(missing)}")
        self._workdir = Path(tempfile.mkdtemp(prefix="kr-pods-", dir="/dev/shm"))
        try:
            await self._start()
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
        """Stop everything, then put the host back as it was. Idempotent."""
        for forwarder in self._forwarders:
            await forwarder.stop()
        self._forwarders.clear()
        kubelet = [p for p in self._processes if p.name == "kubelet"]
        for process in kubelet:
            await process.stop()
        await asyncio.to_thread(kill_kubepods)
        containerd = [p for p in self._processes if p.name == "containerd"]
        for process in containerd:
            await process.stop()
        if self._workdir is not None:
            kill_shims(self._dir / "containerd.sock")
        while self._processes:
            await self._processes.pop().stop()
        await asyncio.to_thread(self._restore_host)

    # --- internals -----------------------------------------------------------

    @property
    def _dir(self) -> Path:
        if self._workdir is None:
            raise RuntimeError("the node is not running")
        return self._workdir

    def _restore_host(self) -> None:
        self._host.restore_sysctls()
        self._host.remove_pod_namespaces()
        if self._namespace_made:
            subprocess.run(["ip", "netns", "delete", self.namespace_name], check=False)
            self._namespace_made = False
        self._host.remove_created_paths()
        if self._workdir is not None:
            unmount_under([self._workdir])
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def _spawn(self, name: str, argv: list[str]) -> ChildProcess:
        """Run ``argv`` inside the node's network namespace (and the host's mounts)."""
        inside = ["nsenter", f"--net={self.namespace}", "--", *argv]
        process = ChildProcess(name, inside, self._dir / f"{name}.log")
        self._processes.append(process)
        return process

    @staticmethod
    def _run_on_host(*argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True)

    def _inside(self, *argv: str) -> None:
        subprocess.run(["nsenter", f"--net={self.namespace}", "--", *argv], check=True,
                       capture_output=True)  # fmt: skip

    async def _start(self) -> None:
        started = time.monotonic()
        self._host.remember()
        self._run_on_host("ip", "netns", "add", self.namespace_name)
        self._namespace_made = True
        self._inside("ip", "link", "set", "lo", "up")
        self._inside("ip", "link", "add", "node0", "type", "bridge")
        self._inside("ip", "address", "add", f"{NODE_IP}/32", "dev", "node0")
        self._inside("ip", "link", "set", "node0", "up")
        await asyncio.to_thread(issue_certificates, self._dir / "pki")
        write_configuration(self._dir, self.admin_token, self.kubelet_token)
        etcd_url = await self._start_etcd()
        await self._start_apiserver(etcd_url)
        self.timings["apiserver ready"] = time.monotonic() - started
        self._spawn("containerd", ["containerd", "--config", str(self._dir / "containerd.toml")])
        await self._wait_for((self._dir / "containerd.sock").exists, "containerd")
        await self._ctr("images", "import", "--base-name", PAUSE_IMAGE.rsplit(":", 1)[0],
                        str(pause_archive()))  # fmt: skip
        admin = str(self._dir / "kubeconfig-inside")
        self._spawn("kube-controller-manager", [
            str(kube_binary("kube-controller-manager")), f"--kubeconfig={admin}",
            "--leader-elect=false", "--secure-port=0",
            f"--service-account-private-key-file={self._dir / 'pki' / 'sa.key'}",
            f"--root-ca-file={self.ca_file}", "--use-service-account-credentials=true",
            "--controllers=*", "--node-monitor-grace-period=20s",
        ])  # fmt: skip
        self._spawn("kube-scheduler", [
            str(kube_binary("kube-scheduler")), f"--kubeconfig={admin}",
            "--leader-elect=false", "--secure-port=0",
        ])  # fmt: skip
        self._spawn("kubelet", [
            str(kube_binary("kubelet")), f"--config={self._dir / 'kubelet.yaml'}",
            f"--kubeconfig={self._dir / 'kubeconfig-kubelet'}",
            f"--root-dir={self._dir / 'kubelet'}", f"--cert-dir={self._dir / 'kubelet-pki'}",
            f"--node-ip={NODE_IP}", f"--hostname-override={NODE_NAME}",
            "--runtime-request-timeout=5m", "--v=1",
        ])  # fmt: skip
        await self._wait_for_node_ready()
        self.timings["node ready"] = time.monotonic() - started

    async def _ctr(self, *args: str) -> str:
        argv = [
            "ctr",
            "--address",
            str(self._dir / "containerd.sock"),
            "--namespace",
            "k8s.io",
            *args,
        ]
        result = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True,
                                         check=False)  # fmt: skip
        if result.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    async def _start_etcd(self) -> str:
        client_url = "http://127.0.0.1:2379"  # the node's own loopback
        self._spawn("etcd", [
            str(etcd_binary()), "--name=default", f"--data-dir={self._dir / 'etcd'}",
            f"--listen-client-urls={client_url}", f"--advertise-client-urls={client_url}",
            "--listen-peer-urls=http://127.0.0.1:2380",
            "--initial-advertise-peer-urls=http://127.0.0.1:2380",
            "--initial-cluster=default=http://127.0.0.1:2380",
            "--logger=zap", "--log-level=warn",
        ])  # fmt: skip
        return client_url

    async def _start_apiserver(self, etcd_url: str) -> None:
        pki = self._dir / "pki"
        self._spawn("kube-apiserver", [
            str(apiserver_binary()), f"--etcd-servers={etcd_url}",
            "--bind-address=0.0.0.0", f"--advertise-address={NODE_IP}",
            f"--secure-port={APISERVER_PORT}", *apiserver_feature_flags(),
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={pki / 'sa.key'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--token-auth-file={self._dir / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--allow-privileged=false", "--kubelet-preferred-address-types=InternalIP",
            f"--audit-policy-file={self._dir / 'audit-policy.yaml'}",
            f"--audit-log-path={self._dir / 'audit.log'}", "--audit-log-format=json",
        ])  # fmt: skip
        self._api_forwarder = Forwarder(
            listen=lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM),
            listen_address=("127.0.0.1", 0),
            connect=lambda: socket_in_namespace(self.namespace),
            connect_address=(NODE_IP, APISERVER_PORT),
        )
        await self._api_forwarder.start()
        self._forwarders.append(self._api_forwarder)
        write_kubeconfig(self._dir, self.kubeconfig, self.url, "admin", self.admin_token)

        async def ready() -> bool:
            async with self.http_session(timeout=aiohttp.ClientTimeout(total=5)) as session:
                for path in ("/readyz", "/api/v1/namespaces/default"):
                    async with session.get(path) as response:
                        if response.status != 200:
                            return False
            return True

        await self._wait_for_async(ready, "kube-apiserver")

    async def _wait_for_node_ready(self) -> None:
        async def ready() -> bool:
            timeout = aiohttp.ClientTimeout(total=5)
            async with (
                self.http_session(timeout=timeout) as session,
                session.get(f"/api/v1/nodes/{NODE_NAME}") as response,
            ):
                if response.status != 200:
                    return False
                node = await response.json()
            conditions = node.get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        await self._wait_for_async(ready, "kubelet")

    async def _wait_for(self, check: Callable[[], bool], name: str) -> None:
        async def wrapped() -> bool:
            return check()

        await self._wait_for_async(wrapped, name)

    async def _wait_for_async(self, check: Callable[[], Any], name: str) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while True:
            for process in self._processes:
                code = process.exited()
                if code is not None:
                    raise NodeError(
                        f"{process.name} exited with code {code} while the node started; "
                        f"its log ends with:\n{process.log_tail()}"
                    )
            try:
                if await check():
                    return
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}:\n{p.log_tail(15)}" for p in self._processes)
                raise NodeError(f"{name} not ready after {self.ready_timeout:.0f} s\n{logs}")
            await asyncio.sleep(0.2)
