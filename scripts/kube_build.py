"""Build Kubernetes components and etcd from Go modules, once, into the cache.

``go install k8s.io/kubernetes/cmd/kube-apiserver@v1.37.2`` is refused: the
module's go.mod replaces its staging modules (``k8s.io/api``,
``k8s.io/client-go``, ...) with ``./staging`` directories, and a module's
replace directives bind only builds of that module itself. So each release is
built from a small wrapper module of the project's own, made in the cache: it
requires ``k8s.io/kubernetes`` at the release and replaces every staging module
that the release's go.mod lists with the published module of the same release
(``v0.37.2`` for ``v1.37.2``). The list is read from the release's own go.mod,
so a new release needs no edit here. etcd's server module replaces its sibling
modules the same way and gets a wrapper of its own.

Go's module and build caches live in the project's cache too
(``<cache>/go``), so the machine's own Go setup is never touched, and a second
build (another component, a revision bump) reuses what the first compiled.
The binaries are static (``CGO_ENABLED=0``) and report the release as an
upstream build does (the version variables that Kubernetes' own build sets).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from kopf_reconcile.testing.kube_release import (
    ETCD_VERSION,
    cache_dir,
    etcd_binary,
    kube_binary,
    minor_of,
)

#: The packages that set the version a Kubernetes binary reports.
VERSION_PACKAGES = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
STAGING_REPLACE = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", re.MULTILINE)


class BuildError(Exception):
    """A build failed; the message says which and why."""


def go() -> str:
    found = shutil.which("go") or next(
        (str(p) for p in (Path("/usr/local/go/bin/go"), Path("/usr/lib/go/bin/go")) if p.exists()),
        None,
    )
    if found is None:
        raise BuildError("no Go toolchain on PATH: the real tiers are built with the machine's Go")
    return found


def go_env() -> dict[str, str]:
    """The machine's Go settings (proxy, checksum database), with the caches in the project's."""
    root = cache_dir() / "go"
    return {
        **os.environ,
        "GOPATH": str(root),
        "GOMODCACHE": str(root / "mod"),
        "GOCACHE": str(root / "build"),
        "GOFLAGS": "-mod=mod -modcacherw -buildvcs=false",
        "GOWORK": "off",
        "GOTOOLCHAIN": "local",
        "CGO_ENABLED": "0",
    }


def run_go(args: Sequence[str | Path], cwd: Path) -> str:
    argv = [go(), *(str(arg) for arg in args)]
    print("+", " ".join(argv), flush=True)
    result = subprocess.run(
        argv, cwd=cwd, env=go_env(), capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-30:])
        raise BuildError(f"`go {' '.join(str(a) for a in args)}` failed:\n{tail}")
    return result.stdout


def wrapper_module(
    name: str, requirement: str, replacements: dict[str, str], imports: Sequence[str]
) -> Path:
    """A module in the cache that requires ``requirement`` and builds ``imports``."""
    directory = cache_dir() / "go" / "wrappers" / name
    directory.mkdir(parents=True, exist_ok=True)
    module, version = requirement.split("@")
    lines = [f"module kopf-reconcile.invalid/build/{name}", "", "go 1.24", ""]
    lines += [f"require {module} {version}", ""]
    if replacements:
        pins = [f"\t{old} => {old} {new}" for old, new in sorted(replacements.items())]
        lines += ["replace (", *pins, ")", ""]
    (directory / "go.mod").write_text("\n".join(lines))
    (directory / "go.sum").unlink(missing_ok=True)
    # Blank imports pin every package to be built into the module graph; the build tag keeps
    # the file itself out of any build.
    body = "\n".join(f'\t_ "{path}"' for path in imports)
    (directory / "tools.go").write_text(
        f"//go:build tools\n\npackage tools\n\nimport (\n{body}\n)\n"
    )
    run_go(["mod", "tidy"], directory)
    return directory


def staging_modules(version: str) -> list[str]:
    """The staging modules that ``k8s.io/kubernetes@version``'s go.mod points at ``./staging``."""
    info = run_go(["mod", "download", "-json", f"k8s.io/kubernetes@{version}"], cache_dir())
    found = re.search(r'"GoMod":\s*"([^"]+)"', info)
    if found is None:
        raise BuildError(f"`go mod download` did not say where k8s.io/kubernetes@{version} is")
    go_mod = Path(found[1])
    modules = STAGING_REPLACE.findall(go_mod.read_text())
    if not modules:
        raise BuildError(f"{go_mod} lists no staging module: the wrapper would not build")
    return sorted(set(modules))


