"""From an empty folder, as a new user: ``kopf-reconcile init``, the project's own tests,
``kopf-reconcile dev`` running its handlers (and reloading them), and the chart rendered and
linted with the project's values.

The pod tier's install of a scaffolded operator needs, besides: an image built from the
project's Dockerfile (``FROM kopf-reconcile:<version>`` plus ``handlers.py``) or the project's
image with ``--set-file handlers.inline=handlers.py``, the Secret ``<name>-db``, and ``helm
install`` with ``-f chart-values.yaml --set-file crds.manifests=crds/<plural>.yaml``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from chart_support import CHART, HELM, KUBECTL, helm
from support import eventually

BIN = Path(sys.executable).parent
NAME, KIND, PLURAL = "websites", "Website", "websites"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HELM.exists() or not KUBECTL.exists(), reason="`make tools`"),
]


def user_environment() -> dict[str, str]:
    """This machine's environment without what would configure the operator for it."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KOPF_RECONCILE_", "POD_", "KUBERNETES_", "PYTEST_"))
    }


def kopf_reconcile(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "kopf-reconcile"), *args],
        cwd=cwd, capture_output=True, text=True, timeout=60, env=user_environment(), check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("new-operator")
    result = kopf_reconcile("init", NAME, cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder


def test_init_writes_a_project_into_the_empty_folder(project: Path) -> None:
    files = sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file())
    assert files == sorted([
        ".dockerignore", ".gitignore", "Dockerfile", "README.md", "chart-values.yaml",
        f"crds/{PLURAL}.yaml", "handlers.py", "pyproject.toml", "tests/test_handlers.py",
    ])  # fmt: skip
    again = kopf_reconcile("init", NAME, cwd=project)
    assert again.returncode == 2
    assert "is not empty" in again.stderr


def test_the_projects_own_tests_pass_at_once(project: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=project, capture_output=True, text=True, timeout=300, env=user_environment(),
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def chart_args(project: Path) -> list[str]:
    return [
        f"--values={project / 'chart-values.yaml'}",
        f"--set-file=crds.manifests={project / 'crds' / f'{PLURAL}.yaml'}",
    ]


def test_the_chart_lints_and_renders_the_projects_operator(project: Path) -> None:
    lint = helm("lint", str(CHART), "--strict", *chart_args(project))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    result = helm("template", NAME, str(CHART), f"--namespace={NAME}", *chart_args(project))
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    crds = [d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"]
    assert crds == [f"{PLURAL}.example.com"]  # the project's, not the example's Device
    (watch,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == f"{NAME}-watch"]
    assert {"apiGroups": ["example.com"], "resources": [PLURAL], "verbs": ["list", "watch"]} in (
        watch["rules"]
    )
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"{NAME}-operator:0.1.0"
    assert container["args"][0] == "/app/handlers.py"
    secret = next(e for e in container["env"] if e["name"] == "KOPF_RECONCILE_DATABASE_URL")
    assert secret["valueFrom"]["secretKeyRef"]["name"] == f"{NAME}-db"
    dockerfile = (project / "Dockerfile").read_text()
    assert "FROM kopf-reconcile:0.1.0" in dockerfile
    assert "COPY --chmod=0644 handlers.py /app/handlers.py" in dockerfile


class Dev:
    """``kopf-reconcile dev handlers.py --reload`` in the project, its output collected."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self.reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            self.lines.append(line.decode(errors="replace").rstrip("\n"))

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    def exported(self, variable: str) -> str:
        prefix = f"  export {variable}="
        (line,) = [line for line in self.lines if line.startswith(prefix)]
        return line.removeprefix(prefix).strip("'")


@pytest_asyncio.fixture
async def dev(project: Path) -> AsyncIterator[Dev]:
    process = await asyncio.create_subprocess_exec(
        str(BIN / "kopf-reconcile"), "dev", "handlers.py", "--reload",
        cwd=project, env=user_environment(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    running = Dev(process)
    try:
        yield running
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await running.reading


async def kubectl(kubeconfig: str, *args: str, stdin: str | None = None) -> str:
    result = await asyncio.to_thread(
        subprocess.run,
        [str(KUBECTL), f"--kubeconfig={kubeconfig}", *args],
        input=stdin, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


async def test_dev_runs_the_handlers_and_reloads_them(project: Path, dev: Dev) -> None:
    ready = "ready: Ctrl-C stops everything"
    await eventually(lambda: dev.count(ready) == 1, timeout=90, message="\n".join(dev.lines))
    assert dev.count(f"created CRD {PLURAL}.example.com") == 1
    kubeconfig = dev.exported("KUBECONFIG")
    assert dev.exported("KOPF_RECONCILE_DATABASE_URL").startswith("postgresql://")

    website = {
        "apiVersion": "example.com/v1",
        "kind": KIND,
        "metadata": {"name": "hello", "namespace": "default"},
        "spec": {"greeting": "hello"},
    }
    await kubectl(kubeconfig, "apply", "-f", "-", stdin=json.dumps(website))

    async def status() -> dict[str, Any]:
        body = json.loads(await kubectl(kubeconfig, "get", PLURAL, "hello", "-o", "json"))
        return body.get("status") or {}

    async def reconciled() -> bool:
        return (await status()).get("observedGeneration") == 1

    await eventually(reconciled, timeout=30, message="hello reconciled")
    assert (await status())["epoch"] >= 1  # PostgreSQL leases, fenced writes

    handlers = project / "handlers.py"
    written = handlers.read_text()
    handlers.write_text(written + "\n# changed\n")
    await eventually(lambda: dev.count(ready) == 2, timeout=90, message="\n".join(dev.lines))
    assert dev.count("changed, restarting the operator") == 1
    # A mistake stops the operator, not the session; the fix starts it again.
    handlers.write_text(written + "\nthis is not Python\n")
    await eventually(
        lambda: dev.count("did not start") == 1, timeout=90, message="\n".join(dev.lines)
    )
    handlers.write_text(written)
    await eventually(lambda: dev.count(ready) == 3, timeout=90, message="\n".join(dev.lines))

    dev.process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(dev.process.wait(), 60) == 0
    workdir = Path(kubeconfig).parent
    assert not workdir.exists(), "the temporary directory is removed"
