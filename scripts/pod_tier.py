"""Set up the pod test tier's binaries: the node components, built once into a cache.

The pod tier runs a real single-node cluster: the real tier's kube-apiserver
and etcd, plus kube-controller-manager, kube-scheduler and a kubelet of the
same release, with containerd, runc and the CNI plugins from Debian. The
Kubernetes components are built from the Go module proxy by the same recipe as
the real tier's kube-apiserver (``kube_build.py``); kube-proxy is not built,
since the node does not run it (pods reach the API server by its address).

The sandbox ("pause") image every pod starts with is built here too: a static
Go program that waits for SIGTERM, built with the machine's Go, packed by
``umoci`` into an OCI archive the node imports into containerd, so no image is
ever pulled.

Each step is skipped when its result is there already: a warm cache makes this
a no-op of about a second. ``KOPF_RECONCILE_SKIP_POD_TIER=1`` skips it locally;
under ``CI=true`` the pod tier is required and the variable is ignored.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from debian import install_packages, run
from kube_build import build_kube, go
from real_apiserver import set_up_tier

from kopf_reconcile.testing.kube_release import cache_dir, kube_dir, kube_version, pause_archive

COMPONENTS = ("kubelet", "kube-controller-manager", "kube-scheduler")
#: What the node runs besides the Kubernetes components (Debian packages).
NODE_PACKAGES = (
    "containerd",
    "runc",
    "containernetworking-plugins",
    "iproute2",
    "iptables",
    "conntrack",
    "util-linux",
    "umoci",
)
#: The tag of the sandbox image in its archive (the node imports it under its own name).
PAUSE_TAG = "1"
PAUSE_SOURCE = """\
// pause: the process that holds a pod's namespaces; exits on SIGTERM or SIGINT.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	<-signals
}
"""


def build_pause(target: Path) -> None:
    """A static ``/pause`` in an otherwise empty OCI image, archived as ``target``."""
    with tempfile.TemporaryDirectory(prefix="kopf-reconcile-pause-") as tmp:
        work = Path(tmp)
        (work / "pause.go").write_text(PAUSE_SOURCE)
        env = {
            **os.environ,
            "CGO_ENABLED": "0",
            "GOFLAGS": "",
            "GOCACHE": str(work / "cache"),
        }
        run([go(), "build", "-o", work / "pause", work / "pause.go"], env=env)
        layout, bundle = work / "layout", work / "bundle"
        ref = f"{layout}:{PAUSE_TAG}"
        run(["umoci", "init", "--layout", layout])
        run(["umoci", "new", "--image", ref])
        run(["umoci", "unpack", "--image", ref, bundle])
        shutil.copy2(work / "pause", bundle / "rootfs" / "pause")
        run(["umoci", "repack", "--image", ref, bundle])
        run(["umoci", "config", "--image", ref, "--config.entrypoint=/pause",
             "--config.user=65535:65535"])  # fmt: skip
        run(["umoci", "gc", "--layout", layout])
        staging = target.with_name(f".{target.name}.new")
        with tarfile.open(staging, "w") as archive:
            for entry in sorted(layout.iterdir()):
                archive.add(entry, arcname=entry.name)
        staging.replace(target)


def set_up() -> Path:
    version = kube_version()
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        install_packages(NODE_PACKAGES)
        build_kube(COMPONENTS, version)
        if not pause_archive().is_file():
            pause_archive().parent.mkdir(parents=True, exist_ok=True)
            build_pause(pause_archive())
    return kube_dir(version)


def main() -> int:
    return set_up_tier("pod tier", "KOPF_RECONCILE_SKIP_POD_TIER", set_up)


if __name__ == "__main__":
    sys.exit(main())
