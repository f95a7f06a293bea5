"""Helpers of the chart tests: Helm and kubectl, a recording API proxy, RBAC request attributes.

:class:`RecordingProxy` sits between an operator and the real API server and
records every request's method, path, query and answer, streaming watches
through untouched: what the operator actually asked for, as the API server's
authorizer sees it. :func:`attributes` turns a recorded request into the RBAC
request attributes (verb, API group, resource, subresource, namespace) the
authorizer decides on, so a test can ask the server (SubjectAccessReview)
whether a smaller Role would still allow it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import ssl
import subprocess
import sys
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import aiohttp
import yaml
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from support import eventually

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kopf-reconcile"
BIN = Path(sys.executable).parent
HELM, KUBECTL = BIN / "helm", BIN / "kubectl"
IMAGE_DIR = ROOT / "build" / "image"
EXAMPLE = ROOT / "operator" / "examples" / "devices.py"
#: Response headers a proxy must not copy (aiohttp sets its own framing).
HOP_BY_HOP = {"transfer-encoding", "content-length", "connection", "content-encoding"}


def helm(
    *args: str, kubeconfig: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    extra = [f"--kubeconfig={kubeconfig}"] if kubeconfig else []
    return subprocess.run(
        [str(HELM), *extra, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


async def ahelm(*args: str, kubeconfig: str | None = None) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(helm, *args, kubeconfig=kubeconfig)


def rendered(*args: str, chart: Path = CHART) -> list[dict[str, Any]]:
    """``helm template devices CHART --namespace=ops ARGS``: its documents (it must succeed)."""
    result = helm("template", "devices", str(chart), "--namespace=ops", *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    query: str
    status: int
    # The impersonation it asked for (the fenced client acts as itself with its lease).
    impersonation: tuple[Attributes, ...] = ()


@dataclass(frozen=True)
class Attributes:
    """What RBAC decides on for one resource request."""

    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str = ""  # for rules with resourceNames (impersonating one account)

    def review(self, user: str) -> dict[str, Any]:
        """A SubjectAccessReview of these attributes for ``user``."""
        return {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": user,
                "groups": ["system:serviceaccounts", "system:authenticated"],
                "resourceAttributes": {
                    "verb": self.verb,
                    "group": self.group,
                    "resource": self.resource,
                    "subresource": self.subresource,
                    "namespace": self.namespace,
                    "name": self.name,
                },
            },
        }


async def api(http: aiohttp.ClientSession, method: str, path: str, body: Any = None) -> Any:
    """One API request that must succeed; its decoded answer."""
    async with http.request(method, path, json=body) as response:
        text = await response.text()
        assert response.status < 300, f"{method} {path}: {response.status} {text}"
        return json.loads(text) if text else None


def role_path(doc: dict[str, Any], namespace: str) -> str:
    plural = "clusterroles" if doc["kind"] == "ClusterRole" else "roles"
    where = "" if doc["kind"] == "ClusterRole" else f"/namespaces/{namespace}"
    return f"/apis/rbac.authorization.k8s.io/v1{where}/{plural}/{doc['metadata']['name']}"


async def denied(
    http: aiohttp.ClientSession, user: str, wanted: set[Attributes]
) -> set[Attributes]:
    """Which of ``wanted`` the API server's authorizer denies ``user`` now."""
    out = set()
    for attrs in wanted:
        review = await api(
            http, "POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", attrs.review(user)
        )
        if not review["status"].get("allowed"):
            out.add(attrs)
    return out


async def assert_every_verb_is_needed(
    http: aiohttp.ClientSession,
    manifest: list[dict[str, Any]],
    namespace: str,
    user: str,
    used: set[Attributes],
) -> None:
    """Take each verb out of each rule of the release's roles in turn: ``user`` must then be
    denied one of the requests it made (``used``); each rule is restored before the next."""

    async def any_denied() -> bool:
        return bool(await denied(http, user, used))

    async def none_denied() -> bool:
        return not await denied(http, user, used)

    for doc in manifest:
        if doc["kind"] not in ("Role", "ClusterRole"):
            continue
        path = role_path(doc, namespace)
        original = await api(http, "GET", path)
        for index, rule in enumerate(original["rules"]):
            if "nonResourceURLs" in rule:
                continue  # the scrapers' grant on /metrics, not the operator's
            for verb in rule["verbs"]:
                smaller = copy.deepcopy(original)
                smaller["rules"][index]["verbs"].remove(verb)
                if not smaller["rules"][index]["verbs"]:
                    del smaller["rules"][index]
                smaller = await api(http, "PUT", path, smaller)
                what = f"{doc['kind']} {doc['metadata']['name']}: {rule['resources']} {verb}"
                try:
                    await eventually(any_denied, timeout=10, message=f"something used needs {what}")
                finally:  # restored even when the check fails: later steps need the role
                    restored = {**original, "metadata": smaller["metadata"]}
                    original = await api(http, "PUT", path, restored)
                await eventually(none_denied, timeout=10, message=f"{what} restored")


def impersonated(username: str, extra: Mapping[str, list[str]]) -> set[Attributes]:
    """What the API server authorizes for a request acting as ``username`` with ``extra``:
    ``impersonate`` on that account (or user) and on each extra's key and value."""
    prefix = "system:serviceaccount:"
    if username.startswith(prefix):
        namespace, name = username.removeprefix(prefix).split(":", 1)
        wanted = {Attributes("impersonate", "", "serviceaccounts", "", namespace, name)}
    else:
        wanted = {Attributes("impersonate", "", "users", "", "", username)}
    for key, values in extra.items():
        for value in values:
            wanted.add(
                Attributes("impersonate", "authentication.k8s.io", "userextras", key, "", value)
            )
    return wanted


