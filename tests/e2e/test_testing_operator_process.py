"""``kopf_reconcile.testing.OperatorProcess``: a handlers file run as a pod runs it, ready when
entered; and the operator stops at SIGTERM while a scraper keeps a connection to it."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from kopf_reconcile.testing import EmbeddedCluster, OperatorProcess, eventually

GENERIC = Path(__file__).parent / "operators" / "generic.py"


async def test_it_runs_the_handlers_and_stops_with_sigterm_despite_a_kept_connection(
    embedded_cluster: EmbeddedCluster,
) -> None:
    operator = OperatorProcess(GENERIC, kubeconfig=embedded_cluster.kubeconfig, stop_timeout=10)
    async with operator, embedded_cluster.http_session() as http:
        body = {"metadata": {"name": "x"}, "data": {"k": "v"}}
        async with http.post("/api/v1/namespaces/default/configmaps", json=body) as response:
            assert response.status == 201, await response.text()
        await eventually(lambda: "reconciled default/x" in operator.output, message="reconciled")
        # A scraper as Prometheus is one: it keeps its connection for the next scrape.
        async with aiohttp.ClientSession() as scraper:
            async with scraper.get(f"{operator.url}/metrics") as response:
                assert response.status == 200
                assert "kopf_reconcile_reconcile_total" in await response.text()
            assert await operator.stop() == 0, operator.output  # not SIGKILLed after 10 s
    assert not operator.log.exists()


async def test_a_handlers_file_that_fails_is_reported_with_its_log(
    embedded_cluster: EmbeddedCluster, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('the handlers cannot be imported')\n")
    operator = OperatorProcess(broken, kubeconfig=embedded_cluster.kubeconfig)
    with pytest.raises(RuntimeError, match="exited with 1 before it was ready") as failed:
        async with operator:
            pass
    assert "the handlers cannot be imported" in str(failed.value)
    assert not operator.log.exists()  # its content is in the error
