"""``kopf-reconcile run`` with ``KOPF_RECONCILE_METRICS_AUTH=kubernetes``, as the chart runs it:
``/metrics`` refuses a scrape without a token and serves one the API server allows;
``/healthz`` shows its report to that token only."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from operator_e2e import Operators

from support import eventually

pytestmark = pytest.mark.slow


async def test_metrics_need_a_token_the_api_server_allows(
    kube: Any, operators: Operators, devices_crd: None
) -> None:
    operator = await operators.start(env={"KOPF_RECONCILE_METRICS_AUTH": "kubernetes"})
    url = await operator.endpoints()
    reader = {"Authorization": f"Bearer {kube.admin_token}"}
    stranger = {"Authorization": f"Bearer {kube.unprivileged_token}"}
    async with aiohttp.ClientSession() as http:

        async def status(path: str, headers: dict[str, str]) -> int:
            async with http.get(url + path, headers=headers) as response:
                return response.status

        async def ready() -> bool:
            return await status("/readyz", {}) == 200

        await eventually(ready, timeout=30, message="ready")
        assert await status("/metrics", {}) == 401
        assert await status("/metrics", stranger) == 403
        assert await status("/metrics", reader) == 200
        async with http.get(url + "/healthz") as response:
            assert await response.json() == {"status": "ok"}
        async with http.get(url + "/healthz", headers=reader) as response:
            assert (await response.json())["reconcilers"]
    assert await operator.stop() == 0
