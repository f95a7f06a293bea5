"""Which Kubernetes release the real test tiers run, and where its builds are cached.

The real tier (a kube-apiserver with etcd) and the pod tier (a node with a
kubelet) run binaries built from the Go module proxy by
``scripts/kube_build.py``, never downloaded prebuilt. The release is the newest
in :data:`KUBE_RELEASES` unless ``KOPF_RECONCILE_K8S`` names another, as
``1.35`` or ``v1.35.4`` (``make test K8S=1.35`` sets it): the tests then run
against that release, and the builds of each release live side by side in the
cache, so switching back costs nothing.

etcd is built the same way, at one version for every release
(:data:`ETCD_VERSION`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: The releases the real tiers can run, by minor version: the newest patch of each
#: that the Go module proxy serves. The first entry is the default.
KUBE_RELEASES = {
    "1.37": "v1.37.2",
    "1.36": "v1.36.3",
    "1.35": "v1.35.4",
    "1.34": "v1.34.4",
    "1.33": "v1.33.13",
}
#: The etcd server the real tiers run, for every release above.
ETCD_VERSION = "v3.6.16"
#: The variable that selects a release other than the newest.
RELEASE_VARIABLE = "KOPF_RECONCILE_K8S"
#: Bumped whenever the way the binaries are built changes, so that older builds go unused.
BUILD_REVISION = 1

_RELEASE = re.compile(r"v?(?P<minor>1\.\d+)(?:\.\d+)?")


class ReleaseError(ValueError):
    """The release asked for is not one the real tiers can run; the message says why."""


def kube_version(requested: str | None = None) -> str:
    """The full version (``v1.37.2``) asked for by ``requested`` or ``KOPF_RECONCILE_K8S``.

    ``1.35`` means the newest patch of 1.35 listed in :data:`KUBE_RELEASES`; a full
    version must be the listed one (the builds and the tests were made for it).
    """
    asked = (requested if requested is not None else os.environ.get(RELEASE_VARIABLE, "")).strip()
    if not asked:
        return next(iter(KUBE_RELEASES.values()))
    match = _RELEASE.fullmatch(asked)
    release = KUBE_RELEASES.get(match["minor"]) if match else None
    full = asked if asked.startswith("v") else f"v{asked}"
    if release is None or (asked.count(".") == 2 and full != release):
        supported = ", ".join(f"{minor} ({version})" for minor, version in KUBE_RELEASES.items())
        raise ReleaseError(
            f"{RELEASE_VARIABLE}={asked!r} is not a release the real tiers run; "
            f"choose one of {supported}"
        )
    return release


def minor_of(version: str) -> str:
    """``v1.37.2`` → ``1.37``."""
    return ".".join(version.lstrip("v").split(".")[:2])


def cache_dir() -> Path:
    """Where the real tiers' builds live: outside the work tree, shared by all checkouts."""
    configured = os.environ.get("KOPF_RECONCILE_CACHE")
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kopf-reconcile"


def kube_dir(version: str | None = None) -> Path:
    """The directory of one release's built components (kube-apiserver, kubelet, ...)."""
    return cache_dir() / f"kubernetes-{version or kube_version()}-r{BUILD_REVISION}"


def kube_binary(name: str, version: str | None = None) -> Path:
    """One built Kubernetes component, e.g. ``kube_binary("kube-apiserver")``."""
    return kube_dir(version) / name


def etcd_binary() -> Path:
    """The built etcd server."""
    return cache_dir() / f"etcd-{ETCD_VERSION}-r{BUILD_REVISION}" / "etcd"


def pause_archive() -> Path:
    """The pod tier's sandbox ("pause") image, an OCI archive built by ``scripts/pod_tier.py``."""
    return cache_dir() / f"pause-r{BUILD_REVISION}" / "pause.oci.tar"


#: Feature gates the test API servers turn on, with the release that introduced each (an
#: older server refuses a gate it does not know, so it gets none of the newer ones):
#: sharded list and watch (KEP-5866) and coordinated leader election (KEP-4355).
FEATURE_GATES = {"ShardedListAndWatch": "1.36", "CoordinatedLeaderElection": "1.31"}
#: API versions served besides the defaults, with the release that introduced each:
#: LeaseCandidate (coordination.k8s.io/v1beta1).
RUNTIME_CONFIG = {"coordination.k8s.io/v1beta1": "1.33"}


def _at_least(version: str, since: str) -> bool:
    def parts(minor: str) -> tuple[int, ...]:
        return tuple(int(part) for part in minor.split("."))

    return parts(minor_of(version)) >= parts(since)


def has_feature(gate: str, version: str | None = None) -> bool:
    """Whether the test API servers of ``version`` (the selected one) turn ``gate`` on."""
    since = FEATURE_GATES.get(gate)
    return since is not None and _at_least(version or kube_version(), since)


def apiserver_feature_flags(version: str | None = None) -> list[str]:
    """kube-apiserver's ``--feature-gates`` and ``--runtime-config`` for the tests' needs."""
    version = version or kube_version()
    gates = [f"{gate}=true" for gate, since in FEATURE_GATES.items() if _at_least(version, since)]
    apis = [f"{api}=true" for api, since in RUNTIME_CONFIG.items() if _at_least(version, since)]
    flags = []
    if gates:
        flags.append(f"--feature-gates={','.join(gates)}")
    if apis:
        flags.append(f"--runtime-config={','.join(apis)}")
    return flags