def requested_impersonation(headers: CIMultiDictProxy[str]) -> tuple[Attributes, ...]:
    """The impersonation a request's headers ask for (none: no ``Impersonate-User``)."""
    items = list(headers.items())
    user = next((v for k, v in items if k.lower() == "impersonate-user"), None)
    if user is None:
        return ()
    prefix = "impersonate-extra-"
    extra: dict[str, list[str]] = {}
    for key, value in items:
        if key.lower().startswith(prefix):
            extra.setdefault(unquote(key.lower().removeprefix(prefix)), []).append(value)
    groups = headers.getall("Impersonate-Group", [])
    wanted = impersonated(user, extra)
    wanted |= {Attributes("impersonate", "", "groups", "", "", g) for g in groups}
    return tuple(sorted(wanted, key=repr))


def attributes(request: Recorded) -> Attributes | None:
    """The RBAC attributes of ``request``; ``None`` for discovery and other non-resource paths."""
    parts = [p for p in request.path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 2:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if not rest:
        return None  # the group version's discovery document
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name = rest[0], rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if resource == "namespaces" and name:
        namespace = name  # a namespace is its own namespace, for RBAC
    query = parse_qs(request.query)
    watching = query.get("watch", ["false"])[0] in ("1", "true")
    verb = {
        "GET": "watch" if watching else ("get" if name else "list"),
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if name else "deletecollection",
    }[request.method]
    return Attributes(verb, group, resource, subresource, namespace)


class RecordingProxy:
    """An HTTP proxy on 127.0.0.1 to an HTTPS API server, recording every request."""

    def __init__(self, upstream: str, ca_file: Path) -> None:
        self.upstream = upstream
        self.records: list[Recorded] = []
        self._tls = ssl.create_default_context(cafile=str(ca_file))
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    async def __aenter__(self) -> RecordingProxy:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._tls),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
        )
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        # Watches stream through until the end: do not wait a minute for them at shutdown.
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()  # ends every stream still open
        if self._runner is not None:
            await self._runner.cleanup()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() != "host")
        body = await request.read()
        async with self._session.request(
            request.method,
            f"{self.upstream}{request.rel_url}",
            headers=headers,
            data=body or None,
        ) as upstream:
            self.records.append(
                Recorded(
                    request.method,
                    request.path,
                    request.query_string,
                    upstream.status,
                    requested_impersonation(request.headers),
                )
            )
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_BY_HOP:
                    response.headers[key] = value
            await response.prepare(request)
            with contextlib.suppress(ConnectionResetError, aiohttp.ClientError):
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            return response


def service_account_kubeconfig(path: Path, server: str, token: str, namespace: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "proxy", "cluster": {"server": server}}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [
            {
                "name": "operator",
                "context": {"cluster": "proxy", "user": "operator", "namespace": namespace},
            }
        ],
        "current-context": "operator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


class OperatorProcess:
    """``kopf-reconcile run`` in a subprocess, its output kept, stopped by its PID."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.argv, self.env, self.log = argv, env, log
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log.open("wb") as out:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def stop(self, timeout: float = 30) -> int | None:
        process = self.process
        if process is None or process.returncode is not None:
            return None if process is None else process.returncode
        process.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(process.wait(), timeout)
        except TimeoutError:
            process.kill()
            return await process.wait()


def build_image_module() -> Any:
    """``scripts/build_image.py`` as a module (its recipe, digest and readers)."""
    import importlib

    scripts = str(ROOT / "scripts")
    sys.path.insert(0, scripts)
    try:
        return importlib.import_module("build_image")
    finally:
        sys.path.remove(scripts)


def image_archive() -> Path | None:
    """The archive ``make image`` wrote, if any."""
    found = sorted(IMAGE_DIR.glob("kopf-reconcile-*.oci.tar"))
    return found[-1] if found else None


def image_problem() -> str | None:
    """Why the image cannot be tested (missing, or older than the sources), else ``None``."""
    archive = image_archive()
    if archive is None:
        return "no image: run `make image` (make test does)"
    if not build_image_module().image_is_current(archive):
        return f"{archive} is older than the sources: run `make image` (make test does)"
    return None


def unpack_image(archive: Path, where: Path) -> Path:
    """The image's root file system, unpacked by umoci into ``where``; returns the rootfs."""
    layout = where / "layout"
    layout.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(layout, filter="tar")
    bundle = where / "bundle"
    tag = archive.name.removeprefix("kopf-reconcile-").removesuffix(".oci.tar")
    subprocess.run(
        ["umoci", "unpack", "--image", f"{layout}:{tag}", str(bundle)],
        check=True,
        capture_output=True,
    )
    return bundle / "rootfs"


def clean_env(**extra: str) -> dict[str, str]:
    """A process environment with nothing that would choose an elector or pod identity."""
    keep = ("PATH", "LANG", "LC_ALL", "HOME", "TMPDIR")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, **extra}


class SocketForwarder:
    """A TCP port on 127.0.0.1 piped to the Unix socket of a PostgreSQL DSN.

    The session's PostgreSQL listens on a Unix socket under the host's /tmp, which a
    process in the image's root file system cannot see; this gives it a TCP address.
    """

    def __init__(self, dsn: str) -> None:
        parts = urlsplit(dsn)
        socket_dir = Path(unquote(parse_qs(parts.query)["host"][0]))
        (self.socket,) = [p for p in socket_dir.glob(".s.PGSQL.*") if p.suffix != ".lock"]
        self.user = parts.username or "postgres"
        self.database = unquote(parts.path.lstrip("/"))
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self.dsn = ""

    async def __aenter__(self) -> SocketForwarder:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.dsn = f"postgresql://{self.user}@127.0.0.1:{port}/{self.database}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(str(self.socket))
        except OSError:
            writer.close()
            return
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            sink.close()
