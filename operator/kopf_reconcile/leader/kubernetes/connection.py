"""The connection to the API server: its client, the Leases' namespace, and requests.

A client is borrowed (the caller's kubernetes-asyncio ``ApiClient``, never closed
here) or made on first use by :func:`connect_api`'s rules: from the ``kubeconfig``
file when given, else from the in-cluster service account, else from the default
kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``). The namespace of the Leases is
the one given, else ``POD_NAMESPACE``, else the namespace of that configuration (the
kubeconfig context's, or the service account's; with a borrowed client, the default
kubeconfig's), else ``default``.

:class:`LeaseApi` holds both for one elector and sends its requests on the Lease
collection and its items: Lease bodies are JSON written by the elector itself (see
:mod:`~kopf_reconcile.leader.kubernetes.lease_record`), and every answer later than
the lease's TTL is useless, so no request waits longer.
"""

from __future__ import annotations

import asyncio
import json
import os

from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.config import load_incluster_config, load_kube_config
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.config.kube_config import list_kube_config_contexts

from kopf_reconcile.api import ConfigError
from kopf_reconcile.leader.kubernetes.lease_record import Lease

__all__ = [
    "ALL_NAMESPACES",
    "COLLECTION",
    "ITEM",
    "SERVICE_ACCOUNT_NAMESPACE",
    "LeaseApi",
    "connect_api",
    "kubeconfig_namespace",
    "named",
    "names_kind",
]

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

COLLECTION = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
ITEM = COLLECTION + "/{name}"
ALL_NAMESPACES = "/apis/coordination.k8s.io/v1/leases"


class LeaseApi:
    """The client and the Lease namespace of one elector, and its requests on Leases.

    ``owner`` names the elector in the error raised once it is closed.
    """

    def __init__(
        self,
        owner: object,
        namespace: str | None,
        api: ApiClient | None,
        kubeconfig: str | None,
        timeout: float,
    ) -> None:
        self._owner = owner
        self._namespace = namespace
        self._api = api
        self._owns_api = False
        self._kubeconfig = kubeconfig
        self._timeout = timeout
        self._connecting = asyncio.Lock()
        self._closed = False

    @property
    def namespace(self) -> str | None:
        """Where the Leases live; ``None`` until first use when it comes from the configuration."""
        return self._namespace

    def where(self, reconciler_id: str) -> str:
        """The Lease of ``reconciler_id``, as messages name it."""
        return f"lease {self._namespace}/{reconciler_id}"

    async def client(self) -> ApiClient:
        """The client: the borrowed one, or one made (once) from the configuration."""
        if self._closed:
            raise RuntimeError(f"{self._owner!r} is closed")
        if self._api is not None:
            return self._api
        async with self._connecting:
            if self._closed:
                raise RuntimeError(f"{self._owner!r} is closed")
            if self._api is None:
                self._api, namespace = await _connect(self._kubeconfig)
                self._owns_api = True
                if self._namespace is None:
                    self._namespace = namespace or "default"
            return self._api

    async def resolved_namespace(self) -> str:
        """Where the Leases live, resolved from the configuration if need be."""
        if self._namespace is None:
            await self.client()
        if self._namespace is None:  # a borrowed client: the default kubeconfig may say
            self._namespace = kubeconfig_namespace(None) or "default"
        return self._namespace

    async def request(
        self,
        method: str,
        path: str,
        reconciler_id: str,
        body: Lease | None = None,
        query: list[tuple[str, str]] | None = None,
    ) -> Lease:
        """Send ``method`` to ``path`` (the Lease of ``reconciler_id``, or the collection)."""
        api = await self.client()
        namespace = await self.resolved_namespace()
        result = await api.call_api(
            path,
            method,
            path_params={"namespace": namespace, "name": reconciler_id},
            query_params=query,
            header_params={"Accept": "application/json", "Content-Type": "application/json"},
            body=body,
            response_types_map={200: "object", 201: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            _request_timeout=self._timeout,  # an answer later than that is useless
        )
        if not isinstance(result, dict):
            raise TypeError(f"{method} {path} answered {result!r}, not a Lease")
        return result

    async def close(self) -> None:
        """Close the client if it was made here (a borrowed one stays open)."""
        async with self._connecting:
            self._closed = True
            api, self._api = self._api, None
            if api is not None and self._owns_api:
                await api.close()


def named(reconciler_id: str) -> list[tuple[str, str]]:
    """The query that selects the Lease of ``reconciler_id`` in a list or watch."""
    return [("fieldSelector", f"metadata.name={reconciler_id}")]


def names_kind(body: object, kind: str) -> bool:
    """Whether a ``Status`` body is about an object of ``kind`` (its ``details.kind``)."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    try:
        status = json.loads(body) if isinstance(body, str) else None
    except ValueError:
        return False
    details = status.get("details") if isinstance(status, dict) else None
    return isinstance(details, dict) and details.get("kind") == kind


async def connect_api(kubeconfig: str | None = None) -> ApiClient:
    """A new client by the elector's rules: ``kubeconfig``, else in-cluster, else the default."""
    api, _ = await _connect(kubeconfig)
    return api


async def _connect(kubeconfig: str | None) -> tuple[ApiClient, str | None]:
    """A new client and the namespace its configuration names (if any)."""
    configuration = Configuration()
    if kubeconfig is None:
        try:
            load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except ConfigException:
            pass  # not in a pod: fall back to the default kubeconfig
        else:
            return ApiClient(configuration), _service_account_namespace()
    path = kubeconfig if kubeconfig is not None else _default_kubeconfig()
    try:
        await load_kube_config(
            config_file=path, client_configuration=configuration, persist_config=False
        )
    except (ConfigException, OSError) as exc:
        raise ConfigError(f"kubeconfig {path!r} cannot be used: {exc}") from exc
    return ApiClient(configuration), kubeconfig_namespace(path)


def _default_kubeconfig() -> str:
    return os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")


def kubeconfig_namespace(path: str | None = None) -> str | None:
    """The current context's namespace in a kubeconfig (default: the default kubeconfig)."""
    path = path if path is not None else _default_kubeconfig()
    if not any(os.path.exists(os.path.expanduser(p)) for p in path.split(os.pathsep) if p):
        return None
    try:
        _, current = list_kube_config_contexts(path)
    except (ConfigException, OSError, KeyError, TypeError):
        return None
    namespace = ((current or {}).get("context") or {}).get("namespace")
    return namespace if isinstance(namespace, str) and namespace else None


def _service_account_namespace() -> str | None:
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as file:
            return file.read().strip() or None
    except OSError:
        return None
