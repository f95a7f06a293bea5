"""kopf runs against the cluster as against a real one: ``kopf run --standalone`` with the
cluster's kubeconfig, an ``on.event`` operator and an ``on.create/update/delete`` operator
(whose finalizer patches must apply), on a built-in kind and on a custom resource."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from widget_kind import Widgets

from support import eventually

pytestmark = pytest.mark.slow

OPERATORS = Path(__file__).parent / "operators"
KOPF = Path(sys.executable).with_name("kopf")
KOPF_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"
MERGE = {"Content-Type": "application/merge-patch+json"}


@dataclass
class Target:
    """The kind an operator handles, and how to make and change its objects."""

    group: str
    version: str
    plural: str
    url: str
    make: Any  # name -> body
    change: dict[str, Any]

    def env(self) -> dict[str, str]:
        return {"TEST_GROUP": self.group, "TEST_VERSION": self.version, "TEST_PLURAL": self.plural}


@pytest.fixture(params=["configmaps", "widgets"])
def target(request: pytest.FixtureRequest, kube_namespace: str) -> Target:
    if request.param == "configmaps":
        return Target(
            group="",
            version="v1",
            plural="configmaps",
            url=f"/api/v1/namespaces/{kube_namespace}/configmaps",
            make=lambda name: {"metadata": {"name": name}, "data": {"k": "v"}},
            change={"data": {"k": "changed"}},
        )
    widgets: Widgets = request.getfixturevalue("widgets")
    return Target(
        group=widgets.group,
        version="v1",
        plural="widgets",
        url=widgets.url_in(kube_namespace),
        make=lambda name: widgets.body(name, size=1),
        change={"spec": {"size": 2}},
    )


@dataclass
class Operator:
    log: Path
    output: list[str] = field(default_factory=list)

    def handled(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def problems(self) -> list[str]:
        """Log lines of errors, warnings and tracebacks (none expected from a faithful API)."""
        markers = ("[ERROR", "[WARNING", "Traceback")
        return [line for line in self.output if any(marker in line for marker in markers)]


@asynccontextmanager
async def kopf_run(
    kube: Any, operator: str, namespace: str, target: Target, tmp_path: Path
) -> AsyncIterator[Operator]:
    """``kopf run --standalone`` of one of ./operators, stopped with SIGTERM afterwards."""
    running = Operator(tmp_path / "handled.log")
    env = {
        **os.environ,
        **target.env(),
        "KUBECONFIG": kube.kubeconfig,
        "TEST_LOG": str(running.log),
    }
    process = await asyncio.create_subprocess_exec(
        str(KOPF),
        "run",
        "--standalone",
        "--namespace",
        namespace,
        str(OPERATORS / operator),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )

    async def capture() -> None:
        assert process.stdout is not None
        async for line in process.stdout:
            running.output.append(line.decode(errors="replace").rstrip())

    capturing = asyncio.create_task(capture())
    try:
        yield running
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 15)
            except TimeoutError:
                process.kill()
                await process.wait()
        await capturing


async def test_on_event_operator(
    kube: Any, http: aiohttp.ClientSession, kube_namespace: str, target: Target, tmp_path: Path
) -> None:
    async with kopf_run(kube, "events.py", kube_namespace, target, tmp_path) as operator:
        # The first object tells that kopf is watching (it sees it listed or added).
        await http.post(target.url, json=target.make("probe"))
        await eventually(lambda: any(line.endswith(" probe") for line in operator.handled()), 30)

        assert (await http.post(target.url, json=target.make("first"))).status == 201
        await eventually(lambda: "ADDED first" in operator.handled(), 15)
        await http.patch(f"{target.url}/first", json=target.change, headers=MERGE)
        await eventually(lambda: "MODIFIED first" in operator.handled(), 15)
        await http.delete(f"{target.url}/first")
        await eventually(lambda: "DELETED first" in operator.handled(), 15)
    assert operator.problems() == []


async def test_on_create_update_delete_operator(
    kube: Any, http: aiohttp.ClientSession, kube_namespace: str, target: Target, tmp_path: Path
) -> None:
    async with kopf_run(kube, "lifecycle.py", kube_namespace, target, tmp_path) as operator:
        assert (await http.post(target.url, json=target.make("obj"))).status == 201
        await eventually(lambda: "create obj" in operator.handled(), 30)

        async def finalizer_added() -> bool:
            body = await (await http.get(f"{target.url}/obj")).json()
            return KOPF_FINALIZER in body["metadata"].get("finalizers", [])

        await eventually(finalizer_added, 15, message="kopf's finalizer patch applied")

        await http.patch(f"{target.url}/obj", json=target.change, headers=MERGE)
        await eventually(lambda: "update obj" in operator.handled(), 15)

        await http.delete(f"{target.url}/obj")
        await eventually(lambda: "delete obj" in operator.handled(), 15)

        async def gone() -> bool:
            return (await http.get(f"{target.url}/obj")).status == 404

        await eventually(gone, 15, message="kopf removed its finalizer and the object went")
    assert operator.problems() == []
    assert operator.handled().count("create obj") == 1
