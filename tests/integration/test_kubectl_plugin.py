"""`kubectl reconcile leases`: the CLI as a kubectl plugin shows holder and epoch."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kopf_reconcile as kr

BIN = Path(sys.executable).parent


@pytest.mark.skipif(not (BIN / "kubectl").exists(), reason="kubectl comes from `make tools`")
async def test_kubectl_reconcile_leases_shows_holder_and_epoch(
    kube: Any, kube_namespace: str
) -> None:
    elector = kr.KubernetesLeaseElector(
        namespace=kube_namespace, kubeconfig=kube.kubeconfig, holder_id="replica-a"
    )
    async with elector:
        token = await elector.acquire_lease("devices")
        command = [str(BIN / "kubectl"), "reconcile", "leases", f"--kubeconfig={kube.kubeconfig}",
                   "-n", kube_namespace]  # fmt: skip
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        result = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=60, env=env,
            check=False,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if " devices " in f" {line} ")
    assert "replica-a" in row
    assert f" {token.epoch} " in f" {row} "
