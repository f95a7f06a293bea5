"""The process's Kubernetes API client: one connection pool for the shim's own writes.

Events, finalizers and the reconcilers' fenced client (:mod:`.fenced_client`) share one
client per event loop (:func:`shared_api_client`): made on first use by the rules of
:class:`~kopf_reconcile.KubernetesLeaseElector` (in-cluster, else the default kubeconfig)
and closed when the last user releases it. A :class:`LazyApiClient` given a client
borrows it instead (the caller closes it).

kubernetes-asyncio's session trusts the environment, so aiohttp looks up proxies and
``~/.netrc`` in a thread for every request (a quarter of an operator's CPU per object in
``benchmarks/kopf_e2e.py``): with no proxy configured there is nothing to find, so a client
made here uses a session that does not consult the environment, as kopf's own does.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
import weakref
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio.client import ApiClient
from multidict import CIMultiDict

from kopf_reconcile.leader.kubernetes import connect_api

__all__ = ["ApiClientSource", "LazyApiClient", "SharedApiClient", "request", "shared_api_client"]


class LazyApiClient:
    """One API client: ``api`` borrowed, or made from ``kubeconfig`` on first use."""

    def __init__(self, api: ApiClient | None = None, kubeconfig: str | None = None) -> None:
        self._api = api
        self._owns_api = api is None
        self._kubeconfig = kubeconfig
        self._connecting = asyncio.Lock()

    async def get(self) -> ApiClient:
        async with self._connecting:
            if self._api is None:
                self._api = _without_environment(await connect_api(self._kubeconfig))
                self._owns_api = True
            return self._api

    async def close(self) -> None:
        """Close the client if it was made here."""
        api, self._api = self._api, None
        if api is not None and self._owns_api:
            await api.close()


class ApiClientSource(Protocol):
    """Where a request gets its client: a :class:`LazyApiClient` or a shared handle."""

    async def get(self) -> ApiClient: ...


class _Shared:
    """The event loop's client and how many handles hold it."""

    def __init__(self) -> None:
        self.client = LazyApiClient()
        self.users = 0


class SharedApiClient:
    """A handle on the event loop's shared client: :meth:`close` lets go of it, and the
    client itself is closed when the last handle is."""

    def __init__(self, shared: _Shared) -> None:
        self._shared: _Shared | None = shared
        shared.users += 1

    async def get(self) -> ApiClient:
        if self._shared is None:
            raise RuntimeError("this handle on the shared API client is closed")
        return await self._shared.client.get()

    async def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.users -= 1
            if shared.users == 0:
                await shared.client.close()


_shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Shared] = weakref.WeakKeyDictionary()


def shared_api_client() -> SharedApiClient:
    """A new handle on this event loop's shared client (close it when done)."""
    loop = asyncio.get_running_loop()
    shared = _shared.get(loop)
    if shared is None:
        shared = _shared[loop] = _Shared()
    return SharedApiClient(shared)


def _without_environment(api: ApiClient) -> ApiClient:
    """``api`` with a session that does not consult the environment, unless a proxy is set."""
    if api.configuration.proxy is not None or urllib.request.getproxies():
        return api
    session: aiohttp.ClientSession = api.rest_client.pool_manager
    connector = session.connector
    session.detach()  # the connector now belongs to the new session
    api.rest_client.pool_manager = aiohttp.ClientSession(connector=connector, read_bufsize=2**21)
    return api


async def request(
    client: ApiClientSource,
    method: str,
    path: str,
    *,
    body: object = None,
    query: list[tuple[str, str]] | None = None,
    headers: CIMultiDict[str] | None = None,
    content_type: str = "application/json",
) -> Any:
    """One request to the API server; its JSON answer (an ``ApiException`` for non-2xx)."""
    api = await client.get()
    # A multi-valued mapping: impersonated groups repeat one header (typed as a dict there).
    sent: Any = CIMultiDict(headers or {})
    sent["Content-Type"] = content_type
    sent["Accept"] = "application/json"
    queries: Any = list(query or ())
    await api.update_params_for_auth(sent, queries, ["BearerToken"])
    response = await api.rest_client.request(
        method, f"{api.configuration.host}{path}", query_params=queries, headers=sent, body=body
    )
    return json.loads(response.data) if response.data else None
