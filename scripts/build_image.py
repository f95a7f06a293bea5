"""Build the operator's container image without Docker: ``make image``.

The image is the one the ``Dockerfile`` describes, made from the same steps by
Debian's own tools, so the image the tests run is the image users build:

1. a Debian bookworm root file system from ``debootstrap --variant=minbase``
   with Debian's ``python3`` (cached: it depends only on the Debian archive);
2. the project's wheel and its dependencies' wheels, made on this machine with
   its own pip configuration, installed offline into a virtualenv at
   ``/opt/kopf-reconcile`` inside the root file system (``chroot``: the venv is
   made by the image's own interpreter, so its paths are the image's);
3. a non-root user ``kopf`` (uid and gid 10001) with a passwd and a group entry
   (kopf asks ``getpass.getuser()`` at startup, which fails for a uid without
   one), and the example operator as ``/app/handlers.py``;
4. packed with Debian's ``umoci`` into an OCI image layout, entrypoint
   ``kopf-reconcile run``, and archived as ``build/image/kopf-reconcile-<version>.oci.tar``.

A build whose inputs (the recipe revision, the wheel, the handlers file) have
not changed since the last one is a no-op. Only Debian's archive and the Python
package index are contacted, through this machine's own apt and pip settings.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from debian import SetupError, debian_entries, install_packages, run

from kopf_reconcile.testing.kube_release import cache_dir

ROOT = Path(__file__).resolve().parents[1]
#: Bumped whenever the recipe changes, so that an older base or image is not reused.
RECIPE_REVISION = 1
SUITE = "bookworm"
IMAGE_NAME = "kopf-reconcile"
USER, UID = "kopf", 10001
VENV = "/opt/kopf-reconcile"
HANDLERS = ROOT / "operator" / "examples" / "devices.py"
OUTPUT = ROOT / "build" / "image"
BUILD_PACKAGES = ("debootstrap", "umoci")
#: In the image: Debian's interpreter and what ``python3 -m venv`` and TLS need.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
#: Documentation and caches the image never reads.
PRUNED = ("usr/share/doc", "usr/share/man", "usr/share/info", "var/cache/apt", "var/lib/apt/lists")


def project_version() -> str:
    import tomllib

    with (ROOT / "pyproject.toml").open("rb") as file:
        version: str = tomllib.load(file)["project"]["version"]
    return version


def base_tarball() -> Path:
    """The debootstrapped root file system, made once and cached outside the work tree."""
    cache = cache_dir() / f"image-base-{SUITE}-r{RECIPE_REVISION}.tar"
    if cache.is_file():
        return cache
    entries = [e for e in debian_entries(SUITE) if SUITE in e.suites]
    if not entries:
        raise SetupError(f"no apt source entry for Debian {SUITE} itself to debootstrap from")
    mirror, keyring = entries[0].uris[0], entries[0].signed_by
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kopf-reconcile-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        argv: list[str | Path] = [
            "debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
        ]  # fmt: skip
        if keyring:
            argv.append(f"--keyring={keyring}")
        started = time.monotonic()
        run([*argv, SUITE, rootfs, mirror])
        for pruned in PRUNED:
            shutil.rmtree(rootfs / pruned, ignore_errors=True)
        staging = cache.with_name(f".{cache.name}.new")
        # Numeric owners and device nodes are kept: tar runs as root.
        run(["tar", "--numeric-owner", "-C", rootfs, "-cf", staging, "."])
        staging.replace(cache)
        print(f"debootstrapped {SUITE} in {time.monotonic() - started:.0f} s", flush=True)
    return cache


def build_wheels(wheelhouse: Path) -> Path:
    """The project's wheel and every dependency's, with this machine's pip settings."""
    python = sys.executable
    run([python, "-m", "pip", "wheel", "-qq", "--no-deps", "-w", wheelhouse, ROOT])
    (wheel,) = wheelhouse.glob("kopf_reconcile-*.whl")
    run([python, "-m", "pip", "wheel", "-qq", "-w", wheelhouse, wheel])
    return wheel


def inputs_digest() -> str:
    """What the image is made of: the recipe, the package's sources, the handlers file."""
    sha = hashlib.sha256(f"recipe {RECIPE_REVISION}".encode())
    package = ROOT / "operator" / "kopf_reconcile"
    sources = sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in [ROOT / "pyproject.toml", HANDLERS, Path(__file__), *sources]:
        sha.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return sha.hexdigest()


def add_user(rootfs: Path) -> None:
    """A passwd and a group entry for the image's user, and its home directory."""
    with (rootfs / "etc" / "passwd").open("a") as passwd:
        passwd.write(f"{USER}:x:{UID}:{UID}:kopf-reconcile:/home/{USER}:/usr/sbin/nologin\n")
    with (rootfs / "etc" / "group").open("a") as group:
        group.write(f"{USER}:x:{UID}:\n")
    home = rootfs / "home" / USER
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, UID, UID)


