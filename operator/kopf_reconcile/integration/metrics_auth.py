"""Who may read ``/metrics``: the Kubernetes API decides, as controller-runtime's filter does.

A scrape carries ``Authorization: Bearer <token>`` (Prometheus sends its
ServiceAccount's token). :class:`KubernetesAuthorizer` asks the API server,
with the operator's own credentials:

1. a **TokenReview**: is the token valid, and whose is it (user, uid, groups,
   extra)? No token, or one the API server does not authenticate: 401.
2. a **SubjectAccessReview** for that user: may it ``get`` the non-resource URL
   ``/metrics``? No: 403. (The chart's ``<release>-metrics-reader`` ClusterRole
   grants exactly that; bind it to the scraper's ServiceAccount.)

The operator needs ``create`` on ``tokenreviews`` and ``subjectaccessreviews``
(the chart's ClusterRole grants it). Verdicts are kept for ``CACHE_SECONDS`` per
token (its SHA-256, never the token), for at most ``CACHE_SIZE`` tokens, so a scraper
costs the API server at most two requests per ``CACHE_SECONDS``; an API server that
cannot answer gives 503, not cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from kopf_reconcile.api import ConfigError
from kopf_reconcile.integration.probing import REQUEST_TIMEOUT

__all__ = ["METRICS_PATH", "KubernetesAuthorizer", "Verdict", "server_tls"]

logger = logging.getLogger("kopf_reconcile.metrics_auth")

METRICS_PATH = "/metrics"
CACHE_SECONDS = 30.0
CACHE_SIZE = 1024
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


@dataclass(frozen=True)
class Verdict:
    """An HTTP status for the request (200: allowed) and why, for the log."""

    status: int
    reason: str

    @property
    def allowed(self) -> bool:
        return self.status == 200


NO_TOKEN = Verdict(401, "no bearer token")


def server_tls(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """A TLS server context from PEM files, or ``None`` without them; bad files: ConfigError."""
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"KOPF_RECONCILE_METRICS_TLS_CERT {cert!r} and KOPF_RECONCILE_METRICS_TLS_KEY "
            f"{key!r} cannot be loaded as a PEM certificate and its key: {exc}"
        ) from None
    return context


class KubernetesAuthorizer:
    """TokenReview, then SubjectAccessReview of ``get`` on a non-resource URL.

    Without an ``api``, the operator's own credentials are loaded at the first review
    (and the client is closed by :meth:`close`).
    """

    def __init__(self, api: ApiClient | None = None, *, path: str = METRICS_PATH) -> None:
        self._api = api
        self._owns_api = api is None
        self._path = path
        self._cache: dict[str, tuple[float, Verdict]] = {}

    async def close(self) -> None:
        if self._owns_api and self._api is not None:
            await self._api.close()
            self._api = None

    async def verdict(self, authorization: str | None) -> Verdict:
        """The verdict on a request whose ``Authorization`` header is ``authorization``."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return NO_TOKEN
        key = hashlib.sha256(token.encode()).hexdigest()
        now = asyncio.get_running_loop().time()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            verdict = await self._review(token)
        except (aiohttp.ClientError, ApiException, TimeoutError, OSError) as exc:
            logger.warning("cannot review a %s token: %s", self._path, exc.__class__.__name__)
            return Verdict(503, "the Kubernetes API cannot review the token now")
        for stale in [k for k, (until, _) in self._cache.items() if until <= now]:
            del self._cache[stale]
        if len(self._cache) < CACHE_SIZE:  # many strangers' tokens: reviewed, not kept
            self._cache[key] = (now + CACHE_SECONDS, verdict)
        return verdict

    async def _review(self, token: str) -> Verdict:
        review = await self._post(
            TOKEN_REVIEWS,
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token},
            },
        )
        status = review.get("status") or {}
        if not status.get("authenticated"):
            return Verdict(401, "the token is not authenticated")
        user = status.get("user") or {}
        spec: dict[str, Any] = {
            "user": user.get("username", ""),
            "uid": user.get("uid", ""),
            "groups": user.get("groups") or [],
            "nonResourceAttributes": {"path": self._path, "verb": "get"},
        }
        if user.get("extra"):
            spec["extra"] = user["extra"]
        access = await self._post(
            ACCESS_REVIEWS,
            {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec},
        )
        if (access.get("status") or {}).get("allowed"):
            return Verdict(200, f"{spec['user']} may get {self._path}")
        return Verdict(403, f"{spec['user']} may not get {self._path}")

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._api is None:
            from kopf_reconcile.integration.watch_probe import default_api_client

            self._api = await default_api_client()
        response = await self._api.call_api(
            path,
            "POST",
            body=body,
            header_params={"Accept": "application/json", "Content-Type": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
        )
        assert isinstance(response, aiohttp.ClientResponse)
        try:
            if response.status not in (200, 201):
                raise ApiException(status=response.status, reason=response.reason)
            document: dict[str, Any] = await response.json()
            return document
        finally:
            response.close()
