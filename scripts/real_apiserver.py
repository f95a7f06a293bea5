"""Set up the real kube-apiserver test tier: build kube-apiserver once, into a cache.

The real tier runs the project's Kubernetes tests against kube-apiserver
v1.20.2 with Debian's etcd, as controller-runtime's envtest does. Its binary is
built from Debian bookworm's ``kubernetes`` source package, which is the whole
upstream tree including ``vendor/``, so the build runs offline.

Steps, each skipped when its result is already there (the script is idempotent
and a fast no-op once the binary is cached):

1. install the Debian packages the build and the tier need (``apt-get update``
   once, only when one is missing);
2. derive ``deb-src`` entries from the machine's own apt source entries for
   Debian into a private apt configuration in the cache (the system's apt
   configuration is never touched) and ``apt-get source`` the package;
3. replace the vendored Go modules that predate Go 1.18 by Debian's packaged
   fixed releases, then ``make WHAT=cmd/kube-apiserver`` in the tree, offline;
4. check that the result runs and reports the expected version, record that
   report next to the binary, and install it atomically.

``KOPF_RECONCILE_SKIP_REAL_APISERVER=1`` skips the whole step locally; under
``CI=true`` the real tier is required, so the variable is ignored there and
any failure is fatal.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kopf_reconcile.testing.real_apiserver import KUBE_VERSION, apiserver_binary, cache_dir

SOURCE_PACKAGE = "kubernetes"
SOURCE_VERSION = "1.20.5+really1.20.2-1.1+deb12u1"
#: The Debian release whose archive carries SOURCE_VERSION.
DEBIAN_CODENAME = "bookworm"
GO_ROOT = Path("/usr/lib/go-1.19")
#: Vendored Go modules too old for Go >= 1.18, and the Debian packages of their fixed
#: releases (upstream Kubernetes made the same bump on its later branches): reflect2
#: 1.0.1 reads map internals that Go 1.18 changed, so a server built with it dies
#: encoding any custom resource.
VENDOR_REPLACEMENTS = {"github.com/modern-go/reflect2": "golang-github-modern-go-reflect2-dev"}
DEBIAN_GO_SOURCES = Path("/usr/share/gocode/src")
#: Needed to build (go, rsync, make, dpkg-source) and to run the tier (etcd, openssl).
PACKAGES = (
    "golang-1.19-go",
    *VENDOR_REPLACEMENTS.values(),
    "rsync",
    "make",
    "dpkg-dev",
    "etcd-server",
    "openssl",
)
RUNTIME_PACKAGES = ("etcd-server", "openssl")
SYSTEM_SOURCE_LIST = Path("/etc/apt/sources.list")
SYSTEM_SOURCE_PARTS = Path("/etc/apt/sources.list.d")


class SetupError(Exception):
    """The real tier cannot be set up; the message says why and what to do."""


@dataclass(frozen=True)
class SourceEntry:
    """One apt source entry: where a Debian archive is and what to take from it."""

    uris: tuple[str, ...]
    suites: tuple[str, ...]
    components: tuple[str, ...]
    signed_by: str | None

    def as_deb_src_stanza(self) -> str:
        lines = [
            "Types: deb-src",
            f"URIs: {' '.join(self.uris)}",
            f"Suites: {' '.join(self.suites)}",
            f"Components: {' '.join(self.components)}",
        ]
        if self.signed_by:
            lines.append(f"Signed-By: {self.signed_by}")
        return "\n".join(lines) + "\n"


def run(
    argv: Sequence[str | Path], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> None:
    print("+", " ".join(str(arg) for arg in argv), flush=True)
    result = subprocess.run([str(arg) for arg in argv], cwd=cwd, env=env, check=False)
    if result.returncode != 0:
        raise SetupError(f"command failed with exit code {result.returncode}: {argv[0]}")


def as_root(argv: Sequence[str | Path]) -> list[str | Path]:
    """Package installation needs root; use sudo when not running as root."""
    if os.geteuid() == 0:
        return list(argv)
    if shutil.which("sudo") is None:
        raise SetupError("installing Debian packages needs root (or sudo)")
    return ["sudo", *argv]


# --- step 1: packages --------------------------------------------------------


def missing_packages(packages: Sequence[str]) -> list[str]:
    missing = []
    for package in packages:
        query = subprocess.run(
            ["dpkg-query", "-W", "-f=${db:Status-Status}", package],
            capture_output=True,
            text=True,
            check=False,
        )
        if query.stdout.strip() != "installed":
            missing.append(package)
    return missing


def package_version(package: str) -> str:
    query = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, check=True
    )
    return query.stdout.strip()


def install_packages(packages: Sequence[str]) -> None:
    missing = missing_packages(packages)
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(as_root(["apt-get", "update", "-q"]), env=env)
    run(as_root(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]), env=env)


# --- step 2: source ----------------------------------------------------------


def deb822_stanzas(text: str) -> Iterator[dict[str, str]]:
    """Fields of each stanza of a deb822 ``.sources`` file (continuation lines folded)."""
    fields: dict[str, str] = {}
    key = None
    for line in [*text.splitlines(), ""]:
        if line.startswith("#"):
            continue
        if not line.strip():
            if fields:
                yield fields
            fields, key = {}, None
        elif line[0].isspace() and key is not None:
            fields[key] += " " + line.strip()
        elif ":" in line:
            key, value = line.split(":", 1)
            key = key.strip().lower()
            fields[key] = value.strip()


def one_line_entries(text: str) -> Iterator[SourceEntry]:
    """Entries of a one-line ``sources.list``: ``deb [options] uri suite components...``."""
    for raw_line in text.splitlines():
        line = raw_line.split("#", 1)[0].strip()
        match = re.fullmatch(r"(\S+)\s+(?:\[([^\]]*)\]\s+)?(\S+)\s+(\S+)\s*(.*)", line)
        if not match or match[1] != "deb":
            continue
        options = dict(opt.split("=", 1) for opt in (match[2] or "").split() if "=" in opt)
        yield SourceEntry(
            uris=(match[3],),
            suites=(match[4],),
            components=tuple(match[5].split()),
            signed_by=options.get("signed-by"),
        )


def system_entries() -> Iterator[SourceEntry]:
    """The binary-package entries apt itself reads (files apt ignores are ignored too)."""
    one_line_files = [SYSTEM_SOURCE_LIST, *sorted(SYSTEM_SOURCE_PARTS.glob("*.list"))]
    for path in one_line_files:
        if path.is_file():
            yield from one_line_entries(path.read_text())
    for path in sorted(SYSTEM_SOURCE_PARTS.glob("*.sources")):
        for fields in deb822_stanzas(path.read_text()):
            if "deb" not in fields.get("types", "").split():
                continue
            if fields.get("enabled", "yes").lower() == "no":
                continue
            yield SourceEntry(
                uris=tuple(fields.get("uris", "").split()),
                suites=tuple(fields.get("suites", "").split()),
                components=tuple(fields.get("components", "").split()),
                signed_by=fields.get("signed-by"),
            )


def debian_source_entries() -> list[SourceEntry]:
    """The machine's Debian entries for the release that carries the package, as deb-src."""
    entries = []
    for entry in system_entries():
        suites = tuple(
            suite
            for suite in entry.suites
            if suite == DEBIAN_CODENAME or suite.startswith(f"{DEBIAN_CODENAME}-")
        )
        if suites and entry.uris and "main" in entry.components:
            entries.append(
                SourceEntry(entry.uris, suites, ("main",), entry.signed_by),
            )
    if not entries:
        raise SetupError(
            f"no apt source entry for Debian {DEBIAN_CODENAME} (component main) found in "
            f"{SYSTEM_SOURCE_LIST} or {SYSTEM_SOURCE_PARTS}; the source package "
            f"{SOURCE_PACKAGE} {SOURCE_VERSION} comes from that archive"
        )
    return entries


