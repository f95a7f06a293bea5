"""Helpers of the end-to-end tests: operator processes, Device objects, the PostgreSQL store.

:class:`Operators` starts ``kopf-reconcile run`` / ``kopf run`` subprocesses with a clean
environment (nothing inherited that would pick a leader elector or a pod identity), captures
their output, and stops every one it started (SIGTERM, then SIGKILL). :class:`Devices`
creates, changes and reads Device objects of the example's CRD in one namespace;
:class:`Store` reads what the example wrote to PostgreSQL.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import kopf

from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from support import eventually

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "operator" / "examples" / "devices.py"
OPERATORS = Path(__file__).parent / "operators"
DEVICES_CRD = ROOT / "crds" / "devices.yaml"
WEBSITES = ROOT / "operator" / "examples" / "websites.py"
WEBSITES_CRD = ROOT / "crds" / "websites.yaml"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
BIN = Path(sys.executable).parent
# The example's reconciler id (the default: resource, then function), hence its lease and
# fence scope.
RECONCILER_ID = "devices.example.com-reconcile-device"
CONTROLLER = RECONCILER_ID  # ... and its metrics' controller label
MERGE = {"Content-Type": "application/merge-patch+json"}
HTTP_OK, HTTP_NOT_FOUND = 200, 404
# What a process must not inherit: it would choose the leader elector or the pod identity.
_INHERITED_NOT = ("KUBERNETES_SERVICE_HOST", "POD_NAME", "POD_NAMESPACE", "KOPF_RUN_PEERING")
_ENDPOINTS = re.compile(r"serving (http://[0-9.]+:[0-9]+)/metrics")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


class Operator:
    """One operator process and everything it printed."""

    def __init__(self, name: str, process: asyncio.subprocess.Process) -> None:
        self.name = name
        self.process = process
        self.output: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            self.output.append(line.decode(errors="replace").rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.output)

    def lines(self, *fragments: str) -> list[str]:
        """Printed lines containing every fragment."""
        return [line for line in self.output if all(f in line for f in fragments)]

    async def printed(self, *fragments: str, timeout: float = 20) -> str:
        """Wait for a line containing every fragment; the first such line."""
        await eventually(
            lambda: bool(self.lines(*fragments)) or self.process.returncode is not None,
            timeout=timeout,
            message=f"{self.name} printing {fragments}",
        )
        found = self.lines(*fragments)
        assert found, f"{self.name} exited ({self.process.returncode}) first:\n{self.text}"
        return found[0]

    async def endpoints(self) -> str:
        """The base URL of ``/metrics``, ``/healthz``, ``/readyz`` (from the startup log)."""
        match = _ENDPOINTS.search(await self.printed("serving http://"))
        assert match is not None
        return match.group(1)

    async def get(self, path: str) -> tuple[int, str]:
        async with aiohttp.ClientSession() as http, http.get(await self.endpoints() + path) as r:
            return r.status, await r.text()

    async def metrics(self) -> dict[str, float]:
        """Samples of the kopf_reconcile_* series, keyed by name{labels}."""
        status, text = await self.get("/metrics")
        assert status == 200
        samples = {}
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match and match.group(1).startswith("kopf_reconcile_"):
                samples[match.group(1)] = float(match.group(2))
        return samples

    async def is_leader(self) -> bool:
        samples = await self.metrics()
        return samples.get(f'kopf_reconcile_leader{{controller="{CONTROLLER}",shard=""}}') == 1.0

    async def reconciles(self) -> float:
        """How many reconciles this process ran (any result)."""
        prefix = f'kopf_reconcile_reconcile_total{{controller="{CONTROLLER}",'
        return sum(v for k, v in (await self.metrics()).items() if k.startswith(prefix))

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    async def stop(self, timeout: float = 20) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; the exit status."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                self.process.kill()
        await self.process.wait()
        await self._reader
        return self.process.returncode if self.process.returncode is not None else -1


class Operators:
    """Starts operator processes for one test and stops them all afterwards."""

    def __init__(self, kubeconfig: str, namespace: str) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.started: list[Operator] = []

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        inherited = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("KOPF_RECONCILE_") and k not in _INHERITED_NOT
        }
        return {**inherited, "KUBECONFIG": self.kubeconfig, "PYTHONUNBUFFERED": "1", **env}

    async def start(
        self,
        *args: str,
        command: str = "kopf-reconcile",
        handlers: Path = EXAMPLE,
        env: dict[str, str] | None = None,
        name: str | None = None,
    ) -> Operator:
        """``<command> run <handlers> --namespace=<test namespace> <args>``."""
        argv: list[str] = [
            str(BIN / command),
            "run",
            str(handlers),
            f"--namespace={self.namespace}",
        ]
        if command == "kopf-reconcile":
            argv.append("--metrics-port=0")
        process = await asyncio.create_subprocess_exec(
            *argv,
            *args,
            env=self.environment(env or {}),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        operator = Operator(name or f"{command}#{len(self.started)}", process)
        self.started.append(operator)
        return operator

    async def run_to_exit(
        self,
        *args: str,
        command: str = "kopf-reconcile",
        handlers: Path = EXAMPLE,
        env: dict[str, str] | None = None,
    ) -> tuple[int, str]:
        """Start an operator that is expected to exit by itself; its status and output."""
        operator = await self.start(*args, command=command, handlers=handlers, env=env)
        try:
            await asyncio.wait_for(operator.process.wait(), 30)
        finally:
            await operator.stop()
        return operator.process.returncode or 0, operator.text

    async def command(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
        """Run ``kopf-reconcile <args>`` to completion: its exit status and output."""
        process = await asyncio.create_subprocess_exec(
            str(BIN / "kopf-reconcile"),
            *args,
            env=self.environment(env or {}),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(process.communicate(), 60)
        return process.returncode or 0, output.decode()

    async def stop_all(self) -> None:
        await asyncio.gather(*(o.stop() for o in self.started))


class Devices:
    """Device objects of the example's CRD in one namespace, over plain HTTP."""

    def __init__(self, http: aiohttp.ClientSession, namespace: str) -> None:
        self.http = http
        self.namespace = namespace
        self.url = f"/apis/example.com/v1/namespaces/{namespace}/devices"

    async def create(self, name: str, desired: str) -> None:
        body = {
            "apiVersion": "example.com/v1",
            "kind": "Device",
            "metadata": {"name": name},
            "spec": {"desired": desired},
        }
        async with self.http.post(self.url, json=body) as response:
            assert response.status == 201, await response.text()

    async def set(self, name: str, desired: str) -> None:
        patch = {"spec": {"desired": desired}}
        async with self.http.patch(f"{self.url}/{name}", json=patch, headers=MERGE) as response:
            assert response.status == 200, await response.text()

    async def delete(self, name: str) -> None:
        async with self.http.delete(f"{self.url}/{name}") as response:
            assert response.status == 200, await response.text()

    async def get(self, name: str) -> dict[str, Any] | None:
        async with self.http.get(f"{self.url}/{name}") as response:
            if response.status == 404:
                return None
            assert response.status == 200, await response.text()
            result: dict[str, Any] = await response.json()
            return result

    async def all(self) -> list[dict[str, Any]]:
        async with self.http.get(self.url) as response:
            assert response.status == 200, await response.text()
            items: list[dict[str, Any]] = (await response.json())["items"]
            return items


