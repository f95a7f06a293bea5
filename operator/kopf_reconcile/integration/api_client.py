"""A Kubernetes API client made on first use, for the shim's own writes (Events, finalizers).

Borrowed when given (the caller closes it); otherwise made by the rules of
:class:`~kopf_reconcile.KubernetesLeaseElector` (``kubeconfig``, in-cluster, the default
kubeconfig) the first time it is needed, and closed by :meth:`LazyApiClient.close`.
"""

from __future__ import annotations

import asyncio

from kubernetes_asyncio.client import ApiClient

from kopf_reconcile.leader.kubernetes import connect_api

__all__ = ["LazyApiClient"]


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
                self._api = await connect_api(self._kubeconfig)
                self._owns_api = True
            return self._api

    async def close(self) -> None:
        """Close the client if it was made here."""
        api, self._api = self._api, None
        if api is not None and self._owns_api:
            await api.close()