def private_apt_options(apt_dir: Path) -> list[str]:
    """apt options that read sources and keep lists and caches in ``apt_dir`` only."""
    options = [
        "-o", "Dir::Etc::SourceList=/dev/null",
        "-o", f"Dir::Etc::SourceParts={apt_dir / 'sources.list.d'}",
        "-o", f"Dir::State::Lists={apt_dir / 'lists'}",
        "-o", f"Dir::Cache={apt_dir / 'cache'}",
    ]  # fmt: skip
    if os.geteuid() == 0:
        # apt's unprivileged download user cannot enter root's private cache directory.
        options += ["-o", "APT::Sandbox::User=root"]
    return options


def fetch_source(cache: Path) -> Path:
    """The unpacked source tree, downloaded and unpacked on first use."""
    tree = cache / "src" / f"{SOURCE_PACKAGE}-{SOURCE_VERSION}"
    if (tree / "Makefile").is_file():
        return tree
    apt_dir = cache / "apt"
    for sub in ("sources.list.d", "lists/partial", "cache/archives/partial"):
        (apt_dir / sub).mkdir(parents=True, exist_ok=True)
    stanzas = "\n".join(entry.as_deb_src_stanza() for entry in debian_source_entries())
    (apt_dir / "sources.list.d" / "debian-src.sources").write_text(stanzas)
    options = private_apt_options(apt_dir)
    run(["apt-get", "update", "-q", *options])

    download = cache / "src" / "download"
    shutil.rmtree(download, ignore_errors=True)
    download.mkdir(parents=True)
    run(
        ["apt-get", "source", "-q", "--only-source", *options,
         f"{SOURCE_PACKAGE}={SOURCE_VERSION}"],
        cwd=download,
    )  # fmt: skip
    unpacked = [path for path in download.iterdir() if path.is_dir()]
    if len(unpacked) != 1 or not (unpacked[0] / "Makefile").is_file():
        raise SetupError(f"apt-get source left no single source tree in {download}")
    shutil.rmtree(tree, ignore_errors=True)
    unpacked[0].rename(tree)
    shutil.rmtree(download)
    return tree


