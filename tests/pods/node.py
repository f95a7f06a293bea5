"""A real single-node Kubernetes cluster with pods, inside a network namespace of its own.

The pod tier runs what users run: etcd and kube-apiserver (the real tier's
build), kube-controller-manager, kube-scheduler and a kubelet built from the
same Debian source (``scripts/pod_tier.py``), with Debian's containerd, runc
and CNI plugins. Everything runs inside a network namespace the node creates;
pods sit on a bridge that exists only there. Nothing listens outside it except
two forwarders on the host's loopback: one to the API server (for the tests'
kubectl, helm and clients) and none back out except the ones a test asks for
(:meth:`PodNode.expose`, e.g. PostgreSQL for the pods).

Addresses (inside the namespace): the node is ``10.88.0.1`` on a bridge of its own,
the API server listens on ``10.88.0.1:6443``, pods get ``10.244.0.0/24`` on
the CNI bridge, whose gateway routes them to the node. There is no kube-proxy
and no DNS: pods reach the API server through the chart's ``apiServer.host``.

Host state the kubelet and containerd touch, and teardown undoes: the sysctls
the kubelet tunes (``vm.overcommit_memory``, ``kernel.panic``,
``kernel.panic_on_oops``, ...), its fixed directories (``/var/lib/kubelet``,
``/var/log/pods``, ``/var/log/containers``), containerd's shim sockets under
``/run/containerd``, CNI's cache under ``/var/lib/cni``, the pods' network
namespaces under ``/run/netns``, the ``kubepods`` cgroups, and every mount
made under those paths. Paths that existed before the node started are left
alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio.client import ApiClient, Configuration

from kopf_reconcile.testing.real_apiserver import (
    ETCD_BINARY,
    KUBE_VERSION,
    ChildProcess,
    RealClusterError,
    apiserver_binary,
    cache_dir,
)

NODE_BUILD_REVISION = 1
NODE_NAME = "pod-tier-node"
NODE_IP = "10.88.0.1"
POD_SUBNET = "10.244.0.0/24"
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"  # the `kubernetes` Service's address: in the certificate, never routed
APISERVER_PORT = 6443
PAUSE_IMAGE = "docker.io/kopf-reconcile/pause:1"
CNI_PLUGINS = Path("/usr/lib/cni")
#: Host sysctls the kubelet sets when it starts (``setupKernelTunables``): restored at teardown.
KUBELET_SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)
#: Fixed host paths the node's components create; removed at teardown if they were not there.
HOST_PATHS = (
    Path("/var/lib/kubelet"),
    Path("/var/log/pods"),
    Path("/var/log/containers"),
    Path("/run/containerd"),
    Path("/var/lib/cni"),
    Path("/run/netns"),
)
CGROUP_ROOT = Path("/sys/fs/cgroup")
_CLONE_NEWNET = 0x40000000


class NodeError(RealClusterError):
    """The node could not be started or did not become Ready; the message says why."""


def node_dir() -> Path:
    """The cached node components (``scripts/pod_tier.py`` builds them)."""
    return cache_dir() / f"kube-node-{KUBE_VERSION}-r{NODE_BUILD_REVISION}"


def missing_parts() -> list[str]:
    """What the pod tier lacks on this machine (empty: it can run)."""
    needed = [
        apiserver_binary(),
        ETCD_BINARY,
        *(node_dir() / name for name in ("kubelet", "kube-controller-manager", "kube-scheduler")),
        node_dir() / "pause.oci.tar",
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


# --- network namespaces ------------------------------------------------------


def socket_in_namespace(namespace: Path, family: int = socket.AF_INET) -> socket.socket:
    """A TCP socket that lives in the network namespace at ``namespace``.

    A socket belongs to the namespace of the thread that creates it, for its whole
    life: a short-lived thread enters the namespace, creates it, and ends (taking its
    namespace with it), so the calling thread never leaves the host's.
    """
    created: list[socket.socket] = []
    failure: list[BaseException] = []

    def create() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(namespace, os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns({namespace}): {os.strerror(errno)}")
            finally:
                os.close(fd)
            created.append(socket.socket(family, socket.SOCK_STREAM))
        except BaseException as exc:  # handed to the calling thread
            failure.append(exc)

    thread = threading.Thread(target=create, name="netns-socket")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return created[0]


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        sink.close()


class Forwarder:
    """A TCP listener piping each connection to an address, across network namespaces.

    ``listen`` and ``connect`` each make a socket; either may be
    :func:`socket_in_namespace`, so the same class takes the host's loopback into the
    node (the API server) and the node's address out to the host (PostgreSQL).
    """

    def __init__(
        self,
        listen: Callable[[], socket.socket],
        listen_address: tuple[str, int],
        connect: Callable[[], socket.socket],
        connect_address: tuple[str, int] | str,
    ) -> None:
        self._listen, self._listen_address = listen, listen_address
        self._connect, self._connect_address = connect, connect_address
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        sock = self._listen()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(self._listen_address)
        sock.listen(128)
        sock.setblocking(False)
        self._server = await asyncio.start_server(self._accept, sock=sock)
        self.port = sock.getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if isinstance(self._connect_address, str):
                up_reader, up_writer = await asyncio.open_unix_connection(self._connect_address)
            else:
                upstream = await asyncio.to_thread(self._connect)
                upstream.setblocking(False)
                await asyncio.get_running_loop().sock_connect(upstream, self._connect_address)
                up_reader, up_writer = await asyncio.open_connection(sock=upstream)
        except OSError:
            writer.close()
            return
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(_pipe(source, sink))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)


# --- host state --------------------------------------------------------------


def _read_sysctl(name: str) -> str | None:
    path = Path("/proc/sys") / name.replace(".", "/")
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _mounts_under(roots: list[Path]) -> list[str]:
    """Mount points at or below any of ``roots``, deepest first."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if any(point == str(root) or point.startswith(f"{root}/") for root in roots):
            found.append(point)
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def _unmount_under(roots: list[Path]) -> None:
    for point in _mounts_under(roots):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)


