"""Build the controller-runtime baseline (``controller_runtime/``) once, into the project's cache.

The source is this project's own (``main.go``, ``go.mod``, ``go.sum``); its
dependencies come from the Go module proxy. It is built with the machine's Go and
the same settings as the real tiers' Kubernetes (``scripts/kube_build.py``: Go's
module and build caches in ``<cache>/go``, static, trimmed paths), from a copy of
the source made in the cache, so a build never edits the work tree. The binary
lands in ``<cache>/controller-runtime-<version>-<digest>/devices-operator``, the
digest taken over the source files and the Go version: a changed ``main.go`` or a
new Go builds anew, anything else is a no-op.

    python benchmarks/baselines/build.py      # prints the binary's path
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).resolve().parent / "controller_runtime"
FILES = ("main.go", "go.mod", "go.sum")
BINARY = "devices-operator"
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def kube_build() -> ModuleType:
    """``scripts/kube_build.py`` (its Go settings and runner), loaded by path."""
    spec = importlib.util.spec_from_file_location("kube_build", SCRIPTS / "kube_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def controller_runtime_version(source: Path = SOURCE) -> str:
    """The controller-runtime release ``go.mod`` requires (``v0.25.3``)."""
    found = re.search(r"sigs\.k8s\.io/controller-runtime\s+(v\S+)", (source / "go.mod").read_text())
    if found is None:
        raise ValueError(f"{source / 'go.mod'} requires no sigs.k8s.io/controller-runtime")
    return found[1]


def digest(source: Path, go_version: str) -> str:
    """A digest of the source files that exist and of the Go version that builds them."""
    hasher = hashlib.sha256(go_version.encode())
    for name in FILES:
        path = source / name
        hasher.update(name.encode() + b"\0")
        hasher.update(path.read_bytes() if path.exists() else b"(none)")
    return hasher.hexdigest()[:12]


def binary_path(cache: Path, source: Path, go_version: str) -> Path:
    version = controller_runtime_version(source)
    return cache / f"controller-runtime-{version}-{digest(source, go_version)}" / BINARY


def build(source: Path = SOURCE) -> Path:
    """The baseline's binary, built first if the cache has none for this source and Go."""
    kb = kube_build()
    go = kb.go()
    go_version = subprocess.run(
        [go, "version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    target = binary_path(kb.cache_dir(), source, go_version)
    if target.exists():
        return target
    work = target.parent / "src"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name in FILES:
        if (source / name).exists():
            shutil.copy2(source / name, work / name)
    started = time.monotonic()
    print(f"building the controller-runtime baseline ({go_version}) into {target}", flush=True)
    kb.run_go(["mod", "download"], work)
    staging = target.with_name(f".{BINARY}.new")
    kb.run_go(["build", "-trimpath", "-ldflags", "-s -w", "-o", staging, "."], work)
    staging.replace(target)
    print(f"built the baseline in {time.monotonic() - started:.0f} s", flush=True)
    return target


if __name__ == "__main__":
    print(build())