def replace_vendored_modules(tree: Path) -> None:
    """Swap the Go sources of each module in VENDOR_REPLACEMENTS for Debian's release."""
    for module in VENDOR_REPLACEMENTS:
        vendored = tree / "vendor" / module
        for old in [*vendored.glob("*.go"), *vendored.glob("*.s")]:
            old.unlink()
        packaged = DEBIAN_GO_SOURCES / module
        for new in [*packaged.glob("*.go"), *packaged.glob("*.s")]:
            if not new.name.endswith("_test.go"):
                shutil.copy2(new, vendored / new.name)


# --- step 3: build -----------------------------------------------------------


def build(tree: Path) -> Path:
    """``make WHAT=cmd/kube-apiserver``, offline; returns the built binary."""
    env = {
        **os.environ,
        "PATH": f"{GO_ROOT / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "GOPROXY": "off",
        "GOFLAGS": "-mod=vendor",
        "CGO_ENABLED": "0",  # as Debian builds it: static, and no C compiler needed
        # There is no git checkout to read the version from: state it.
        "KUBE_GIT_VERSION": KUBE_VERSION,
        "KUBE_GIT_TREE_STATE": "clean",
    }
    started = time.monotonic()
    run(["make", "WHAT=cmd/kube-apiserver"], cwd=tree, env=env)
    print(f"built kube-apiserver in {time.monotonic() - started:.0f} s", flush=True)
    goarch = subprocess.run(
        [GO_ROOT / "bin" / "go", "env", "GOARCH"], capture_output=True, text=True, check=True
    ).stdout.strip()
    built = tree / "_output" / "local" / "bin" / "linux" / goarch / "kube-apiserver"
    if not built.is_file():
        raise SetupError(f"the build reported success but left no binary at {built}")
    return built


# --- step 4: verify and install ----------------------------------------------


def reported_version(binary: Path) -> str | None:
    """What ``kube-apiserver --version`` prints, or None when it does not run."""
    try:
        result = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def is_expected(version: str | None) -> bool:
    return version == f"Kubernetes {KUBE_VERSION}"


def install(built: Path, target: Path) -> None:
    version = reported_version(built)
    if not is_expected(version):
        raise SetupError(
            f"{built} --version printed {version!r}, expected 'Kubernetes {KUBE_VERSION}'"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.new")
    shutil.copy2(built, staging)
    staging.replace(target)
    record = [
        f"Kubernetes {KUBE_VERSION}",
        f"source package: {SOURCE_PACKAGE} {SOURCE_VERSION}",
        *(
            f"vendor {module}: {package} {package_version(package)}"
            for module, package in VENDOR_REPLACEMENTS.items()
        ),
        f"built: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
    ]
    target.with_name("VERSION").write_text("\n".join(record) + "\n")
    print(f"installed {target}: {version}", flush=True)


def set_up(binary: Path) -> None:
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        # Concurrent runs (two checkouts) wait for each other instead of racing.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_expected(reported_version(binary)):
            install_packages(RUNTIME_PACKAGES)
            return
        install_packages(PACKAGES)
        tree = fetch_source(cache)
        replace_vendored_modules(tree)
        install(build(tree), binary)
        # The binary is what is cached: its 2 GB source and build tree, and the builds
        # of earlier revisions, are not worth keeping.
        shutil.rmtree(tree.parent)
        for stale in binary.parent.parent.glob("kube-apiserver-*"):
            if stale != binary.parent:
                shutil.rmtree(stale)


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
    except (SetupError, OSError, subprocess.SubprocessError) as exc:
        print(f"error: the {what} cannot be set up: {exc}", file=sys.stderr)
        if not in_ci:
            print(f"       set {skip_variable}=1 to run without it locally", file=sys.stderr)
        return 1
    print(f"{what}: {result} ({KUBE_VERSION})", flush=True)
    return 0


def main() -> int:
    def step() -> Path:
        binary = apiserver_binary()
        set_up(binary)
        return binary

    return set_up_tier("real kube-apiserver tier", "KOPF_RECONCILE_SKIP_REAL_APISERVER", step)


if __name__ == "__main__":
    sys.exit(main())