def populate(rootfs: Path, wheelhouse: Path, wheel: Path) -> None:
    """The venv with the wheel, the user, the handlers file: the Dockerfile's final stage."""
    inside = rootfs / "tmp" / "wheelhouse"
    shutil.copytree(wheelhouse, inside)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}
    run(["chroot", rootfs, "/usr/bin/python3", "-m", "venv", VENV], env=env)
    run(
        ["chroot", rootfs, f"{VENV}/bin/pip", "install", "--quiet", "--no-index",
         "--no-cache-dir", "--disable-pip-version-check", "--find-links", "/tmp/wheelhouse",
         f"/tmp/wheelhouse/{wheel.name}"],
        env=env,
    )  # fmt: skip
    shutil.rmtree(inside)
    for cache in (rootfs / VENV.lstrip("/")).rglob("__pycache__"):
        shutil.rmtree(cache)
    add_user(rootfs)
    app = rootfs / "app"
    app.mkdir(exist_ok=True)
    shutil.copy2(HANDLERS, app / "handlers.py")
    (app / "handlers.py").chmod(0o644)


def pack(rootfs_tar: Path, wheelhouse: Path, wheel: Path, version: str, target: Path) -> None:
    """umoci: an empty image, its bundle filled with the root file system, repacked."""
    with tempfile.TemporaryDirectory(prefix="kopf-reconcile-image-") as tmp:
        layout, bundle = Path(tmp) / "layout", Path(tmp) / "bundle"
        ref = f"{layout}:{version}"
        run(["umoci", "init", "--layout", layout])
        run(["umoci", "new", "--image", ref])
        run(["umoci", "unpack", "--image", ref, bundle])
        rootfs = bundle / "rootfs"
        run(["tar", "--numeric-owner", "-C", rootfs, "-xf", rootfs_tar])
        populate(rootfs, wheelhouse, wheel)
        run(["umoci", "repack", "--image", ref, bundle])
        run(
            ["umoci", "config", "--image", ref,
             f"--config.user={UID}:{UID}",
             "--config.entrypoint=kopf-reconcile", "--config.entrypoint=run",
             "--config.cmd=/app/handlers.py",
             "--config.workingdir=/app",
             f"--config.env=PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "--config.env=PYTHONUNBUFFERED=1",
             "--config.env=KOPF_RECONCILE_METRICS_HOST=0.0.0.0",
             f"--config.exposedports={8080}/tcp",
             f"--config.label=org.opencontainers.image.version={version}",
             "--config.label=org.opencontainers.image.title=kopf-reconcile",
             f"--author={IMAGE_NAME}",
             "--history.created_by=make image (scripts/build_image.py)"],
        )  # fmt: skip
        run(["umoci", "gc", "--layout", layout])
        staging = target.with_name(f".{target.name}.new")
        with tarfile.open(staging, "w") as archive:
            for entry in sorted(layout.iterdir()):
                archive.add(entry, arcname=entry.name)
        staging.replace(target)


def image_config(archive: Path) -> dict[str, object]:
    """The OCI image configuration inside an archive made by :func:`pack` (for checks)."""
    with tarfile.open(archive) as tar:

        def blob(descriptor: dict[str, str]) -> dict[str, object]:
            algorithm, hexdigest = descriptor["digest"].split(":", 1)
            member = tar.extractfile(f"blobs/{algorithm}/{hexdigest}")
            assert member is not None
            loaded: dict[str, object] = json.load(member)
            return loaded

        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        manifest = blob(index["manifests"][0])
        return blob(manifest["config"])  # type: ignore[arg-type]


def image_is_current(target: Path) -> bool:
    """Whether ``target`` was built from the current inputs (tests refuse a stale image)."""
    stamp = target.with_suffix(".inputs")
    return target.is_file() and stamp.is_file() and stamp.read_text() == inputs_digest()


def main() -> int:
    in_ci = os.environ.get("CI") == "true"
    if os.environ.get("KOPF_RECONCILE_SKIP_IMAGE") == "1":
        if not in_ci:
            print("image: skipped (KOPF_RECONCILE_SKIP_IMAGE=1)")
            return 0
        print("image: required under CI=true; the skip variable is ignored")
    started = time.monotonic()
    version = project_version()
    OUTPUT.mkdir(parents=True, exist_ok=True)
    target = OUTPUT / f"{IMAGE_NAME}-{version}.oci.tar"
    stamp = target.with_suffix(".inputs")
    try:
        install_packages(BUILD_PACKAGES)
        cache_dir().mkdir(parents=True, exist_ok=True)
        with (cache_dir() / ".image.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            inputs = inputs_digest()
            if image_is_current(target):
                print(f"image {IMAGE_NAME}:{version} at {target} is up to date", flush=True)
                return 0
            base = base_tarball()
            with tempfile.TemporaryDirectory(prefix="kopf-reconcile-wheels-") as tmp:
                wheelhouse = Path(tmp)
                wheel = build_wheels(wheelhouse)
                pack(base, wheelhouse, wheel, version, target)
                stamp.write_text(inputs)
    except (SetupError, OSError, subprocess.SubprocessError) as exc:
        print(f"error: the image cannot be built: {exc}", file=sys.stderr)
        if not in_ci:
            hint = "       set KOPF_RECONCILE_SKIP_IMAGE=1 to run without it locally"
            print(hint, file=sys.stderr)
        return 1
    print(
        f"image {IMAGE_NAME}:{version} at {target} "
        f"({target.stat().st_size // 2**20} MiB, {time.monotonic() - started:.0f} s)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