class Store:
    """What the example wrote to PostgreSQL (through the fenced repository's readers)."""

    def __init__(self, repository: PostgresFencedRepository, namespace: str) -> None:
        self.repository = repository
        self.namespace = namespace

    async def state(self, name: str) -> dict[str, Any] | None:
        return await self.repository.get_state(f"{self.namespace}/{name}")

    async def epoch(self, name: str) -> int | None:
        return await self.repository.last_epoch(f"{self.namespace}/{name}")


async def converged(devices: Devices, store: Store | None, names: Sequence[str]) -> bool:
    """Every named Device reports its spec in status, and the store holds that spec."""
    for name in names:
        device = await devices.get(name)
        if device is None:
            return False
        status = device.get("status") or {}
        desired = device["spec"]["desired"]
        generation = device["metadata"]["generation"]
        if status.get("observed") != desired or status.get("observedGeneration") != generation:
            return False
        if store is not None:
            try:
                state = await store.state(name)
            except Exception:  # the operator has not created its table yet
                return False
            if state != {"desired": desired, "generation": generation}:
                return False
            if status.get("epoch") != await store.epoch(name):
                return False
    return True


def kopf_traces(body: dict[str, Any]) -> list[str]:
    """Annotations and finalizers kopf would leave on an object it handled."""
    metadata = body["metadata"]
    annotations = [k for k in metadata.get("annotations") or {} if "kopf" in k]
    return annotations + list(metadata.get("finalizers") or [])


async def read_object(http: aiohttp.ClientSession, path: str) -> dict[str, Any] | None:
    """The object at ``path``, or None when there is none."""
    async with http.get(path) as response:
        if response.status == HTTP_NOT_FOUND:
            return None
        assert response.status == HTTP_OK, await response.text()
        body: dict[str, Any] = await response.json()
        return body


@asynccontextmanager
async def kopf_running(
    registry: Any, cluster_url: str, *, stop_timeout: float = 20, **options: Any
) -> AsyncIterator[asyncio.Task[Any]]:
    """kopf's operator on ``registry`` in this process, against ``cluster_url``, stopped at exit.

    ``options`` go to ``kopf.operator`` (such as ``namespaces`` or ``clusterwide``).
    """

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=cluster_url)

    stop = asyncio.Event()
    operator = asyncio.create_task(kopf.operator(registry=registry, stop_flag=stop, **options))
    try:
        yield operator
    finally:
        stop.set()
        await asyncio.wait_for(operator, stop_timeout)
