"""Readiness that covers kopf's watches: a replica whose watch is forbidden is not ready.

kopf's startup finishing says nothing about whether its watches work: when a
watch is forbidden, kopf logs a warning ("Not enough permissions to watch for
resources") or its watcher fails, and the operator silently does nothing. The
pod would still pass its readiness probe, and a rollout would happily replace
working replicas with idle ones.

:class:`WatchProbe` repeats, with the operator's own credentials and every
``interval`` seconds, the two requests every watch starts with: a list (here
with ``limit=1``: it costs one object whatever the collection's size) and a
watch from the version that list returned. The watch is closed as soon as the
API server answers 200: authorization and admission are decided before the
first event, so the answer is the verdict. Targets are what kopf watches:
CustomResourceDefinitions (always), namespaces (when it watches namespaces
by name, to match its patterns), and each reconciler's resource (and the resources
it owns or watches) in each watched namespace, or cluster-wide: with ``-A``, and
with neither ``-n`` nor ``-A`` (kopf then goes cluster-wide, with a warning).
A namespace pattern (``-n 'team-*'``) is resolved as kopf resolves it, every
round: the resources are checked in each existing namespace it matches
(:class:`NamespacePatterns`, given kopf's own matcher by the CLI).

:meth:`WatchProbe.problem` is ``None`` while every target's last check passed,
else a one-line reason; a forbidden watch is the verdict at once, other failures
count after a few rounds (:mod:`kopf_reconcile.integration.probing`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException, load_incluster_config, load_kube_config

from kopf_reconcile.integration.probing import DEFAULT_INTERVAL, REQUEST_TIMEOUT, PeriodicProbe

__all__ = ["NamespacePatterns", "WatchProbe", "WatchTarget", "namespace_patterns", "targets"]

FORBIDDEN = "is forbidden (403)"


@dataclass(frozen=True)
class WatchTarget:
    """One collection kopf watches: ``group`` is ``""`` for the core API group."""

    group: str
    version: str
    plural: str
    namespace: str | None = None  # None: cluster-wide (or a cluster-scoped resource)

    @property
    def path(self) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        where = f"/namespaces/{self.namespace}" if self.namespace else ""
        return f"{base}{where}/{self.plural}"

    def __str__(self) -> str:
        what = ".".join(filter(None, (self.plural, self.group)))
        return f"{what} in {self.namespace!r}" if self.namespace else f"{what} cluster-wide"


CRDS = WatchTarget("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = WatchTarget("", "v1", "namespaces")

Resource = tuple[str, str, str]  # group, version, plural


def is_specific(namespace: str) -> bool:
    """Whether ``namespace`` names one namespace rather than a pattern.

    kopf's rule (``select_specific_namespaces``): these are watched even without the
    permission to watch namespaces.
    """
    return bool(namespace) and not any(c in namespace for c in "!*?,")


@dataclass(frozen=True)
class NamespacePatterns:
    """Resources kopf watches in every namespace its patterns match, resolved each round.

    ``matches(name, pattern)`` is kopf's own matcher (negations, comma-separated globs).
    """

    patterns: tuple[str, ...]
    resources: tuple[Resource, ...]
    matches: Callable[[str, str], bool] = field(compare=False)

    def __str__(self) -> str:
        return ", ".join(self.patterns)

    def targets(self, namespaces: Iterable[str]) -> list[WatchTarget]:
        chosen = [ns for ns in namespaces if any(self.matches(ns, p) for p in self.patterns)]
        return [WatchTarget(*resource, ns) for ns in chosen for resource in self.resources]


def targets(
    resources: Iterable[Resource], namespaces: Sequence[str], clusterwide: bool
) -> list[WatchTarget]:
    """What kopf watches for ``resources`` in ``namespaces`` before resolving patterns.

    With neither namespaces nor ``clusterwide``, kopf watches cluster-wide. Patterns
    are resolved by :class:`NamespacePatterns` from the namespaces, checked here.
    """
    clusterwide = clusterwide or not namespaces
    found = [CRDS]
    if not clusterwide:
        found.append(NAMESPACES)
    for resource in resources:
        if clusterwide:
            found.append(WatchTarget(*resource))
        else:
            found.extend(WatchTarget(*resource, ns) for ns in namespaces if is_specific(ns))
    return list(dict.fromkeys(found))


def namespace_patterns(
    resources: Iterable[Resource],
    namespaces: Sequence[str],
    matches: Callable[[str, str], bool],
) -> NamespacePatterns | None:
    """The patterns among ``namespaces`` with what kopf watches where they match, if any."""
    patterns = tuple(ns for ns in namespaces if ns and not is_specific(ns))
    return NamespacePatterns(patterns, tuple(resources), matches) if patterns else None


async def default_api_client() -> ApiClient:
    """In-cluster credentials inside a pod, else ``$KUBECONFIG`` or ``~/.kube/config``."""
    configuration = Configuration()
    try:
        load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except ConfigException:
        path = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
        await load_kube_config(
            config_file=path, client_configuration=configuration, persist_config=False
        )
    return ApiClient(configuration)


class WatchProbe(PeriodicProbe):
    """Checks every target every ``interval`` seconds; ``problem()`` tells the last outcome."""

    subject = "the watches"

    def __init__(
        self,
        watch_targets: Sequence[WatchTarget],
        *,
        interval: float = DEFAULT_INTERVAL,
        api: ApiClient | None = None,
        patterns: NamespacePatterns | None = None,
    ) -> None:
        super().__init__(interval=interval)
        self._targets = list(watch_targets)
        self._patterns = patterns
        self._api = api
        self._owns_api = api is None

    async def start(self) -> None:
        if self._api is None:
            self._api = await default_api_client()
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        if self._owns_api and self._api is not None:
            await self._api.close()
            self._api = None

    def is_refusal(self, problem: str) -> bool:
        return FORBIDDEN in problem

    async def check_once(self) -> str | None:
        """One round: the first failure's reason, or ``None``."""
        checked = list(self._targets)
        if self._patterns is not None:
            listed = await self._get(NAMESPACES.path, [])
            if isinstance(listed, str):
                return f"the namespaces cannot be listed to match {self._patterns}: {listed}"
            names = [str(item["metadata"]["name"]) for item in listed.get("items") or ()]
            checked += [t for t in self._patterns.targets(names) if t not in checked]
        for target in checked:
            failure = await self._check(target)
            if failure is not None:
                return f"the watch of {target} {failure}"
        return None

    async def _check(self, target: WatchTarget) -> str | None:
        listed = await self._get(target.path, [("limit", "1")])
        if isinstance(listed, str):
            return listed
        version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
        query = [("watch", "1"), ("timeoutSeconds", "1"), ("resourceVersion", version)]
        watched = await self._get(target.path, query, stream=True)
        return watched if isinstance(watched, str) else None

    async def _get(
        self, path: str, query: list[tuple[str, str]], *, stream: bool = False
    ) -> dict[str, Any] | str:
        """The decoded answer, or why there is none (``stream``: ``{}`` once it answered 200)."""
        assert self._api is not None
        try:
            response = await self._api.call_api(
                path,
                "GET",
                query_params=query,
                header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
            )
        except (aiohttp.ClientError, ApiException, TimeoutError, OSError) as exc:
            return f"cannot reach the API server: {exc.__class__.__name__}: {exc}"
        if not isinstance(response, aiohttp.ClientResponse):
            return f"answered {response!r}"
        try:
            if response.status == 403:
                return f"{FORBIDDEN}: the ServiceAccount's RBAC does not allow it"
            if response.status != 200:
                text = (await response.text())[:200].strip()
                return f"answered {response.status}: {text}"
            if stream:
                return {}
            document: dict[str, Any] = await response.json()
            return document
        finally:
            response.close()
