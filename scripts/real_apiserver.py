"""Set up the real kube-apiserver test tier: build kube-apiserver and etcd once, into a cache.

The real tier runs the project's Kubernetes tests against a current
kube-apiserver with etcd, as controller-runtime's envtest does. Both are built
from the Go module proxy with the machine's Go (``kube_build.py`` says how):
kube-apiserver at the release ``KOPF_RECONCILE_K8S`` selects (the newest
listed in ``kopf_reconcile.testing.kube_release`` by default), etcd at
``ETCD_VERSION``. A built binary is checked by what it reports and then
reused: a warm cache makes this a no-op of about a second.

``KOPF_RECONCILE_SKIP_REAL_APISERVER=1`` skips the whole step locally; under
``CI=true`` the real tier is required, so the variable is ignored there and
any failure is fatal.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from debian import SetupError, install_packages
from kube_build import BuildError, build_etcd, build_kube

from kopf_reconcile.testing.kube_release import ReleaseError, cache_dir, kube_binary, kube_version

#: What the tier runs besides the built binaries: openssl makes its service-account key.
RUNTIME_PACKAGES = ("openssl",)


def set_up() -> Path:
    version = kube_version()
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        # Concurrent runs (two checkouts) wait for each other instead of racing.
        fcntl.flock(lock, fcntl.LOCK_EX)
        install_packages(RUNTIME_PACKAGES)
        build_etcd()
        build_kube(["kube-apiserver"], version)
    return kube_binary("kube-apiserver", version)


def set_up_tier(what: str, skip_variable: str, set_up_step: Callable[[], Path]) -> int:
    """A test tier's setup step for ``make``: skippable locally, required under CI=true.

    ``set_up_step`` returns what it set up (printed); a failure is printed with the
    reason and, outside CI, the variable that skips the tier.
    """
    in_ci = os.environ.get("CI") == "true"
    if os.environ.get(skip_variable) == "1":
        if not in_ci:
            print(f"{what}: skipped ({skip_variable}=1)")
            return 0
        print(f"{what}: required under CI=true; the skip variable is ignored")
    try:
        result = set_up_step()
    except (SetupError, BuildError, ReleaseError, OSError, subprocess.SubprocessError) as exc:
        print(f"error: the {what} cannot be set up: {exc}", file=sys.stderr)
        if not in_ci:
            print(f"       set {skip_variable}=1 to run without it locally", file=sys.stderr)
        return 1
    print(f"{what}: {result} (Kubernetes {kube_version()})", flush=True)
    return 0


def main() -> int:
    return set_up_tier("real kube-apiserver tier", "KOPF_RECONCILE_SKIP_REAL_APISERVER", set_up)


if __name__ == "__main__":
    sys.exit(main())
