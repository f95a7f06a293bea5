"""A Helm release on the pod tier's node, driven as a user's shell drives it.

kubectl and helm run with the node's kubeconfig and ``.venv/bin`` first on ``PATH``; the
database the pods use is the session's PostgreSQL, which the node exposes to them at its
own address (:func:`postgres_socket` finds the server's socket to expose).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
from node import APISERVER_PORT, NODE_IP, PodNode

from chart_support import BIN, ROOT, image_archive, image_problem
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.testing import audit
from kopf_reconcile.testing.postgres import EmbeddedPostgres

DATABASE_PORT = 5432


def postgres_socket(dsn: str) -> str:
    """The Unix socket of the session's PostgreSQL (its DSN names the socket directory)."""
    directory = Path(unquote(parse_qs(urlsplit(dsn).query)["host"][0]))
    (found,) = [p for p in directory.glob(".s.PGSQL.*") if p.suffix != ".lock"]
    return str(found)


def pods_dsn(dsn: str, port: int = DATABASE_PORT) -> str:
    """The database as the pods reach it: the node's address (``port`` exposed by
    :meth:`PodNode.expose`), forwarded to the server."""
    parts = urlsplit(dsn)
    return f"postgresql://{parts.username or 'postgres'}@{NODE_IP}:{port}{parts.path}"


def built_image() -> Path:
    """The archive ``make image`` built; fails the test when it is missing or out of date."""
    problem = image_problem()
    if problem:
        pytest.fail(problem, pytrace=False)
    archive = image_archive()
    assert archive is not None
    return archive


async def audited_database(server: EmbeddedPostgres, node: PodNode, port: int) -> str:
    """A new database, with the operator's tables made early so that they are audited, served
    to the pods at the node's ``port``; returns its DSN as the test reaches it."""
    dsn = await server.create_database()
    async with PostgresFencedRepository(dsn) as fence:
        await fence.migrate()
    await audit.install(dsn)
    await node.expose(postgres_socket(dsn), port)
    return dsn


async def assert_no_stale_write(dsn: str, scope: str | None = None) -> None:
    """The database's audit (of ``scope``, or its only one): no stale write, no epoch regress."""
    audit.assert_no_stale_writes(await audit.history(dsn, scope))
    audit.assert_epochs_never_decrease(await audit.applied_writes(dsn, scope))


@dataclass
class Release:
    """One release of the chart in a namespace of its own."""

    node: PodNode
    namespace: str
    name: str

    def _environment(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": self.node.kubeconfig,
                "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}  # fmt: skip

    async def shell(self, argv: list[str], *, cwd: Path = ROOT, stdin: str | None = None) -> str:
        """Run ``argv`` as the user would; fail the test, with what ran, when it fails."""
        result = await asyncio.to_thread(
            subprocess.run, argv, cwd=cwd, env=self._environment(), input=stdin,
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, (
            f"{shlex.join(argv)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            f"\n{await self.describe()}"
        )
        return result.stdout

    async def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return await self.shell([str(BIN / "kubectl"), "-n", self.namespace, *args], stdin=stdin)

    async def helm_install(self, *args: str, cwd: Path = ROOT) -> str:
        """``helm install --wait`` of the chart, with the node's API address (no kube-proxy)."""
        return await self.shell(
            [str(BIN / "helm"), "install", self.name, str(ROOT / "charts" / "kopf-reconcile"),
             "-n", self.namespace, "--wait", "--timeout=180s",
             f"--set=apiServer.host={NODE_IP}", f"--set=apiServer.port={APISERVER_PORT}", *args],
            cwd=cwd,
        )  # fmt: skip

    async def helm_uninstall(self) -> None:
        await self.shell([str(BIN / "helm"), "uninstall", self.name, "-n", self.namespace,
                          "--wait"])  # fmt: skip

    async def get(self, kind: str, name: str | None = None) -> Any:
        """An object (None when it does not exist) or, without a name, the list's items."""
        if name is None:
            return json.loads(await self.kubectl("get", kind, "-o", "json"))["items"]
        found = await self.kubectl("get", kind, name, "--ignore-not-found", "-o", "json")
        return json.loads(found) if found.strip() else None

    async def running_pods(self) -> list[dict[str, Any]]:
        return [
            pod
            for pod in await self.get("pods")
            if pod["metadata"]["name"].startswith(self.name)
            and pod["metadata"].get("deletionTimestamp") is None
            and pod["status"].get("phase") == "Running"
        ]

    async def describe(self) -> str:
        argv = [str(BIN / "kubectl"), "get", "all", "-n", self.namespace, "-o", "wide"]
        result = await asyncio.to_thread(
            subprocess.run, argv, env=self._environment(), capture_output=True, text=True
        )
        return f"{result.stdout}{result.stderr}\n--- kubelet:\n{self.node.component_log('kubelet')}"
