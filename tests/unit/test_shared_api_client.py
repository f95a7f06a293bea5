"""One API client per event loop: every handle gets the same one, closed with the last handle."""

from __future__ import annotations

from pathlib import Path

import pytest

from kopf_reconcile.integration.api_client import shared_api_client

KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


async def test_handles_share_one_client_until_the_last_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(config))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    first, second = shared_api_client(), shared_api_client()
    api = await first.get()
    assert await second.get() is api
    session = api.rest_client.pool_manager
    assert not session.trust_env  # no proxy or .netrc lookups per request
    await first.close()
    assert not session.closed and await second.get() is api
    with pytest.raises(RuntimeError, match="closed"):
        await first.get()
    await second.close()
    assert session.closed
    third = shared_api_client()
    assert await third.get() is not api  # a new client once all had let go
    await third.close()
