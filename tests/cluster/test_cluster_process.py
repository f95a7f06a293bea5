"""The process form: ``python -m kopf_reconcile.testing.emulated_apiserver``, admin API, SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

pytestmark = pytest.mark.slow

LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"


async def test_runs_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config" / "kubeconfig"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kopf_reconcile.testing.emulated_apiserver",
        "--port",
        "0",
        "--kubeconfig",
        str(kubeconfig),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            url = (await process.stdout.readline()).decode().strip()
        assert url.startswith("http://127.0.0.1:")
        config = yaml.safe_load(kubeconfig.read_text())
        assert config["clusters"][0]["cluster"]["server"] == url
        assert config["contexts"][0]["context"]["namespace"] == "default"

        async with aiohttp.ClientSession(base_url=url) as http:
            assert (await http.get("/version")).status == 200

            fault = {"method": "GET", "path_pattern": f"{LEASES}/.*", "status": 500, "times": 1}
            response = await http.post("/_embedded/faults", json=fault)
            assert response.status == 201
            assert (await response.json())["fired"] == 0
            assert (await http.get(f"{LEASES}/any")).status == 500
            assert (await http.get(f"{LEASES}/any")).status == 404  # the fault was used up
            assert (await (await http.get("/_embedded/faults")).json()) == {"faults": []}

            params = {"watch": "true", "resourceVersion": "0"}
            async with http.get(LEASES, params=params) as watch:
                cut = await (await http.post("/_embedded/watches/cut", json={})).json()
                assert cut == {"cut": 1}
                with pytest.raises(aiohttp.ClientPayloadError):
                    await watch.content.read()
            stats = await (await http.get("/_embedded/stats")).json()
            assert stats["streams"] == 0

        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            code = await process.wait()
        assert code == 0
        assert (await process.stdout.read()) == b""  # the URL was the only line
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        stderr = await process.stderr.read() if process.stderr else b""
        assert b"Traceback" not in stderr, stderr.decode()
