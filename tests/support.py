"""Small helpers shared by the test suites (importable as ``support``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

import kopf_reconcile as kr
from kopf_reconcile import testing
from kopf_reconcile.cache import ObjectCache
from kopf_reconcile.testing.real_apiserver import RealClusterError

Tier = TypeVar("Tier", bound=Any)

BIN = Path(sys.executable).parent  # kopf-reconcile, and kubectl from `make tools`
DEFAULT_TIMEOUT = 10.0


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = 0.01,
    message: str = "",
) -> None:
    """Poll ``condition`` until it holds; fail with ``message`` after ``timeout`` seconds."""
    await testing.eventually(condition, timeout, interval, message)


def fenced_loop(
    reconcile: object,
    elector: kr.LeaderElector,
    repo: kr.FencedRepository,
    reconciler_id: str,
    renew_interval: float = 0.1,
) -> kr.Loop:
    """A Loop that leads through ``elector`` and writes through ``repo`` (requests by hand)."""
    return (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)  # type: ignore[arg-type]
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_leader(elector)
        .with_fenced_repo(repo)
        .with_reconciler_id(reconciler_id)
        .with_renew_interval(renew_interval)
        .build()
    )


async def start_tier(tier: Tier, what: str, skip_variable: str) -> Tier:
    """Start a session's test tier (real API server, pod node): skipped when
    ``skip_variable`` is 1 outside CI, and a clear failure when it cannot start."""
    in_ci = os.environ.get("CI") == "true"
    if os.environ.get(skip_variable) == "1" and not in_ci:
        pytest.skip(f"{what} skipped ({skip_variable}=1)")
    try:
        await tier.__aenter__()
        cannot_start = None
    except RealClusterError as exc:
        cannot_start = str(exc)
    if cannot_start is not None:  # failed outside the handler: the message alone says it all
        hint = "it is required under CI=true" if in_ci else f"set {skip_variable}=1 to skip it"
        pytest.fail(f"the {what} cannot start ({hint}): {cannot_start}", pytrace=False)
    return tier


async def feeding(cache: ObjectCache) -> tuple[asyncio.Task[None], list[str]]:
    """``cache`` running as a trigger: its task, and the entity ids it emits, in order."""
    emitted: list[str] = []

    async def emit(request: kr.Request) -> None:
        emitted.append(request.entity_id)

    task = asyncio.create_task(cache.run(emit))
    await asyncio.sleep(0)  # running: it takes updates from now on
    return task, emitted


CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def gadget_crd(group: str, scope: str = "Namespaced") -> dict[str, Any]:
    """A schemaless kind, Gadget, of ``group``: any body is valid."""
    schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    version = {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": schema}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"gadgets.{group}"},
        "spec": {
            "group": group,
            "scope": scope,
            "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget"},
            "versions": [version],
        },
    }


async def install_crd(http: aiohttp.ClientSession, crd: dict[str, Any]) -> None:
    """Create ``crd`` and wait until its group's first version is served."""
    async with http.post(CRDS, json=crd) as response:
        assert response.status == 201, await response.text()
    spec = crd["spec"]
    path = f"/apis/{spec['group']}/{spec['versions'][0]['name']}"

    async def served() -> bool:
        async with http.get(path) as response:
            return response.status == 200

    await eventually(served, timeout=30, message=f"{path} served")


async def run_cli(*args: str, dsn: str, via_kubectl: bool = False) -> tuple[int, str, str]:
    """``kopf-reconcile ARGS`` (or ``kubectl reconcile ARGS``) on database ``dsn``, with no
    setting of this process's environment: exit status, stdout, stderr."""
    environment = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KOPF_RECONCILE_", "POD_", "KUBERNETES_"))
    }
    environment["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    environment["KOPF_RECONCILE_DATABASE_URL"] = dsn
    argv = (
        [str(BIN / "kubectl"), "reconcile", *args]
        if via_kubectl
        else [str(BIN / "kopf-reconcile"), *args]
    )
    result = await asyncio.to_thread(
        subprocess.run,
        argv, capture_output=True, text=True, timeout=60, env=environment, check=False,
    )  # fmt: skip
    return result.returncode, result.stdout, result.stderr