def version_ldflags(version: str) -> str:
    major, minor = minor_of(version).split(".")
    flags = ["-s", "-w"]
    for package in VERSION_PACKAGES:
        flags += [
            f"-X {package}.gitVersion={version}",
            f"-X {package}.gitMajor={major}",
            f"-X {package}.gitMinor={minor}",
            f"-X {package}.gitTreeState=clean",
            f"-X {package}.buildDate={time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
        ]
    return " ".join(flags)


def reported_version(binary: Path) -> str | None:
    """What ``binary --version`` prints, or None when it does not run."""
    try:
        result = subprocess.run(
            [binary, "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def is_kube_built(name: str, version: str) -> bool:
    return reported_version(kube_binary(name, version)) == f"Kubernetes {version}"


def build_kube(components: Sequence[str], version: str) -> None:
    """Build each of ``components`` (``kube-apiserver``, ``kubelet``, ...) at ``version``."""
    missing = [name for name in components if not is_kube_built(name, version)]
    if not missing:
        return
    patch = "v0." + version.lstrip("v").split(".", 1)[1]  # v1.37.2 -> v0.37.2
    replacements = dict.fromkeys(staging_modules(version), patch)
    packages = [f"k8s.io/kubernetes/cmd/{name}" for name in missing]
    wrapper = wrapper_module(
        f"kubernetes-{version}", f"k8s.io/kubernetes@{version}", replacements, packages
    )
    ldflags = version_ldflags(version)
    for name, package in zip(missing, packages, strict=True):
        target = kube_binary(name, version)
        install_built(name, wrapper, ["build", "-trimpath", "-ldflags", ldflags], package, target)
        if not is_kube_built(name, version):
            raise BuildError(f"{target} --version does not report Kubernetes {version}")
        record(target, f"Kubernetes {version}")


def is_etcd_built() -> bool:
    report = reported_version(etcd_binary()) or ""
    return f"etcd Version: {ETCD_VERSION.lstrip('v')}" in report


def build_etcd() -> None:
    if is_etcd_built():
        return
    package = "go.etcd.io/etcd/server/v3"
    wrapper = wrapper_module(f"etcd-{ETCD_VERSION}", f"{package}@{ETCD_VERSION}", {}, [package])
    build = ["build", "-trimpath", "-ldflags", "-s -w"]
    install_built("etcd", wrapper, build, package, etcd_binary())
    if not is_etcd_built():
        raise BuildError(f"{etcd_binary()} --version does not report etcd {ETCD_VERSION}")
    record(etcd_binary(), f"etcd {ETCD_VERSION}")


def install_built(name: str, wrapper: Path, build: list[str], package: str, target: Path) -> None:
    """``go build`` one package into a staging file, then move it into place atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.new")
    started = time.monotonic()
    run_go([*build, "-o", staging, package], wrapper)
    staging.replace(target)
    print(f"built {name} in {time.monotonic() - started:.0f} s: {target}", flush=True)


def record(binary: Path, what: str) -> None:
    """Note in the directory's ``VERSION`` file how ``binary`` was built (one line each)."""
    go_version = subprocess.run(
        [go(), "version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    built = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    versions = binary.parent / "VERSION"
    lines = versions.read_text().splitlines() if versions.exists() else []
    lines = [line for line in lines if not line.startswith(f"{binary.name}: ")]
    lines.append(f"{binary.name}: {what}, built {built} with {go_version}")
    versions.write_text("\n".join(sorted(lines)) + "\n")
