"""Set up the pod test tier's binaries: the node components, built once into a cache.

The pod tier runs a real single-node cluster: the real tier's kube-apiserver
and etcd, plus kube-controller-manager, kube-scheduler, kubelet and
kube-proxy, with containerd, runc and the CNI plugins from Debian. The four
Kubernetes components are built from the same Debian source package
(``kubernetes`` 1.20.2, vendored, offline) by the same recipe as the real
tier's kube-apiserver (``scripts/real_apiserver.py``: same packages, same
vendored-module replacement, same build environment); only ``WHAT`` differs.

The sandbox ("pause") image every pod starts with is built here too: a static
Go program that waits for SIGTERM (Go from the same Debian packages), packed by
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
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from real_apiserver import (
    GO_ROOT,
    PACKAGES,
    VENDOR_REPLACEMENTS,
    SetupError,
    fetch_source,
    install_packages,
    package_version,
    replace_vendored_modules,
    reported_version,
    run,
    set_up_tier,
)

from kopf_reconcile.testing.real_apiserver import KUBE_VERSION, cache_dir

#: Bumped whenever the recipe changes, so that older cached builds go unused.
NODE_BUILD_REVISION = 1
COMPONENTS = ("kubelet", "kube-controller-manager", "kube-scheduler", "kube-proxy")
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
#: The sandbox image: its archive in the cache, and the name the node imports it as.
PAUSE_ARCHIVE = "pause.oci.tar"
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


def node_dir() -> Path:
    return cache_dir() / f"kube-node-{KUBE_VERSION}-r{NODE_BUILD_REVISION}"


def is_built(directory: Path) -> bool:
    return all(
        reported_version(directory / name) == f"Kubernetes {KUBE_VERSION}" for name in COMPONENTS
    )


def build_components(tree: Path) -> Path:
    """``make WHAT="cmd/kubelet cmd/..."``, offline, as the real tier builds kube-apiserver."""
    env = {
        **os.environ,
        "PATH": f"{GO_ROOT / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "GOPROXY": "off",
        "GOFLAGS": "-mod=vendor",
        "CGO_ENABLED": "0",
        "KUBE_GIT_VERSION": KUBE_VERSION,
        "KUBE_GIT_TREE_STATE": "clean",
    }
    started = time.monotonic()
    what = " ".join(f"cmd/{name}" for name in COMPONENTS)
    run(["make", f"WHAT={what}"], cwd=tree, env=env)
    print(f"built {', '.join(COMPONENTS)} in {time.monotonic() - started:.0f} s", flush=True)
    goarch = subprocess.run(
        [GO_ROOT / "bin" / "go", "env", "GOARCH"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return tree / "_output" / "local" / "bin" / "linux" / goarch


def install(built: Path, target: Path) -> None:
    staging = target.with_name(f".{target.name}.new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in COMPONENTS:
        shutil.copy2(built / name, staging / name)
    if not is_built(staging):
        raise SetupError(f"the built components in {built} do not report {KUBE_VERSION}")
    record = [
        f"Kubernetes {KUBE_VERSION}: {', '.join(COMPONENTS)}",
        *(
            f"vendor {module}: {package} {package_version(package)}"
            for module, package in VENDOR_REPLACEMENTS.items()
        ),
        f"built: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
    ]
    (staging / "VERSION").write_text("\n".join(record) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    print(f"installed {', '.join(COMPONENTS)} into {target}", flush=True)


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
            "GO111MODULE": "off",
        }
        run([GO_ROOT / "bin" / "go", "build", "-o", work / "pause", work / "pause.go"], env=env)
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
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = node_dir()
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(target):
            install_packages((*PACKAGES, *NODE_PACKAGES))
        else:
            install_packages((*PACKAGES, *NODE_PACKAGES))
            tree = fetch_source(cache)
            replace_vendored_modules(tree)
            install(build_components(tree), target)
            shutil.rmtree(tree.parent)  # the binaries are what is cached, not the 2 GB tree
            for stale in target.parent.glob("kube-node-*"):
                if stale != target:
                    shutil.rmtree(stale)
        if not (target / PAUSE_ARCHIVE).is_file():
            build_pause(target / PAUSE_ARCHIVE)
    return target


def main() -> int:
    return set_up_tier("pod tier", "KOPF_RECONCILE_SKIP_POD_TIER", set_up)


if __name__ == "__main__":
    sys.exit(main())