def _kubepods_cgroups() -> Iterator[Path]:
    """Every ``kubepods`` cgroup the kubelet made, in each hierarchy, deepest first."""
    for hierarchy in sorted(CGROUP_ROOT.iterdir()) if CGROUP_ROOT.is_dir() else []:
        top = hierarchy / "kubepods"
        if top.is_dir() and not top.is_symlink():
            below = [Path(d) for d, _, _ in os.walk(top)]
            yield from sorted(below, key=lambda p: len(p.parts), reverse=True)


def _kill_kubepods() -> None:
    """SIGKILL every process still in a pod's cgroup, then remove the cgroups."""
    for _ in range(50):
        pids = set()
        for group in _kubepods_cgroups():
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (group / "cgroup.procs").read_text().split())
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    for group in _kubepods_cgroups():
        with contextlib.suppress(OSError):
            group.rmdir()


def _kill_shims(containerd_socket: Path) -> None:
    """containerd's shims outlive it: kill the ones serving this node's containerd."""
    marker = str(containerd_socket).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and marker in argv:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


# --- certificates ------------------------------------------------------------


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _issue_certificates(pki: Path) -> None:
    """A CA, and the API server's serving certificate for every address it is reached at."""
    pki.mkdir()
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", pki / "ca.key")
    _openssl("req", "-x509", "-new", "-key", pki / "ca.key", "-subj", "/CN=pod-tier-ca",
             "-days", "2", "-out", pki / "ca.crt")  # fmt: skip
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", pki / "apiserver.key")
    _openssl("req", "-new", "-key", pki / "apiserver.key", "-subj", "/CN=kube-apiserver",
             "-out", pki / "apiserver.csr")  # fmt: skip
    names = [
        f"IP:{NODE_IP}",
        f"IP:{SERVICE_IP}",
        "IP:127.0.0.1",
        "DNS:localhost",
        "DNS:kubernetes",
        "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local",
    ]
    (pki / "apiserver.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage=serverAuth\nsubjectAltName={','.join(names)}\n"
    )
    _openssl("x509", "-req", "-in", pki / "apiserver.csr", "-CA", pki / "ca.crt",
             "-CAkey", pki / "ca.key", "-CAcreateserial", "-days", "2",
             "-extfile", pki / "apiserver.ext", "-out", pki / "apiserver.crt")  # fmt: skip
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", pki / "sa.key")


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
        self._sysctls: dict[str, str] = {}
        self._created_paths: list[Path] = []
        self._namespace_made = False
        self._pod_namespaces_before: set[str] = set()
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
        configuration = Configuration(
            host=self.url,
            api_key={"BearerToken": self.admin_token},
            api_key_prefix={"BearerToken": "Bearer"},
            ssl_ca_cert=str(self.ca_file),
        )
        return ApiClient(configuration)

    def http_session(self, **kwargs: Any) -> aiohttp.ClientSession:
        headers = {**kwargs.pop("headers", {}), "Authorization": f"Bearer {self.admin_token}"}
        tls = ssl.create_default_context(cafile=str(self.ca_file))
        kwargs.setdefault("connector", aiohttp.TCPConnector(ssl=tls))
        return aiohttp.ClientSession(base_url=self.url, headers=headers, **kwargs)

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

    def audit_events(self) -> list[dict[str, Any]]:
        """Every request the API server has answered so far (its audit log, metadata only)."""
        path = self._dir / "audit.log"
        if not path.exists():
            return []
        lines = path.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    async def get(self, address: str, port: int, path: str) -> tuple[int, str]:
        """An HTTP GET to ``address:port`` inside the node (a pod's endpoint): status, body."""
        sock = await asyncio.to_thread(socket_in_namespace, self.namespace)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(sock, (address, port)), 5
            )
        except BaseException:
            sock.close()
            raise
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            writer.write(f"GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n".encode())
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()
        head, _, body = answer.decode(errors="replace").partition("\r\n\r\n")
        return int(head.split()[1]), body

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
        await asyncio.to_thread(_kill_kubepods)
        containerd = [p for p in self._processes if p.name == "containerd"]
        for process in containerd:
            await process.stop()
        if self._workdir is not None:
            _kill_shims(self._dir / "containerd.sock")
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
        for name, value in self._sysctls.items():
            if _read_sysctl(name) != value:
                subprocess.run(["sysctl", "-q", "-w", f"{name}={value}"], check=False)
        self._sysctls.clear()
        netns_dir = Path("/run/netns")
        if netns_dir.is_dir():  # the pods' namespaces (containerd's), then the node's own
            for name in set(os.listdir(netns_dir)) - self._pod_namespaces_before:
                if name.startswith("cni-"):
                    _unmount_under([netns_dir / name])
                    with contextlib.suppress(OSError):
                        (netns_dir / name).unlink()
        if self._namespace_made:
            subprocess.run(["ip", "netns", "delete", self.namespace_name], check=False)
            self._namespace_made = False
        for path in reversed(self._created_paths):
            if path == netns_dir:  # `ip netns` made it a mount point; only while empty
                if path.is_dir() and not os.listdir(path):
                    _unmount_under([path])
                    with contextlib.suppress(OSError):
                        path.rmdir()
            else:
                _unmount_under([path])
                shutil.rmtree(path, ignore_errors=True)
        self._created_paths.clear()
        if self._workdir is not None:
            _unmount_under([self._workdir])
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def _remember_host(self) -> None:
        for name in KUBELET_SYSCTLS:
            value = _read_sysctl(name)
            if value is not None:
                self._sysctls[name] = value
        self._created_paths = [path for path in HOST_PATHS if not path.exists()]
        if Path("/run/netns").is_dir():
            self._pod_namespaces_before = set(os.listdir("/run/netns"))

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
        self._remember_host()
        self._run_on_host("ip", "netns", "add", self.namespace_name)
        self._namespace_made = True
        self._inside("ip", "link", "set", "lo", "up")
        self._inside("ip", "link", "add", "node0", "type", "bridge")
        self._inside("ip", "address", "add", f"{NODE_IP}/32", "dev", "node0")
        self._inside("ip", "link", "set", "node0", "up")
        await asyncio.to_thread(_issue_certificates, self._dir / "pki")
        self._write_configuration()
        etcd_url = await self._start_etcd()
        await self._start_apiserver(etcd_url)
        self.timings["apiserver ready"] = time.monotonic() - started
        node = node_dir()
        self._spawn("containerd", ["containerd", "--config", str(self._dir / "containerd.toml")])
        await self._wait_for((self._dir / "containerd.sock").exists, "containerd")
        await self._ctr("images", "import", "--base-name", PAUSE_IMAGE.rsplit(":", 1)[0],
                        str(node / "pause.oci.tar"))  # fmt: skip
        admin = str(self._dir / "kubeconfig-inside")
        self._spawn("kube-controller-manager", [
            str(node / "kube-controller-manager"), f"--kubeconfig={admin}",
            "--leader-elect=false", "--port=0", "--secure-port=0",
            f"--service-account-private-key-file={self._dir / 'pki' / 'sa.key'}",
            f"--root-ca-file={self.ca_file}", "--use-service-account-credentials=true",
            "--controllers=*", "--node-monitor-grace-period=20s",
        ])  # fmt: skip
        self._spawn("kube-scheduler", [
            str(node / "kube-scheduler"), f"--kubeconfig={admin}",
            "--leader-elect=false", "--port=0", "--secure-port=0",
        ])  # fmt: skip
        self._spawn("kubelet", [
            str(node / "kubelet"), f"--config={self._dir / 'kubelet.yaml'}",
            f"--kubeconfig={self._dir / 'kubeconfig-kubelet'}",
            "--container-runtime=remote",
            f"--container-runtime-endpoint=unix://{self._dir / 'containerd.sock'}",
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
            str(ETCD_BINARY), "--name=default", f"--data-dir={self._dir / 'etcd'}",
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
            f"--secure-port={APISERVER_PORT}", "--insecure-port=0",
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
        self._write_kubeconfig(self.kubeconfig, self.url, "admin", self.admin_token)

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

    def _write_configuration(self) -> None:
        d = self._dir
        (d / "tokens.csv").write_text(
            f'{self.admin_token},admin,admin,"system:masters"\n'
            f'{self.kubelet_token},system:node:{NODE_NAME},kubelet,"system:nodes"\n'
        )
        (d / "audit-policy.yaml").write_text(yaml.safe_dump({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
            "omitStages": ["RequestReceived"], "rules": [{"level": "Metadata"}],
        }))  # fmt: skip
        inside = f"https://{NODE_IP}:{APISERVER_PORT}"
        self._write_kubeconfig(str(d / "kubeconfig-inside"), inside, "admin", self.admin_token)
        self._write_kubeconfig(
            str(d / "kubeconfig-kubelet"), inside, f"system:node:{NODE_NAME}", self.kubelet_token
        )
        (d / "cni").mkdir()
        (d / "cni" / "10-pod-tier.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0",
            "name": "pod-tier",
            "plugins": [{
                "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
                "hairpinMode": True,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                         "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(d / "cni-ipam")},
            }],
        }))  # fmt: skip
        (d / "containerd.toml").write_text(f"""\
version = 2
root = "{d / "containerd" / "root"}"
state = "{d / "containerd" / "state"}"
# Plugins that would write outside the node's directory, or are of no use here.
disabled_plugins = [
  "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp",
]

[grpc]
  address = "{d / "containerd.sock"}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # runc cannot set the sandbox's OOM score without CAP_SYS_RESOURCE, which a VM may lack.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d / "runc"}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_PLUGINS}"
    conf_dir = "{d / "cni"}"
""")
        (d / "kubelet.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "address": NODE_IP,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "volumePluginDir": str(d / "kubelet-volume-plugins"),
            "makeIPTablesUtilChains": False,
            "serializeImagePulls": False,
            # The machine's disk is not the node's concern: never evict for it.
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "podPidsLimit": -1,
        }))  # fmt: skip

    def _write_kubeconfig(self, path: str, server: str, user: str, token: str) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "pods", "cluster": {"server": server,
                                                      "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "pods", "context": {"cluster": "pods", "user": user,
                                                      "namespace": "default"}}],
            "current-context": "pods",
        }  # fmt: skip
        Path(path).write_text(yaml.safe_dump(config, sort_keys=False))
