"""The chart deployed as users deploy it, on a real node with pods: the README's commands.

Each command of README's "Deploy with Helm" block runs here, in its order, on
the pod tier's node (``node.py``): the image ``make image`` built is imported
into the node's containerd, the chart is installed with values only (the
database Secret, and the API server's address, as the node has no
kube-proxy), and three replicas run as the chart's ServiceAccount, reaching
PostgreSQL through the node's address. Between the commands the tests prove
what the commands promise:

- Devices converge; no request of the operator is forbidden (the API server's
  audit log), and taking any one verb out of any one rule of the chart's
  roles denies one of the requests it made (every rule is needed);
- deleting the leader's pod hands the lease over with a higher epoch, and the
  database accepted no stale write; ``kubectl reconcile leases`` shows it;
- ``helm upgrade`` of one value rolls every pod with never two leaders: the
  pods share the node's clock, each logs "leads" after its lease is confirmed
  and "stops leading" before it lets go, so their leadership intervals,
  read from their logs, must not overlap;
- ``/metrics`` refuses a scrape without a token (401) and serves one with the token the
  chart's ServiceMonitor sends (200), the operator asking the API server (a TokenReview and
  a SubjectAccessReview);
- ``helm test`` passes; ``helm uninstall`` leaves no pod and no container.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import itertools
import json
import os
import re
import shlex
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
import yaml
from node import APISERVER_PORT, NODE_IP, PodNode
from release import assert_no_stale_write, audited_database, built_image, pods_dsn

from chart_support import (
    BIN,
    ROOT,
    Attributes,
    api,
    assert_every_verb_is_needed,
    impersonated,
)
from kopf_reconcile.testing import api_audit
from kopf_reconcile.testing.postgres import EmbeddedPostgres
from support import eventually

pytestmark = [
    pytest.mark.pods,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="session"),
]

NAMESPACE = "devices"
RELEASE = "devices"
LEASE = "devices.example.com-reconcile-device"
SERVICE_ACCOUNT = f"system:serviceaccount:{NAMESPACE}:{RELEASE}"
DATABASE_PORT = 5432
DEVICES = 20
#: README's placeholder database URL, replaced by the tier's own.
README_DSN = "postgresql://app:secret@db:5432/app"


# --- README's commands ---------------------------------------------------------------------


def readme_commands() -> list[list[str]]:
    """The shell block under README's "Deploy with Helm", one argv per command."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Deploy with Helm\n", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def command(*prefix: str) -> list[str]:
    """README's one command that starts with ``prefix``."""
    found = [argv for argv in readme_commands() if argv[: len(prefix)] == list(prefix)]
    assert len(found) == 1, f"README's Deploy with Helm block has {len(found)} `{' '.join(prefix)}`"
    return found[0]


@dataclass
class Deployment:
    node: PodNode
    dsn: str  # as the test reaches the database

    async def run(self, argv: list[str], timeout: float = 300) -> str:
        """A README command against the node: kubectl and helm with its kubeconfig."""
        argv = [arg.replace(README_DSN, self.pods_dsn) for arg in argv]
        if argv[0] == "helm" and argv[1] in ("install", "upgrade"):
            argv += [f"--set=apiServer.host={NODE_IP}", f"--set=apiServer.port={APISERVER_PORT}"]
        # As a user's shell runs them: .venv/bin first on PATH (kubectl finds its plugin
        # there), the node's kubeconfig in KUBECONFIG.
        env = {**os.environ, "KUBECONFIG": self.node.kubeconfig,
               "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}  # fmt: skip
        result = await asyncio.to_thread(
            subprocess.run, argv, cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
        assert result.returncode == 0, (
            f"{shlex.join(argv)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            f"\n{await self.describe()}"
        )
        return result.stdout

    @property
    def pods_dsn(self) -> str:
        """The database as the pods reach it: the node's address, forwarded to the server."""
        return pods_dsn(self.dsn, DATABASE_PORT)

    async def kubectl(self, *args: str, stdin: str | None = None) -> str:
        argv = [str(BIN / "kubectl"), f"--kubeconfig={self.node.kubeconfig}", *args]
        result = await asyncio.to_thread(
            subprocess.run, argv, input=stdin, capture_output=True, text=True
        )
        assert result.returncode == 0, f"{shlex.join(argv)}: {result.stderr}"
        return result.stdout

    async def pods(self) -> list[dict[str, Any]]:
        listed = json.loads(await self.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json"))
        return [p for p in listed["items"] if p["metadata"]["name"].startswith(RELEASE)]

    async def lease(self) -> dict[str, Any]:
        answer = await self.kubectl("get", "lease", LEASE, "-n", NAMESPACE, "-o", "json")
        spec: dict[str, Any] = json.loads(answer)["spec"]
        return spec

    async def describe(self) -> str:
        argv = [str(BIN / "kubectl"), f"--kubeconfig={self.node.kubeconfig}", "get", "all",
                "-n", NAMESPACE, "-o", "wide"]  # fmt: skip
        result = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True)
        return f"{result.stdout}{result.stderr}\n--- kubelet:\n{self.node.component_log('kubelet')}"


def pod_of(holder: str) -> str:
    """The pod of a lease holder: the chart's holder ids are ``<pod name>-<random suffix>``."""
    return holder.rsplit("-", 1)[0]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def deployment(
    pod_node: PodNode, embedded_postgres_server: EmbeddedPostgres
) -> AsyncIterator[Deployment]:
    """README's commands up to ``helm install``, run; the operator's database audited."""
    archive = built_image()
    dsn = await audited_database(embedded_postgres_server, pod_node, DATABASE_PORT)
    deployed = Deployment(pod_node, dsn)
    ctr = command("ctr")
    assert ctr[-1] == str(archive.relative_to(ROOT)), "README imports another archive"
    await pod_node.import_image(archive, ctr[ctr.index("--base-name") + 1])
    await deployed.run(command("kubectl", "create", "namespace"))
    await deployed.run(command("kubectl", "create", "secret"))
    started = time.monotonic()
    await deployed.run(command("helm", "install"))
    pod_node.timings["helm install --wait"] = time.monotonic() - started
    yield deployed


# --- what the tests check ------------------------------------------------------------------


async def create_devices(deployment: Deployment, names: list[str]) -> None:
    documents = [
        {"apiVersion": "example.com/v1", "kind": "Device",
         "metadata": {"name": name, "namespace": NAMESPACE}, "spec": {"desired": "on"}}
        for name in names
    ]  # fmt: skip
    manifest = deployment.node.log_dir / f"devices-{names[0]}.json"
    manifest.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": documents}))
    await deployment.kubectl("apply", "-f", str(manifest))


async def converged(deployment: Deployment, names: list[str], min_epoch: int = 1) -> bool:
    listed = json.loads(await deployment.kubectl("get", "devices", "-n", NAMESPACE, "-o", "json"))
    done = {
        d["metadata"]["name"]
        for d in listed["items"]
        if (d.get("status") or {}).get("observed") == d["spec"]["desired"]
        and (d.get("status") or {}).get("epoch", 0) >= min_epoch
    }
    return set(names) <= done


BROKEN_DEVICE = json.dumps({
    "apiVersion": "example.com/v1", "kind": "Device",
    "metadata": {"name": "broken"}, "spec": {"desired": "sideways"},
})  # fmt: skip


async def dead_lettered(deployment: Deployment, count: int) -> bool:
    """Whether the broken Device has a DeadLettered Event counting at least ``count``."""
    selector = "involvedObject.name=broken,reason=DeadLettered"
    answer = await deployment.kubectl(
        "get", "events", "-n", NAMESPACE, f"--field-selector={selector}", "-o", "json"
    )
    return any((e.get("count") or 1) >= count for e in json.loads(answer)["items"])


def fence_probe(event: dict[str, Any]) -> bool:
    return (
        event.get("verb") == "update"
        and "dryRun=" in event.get("requestURI", "")
        and "impersonatedUser" in event
    )


def operator_requests(node: PodNode) -> list[dict[str, Any]]:
    return [e for e in node.audit_events() if e.get("user", {}).get("username") == SERVICE_ACCOUNT]


_LEADS = re.compile(r" leads (?P<lease>\S+) as (?P<holder>\S+) \(epoch (?P<epoch>\d+)\)")
_STOPS = re.compile(r" (steps down from|stops leading) (?P<lease>\S+) \(epoch (?P<epoch>\d+)\)")


@dataclass(frozen=True)
class Leadership:
    pod: str
    epoch: int
    start: datetime.datetime
    end: datetime.datetime | None  # None: still leading when the log was read


def leaderships(pod: str, log: str) -> list[Leadership]:
    """Leadership intervals of one pod, from its JSON log lines (the node's one clock)."""
    found, current = [], None
    for line in log.splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        when = datetime.datetime.fromisoformat(record["time"])
        if match := _LEADS.search(" " + record["message"]):
            current = (int(match["epoch"]), when)
        elif (match := _STOPS.search(" " + record["message"])) and current is not None:
            found.append(Leadership(pod, current[0], current[1], when))
            current = None
    if current is not None:
        found.append(Leadership(pod, current[0], current[1], None))
    return found


def overlaps(intervals: list[Leadership]) -> list[tuple[Leadership, Leadership]]:
    ordered = sorted(intervals, key=lambda i: i.start)
    return [(a, b) for a, b in itertools.pairwise(ordered) if a.end is None or a.end > b.start]


# --- the tests, in README's order ----------------------------------------------------------


async def test_installed_replicas_converge_devices_without_a_forbidden_request(
    deployment: Deployment,
) -> None:
    pods = await deployment.pods()
    assert len(pods) == 3, await deployment.describe()
    assert all(p["status"]["phase"] == "Running" for p in pods)
    names = [f"device-{i}" for i in range(DEVICES)]
    await create_devices(deployment, names)
    await eventually(lambda: converged(deployment, names), timeout=90, message="Devices converge")
    # A malformed Device: dead-lettered, with a Warning Event on it; malformed again
    # differently, the same Event counts it (the Event rules of the chart are used).
    await deployment.kubectl("create", "-f", "-", "-n", NAMESPACE, stdin=BROKEN_DEVICE)
    await eventually(lambda: dead_lettered(deployment, 1), timeout=60, message="an Event")
    patch = '{"spec": {"desired": "upside-down"}}'
    await deployment.kubectl(
        "patch", "device", "broken", "-n", NAMESPACE, "--type=merge", "-p", patch
    )
    await eventually(lambda: dead_lettered(deployment, 2), timeout=60, message="counted twice")
    holder = (await deployment.lease())["holderIdentity"]
    assert pod_of(holder) in {p["metadata"]["name"] for p in pods}
    requests = operator_requests(deployment.node)
    assert requests, "the audit log shows no request of the chart's ServiceAccount"
    # (But the fence's coverage probe: a dry-run update of the Lease, impersonating a
    # holder that does not hold it, which the API server must refuse.)
    probes = [e for e in requests if fence_probe(e)]
    assert probes and all(e["responseStatus"]["code"] == 403 for e in probes), probes
    forbidden = [
        e for e in requests if e.get("responseStatus", {}).get("code") == 403 and not fence_probe(e)
    ]
    assert not forbidden, f"forbidden: {[(e['verb'], e['requestURI']) for e in forbidden]}"
    await assert_no_stale_write(deployment.dsn)


# A scrape from inside an operator pod, of its own port: the status without a token, then
# with the token on stdin (never on a command line).
SCRAPE = """
import sys, urllib.error, urllib.request
token = sys.stdin.read().strip()
def status(headers):
    request = urllib.request.Request("http://127.0.0.1:8080/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
print(status({}), status({"Authorization": "Bearer " + token}))
"""


async def service_monitor_token(deployment: Deployment) -> str:
    """The token the chart's ServiceMonitor sends: the Secret its endpoint names, once the
    token controller filled it in."""
    rendered = await deployment.run(
        ["helm", "template", RELEASE, "charts/kopf-reconcile", "-n", NAMESPACE,
         "--set", "database.existingSecret=devices-db",
         "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
         "--show-only", "templates/servicemonitor.yaml"]
    )  # fmt: skip
    (endpoint,) = yaml.safe_load(rendered)["spec"]["endpoints"]
    credentials = endpoint["authorization"]["credentials"]
    found: list[str] = []

    async def filled_in() -> bool:
        answer = await deployment.kubectl(
            "get", "secret", credentials["name"], "-n", NAMESPACE, "-o", "json"
        )
        data = json.loads(answer).get("data") or {}
        if credentials["key"] in data:
            found.append(base64.b64decode(data[credentials["key"]]).decode())
        return bool(found)

    await eventually(filled_in, timeout=60, message="the scraper's token Secret filled in")
    return found[0]


async def test_metrics_refuse_a_scrape_without_a_token_and_serve_the_service_monitors(
    deployment: Deployment,
) -> None:
    # Before the verb check below: the operator's TokenReviews and SubjectAccessReviews
    # happen here, so the rules allowing them are seen used.
    token = await service_monitor_token(deployment)
    shown = await deployment.kubectl(
        "exec", "-i", "-n", NAMESPACE, f"deploy/{RELEASE}", "--", "python", "-c", SCRAPE,
        stdin=token,
    )  # fmt: skip
    assert shown.split() == ["401", "200"], shown
    reviews = [
        e["objectRef"]["resource"]
        for e in operator_requests(deployment.node)
        if "objectRef" in e and e["verb"] == "create"
    ]
    assert {"tokenreviews", "subjectaccessreviews"} <= set(reviews), reviews


async def test_every_verb_of_every_rule_is_needed(deployment: Deployment) -> None:
    # NOTES.txt tells users to ask a replica itself, as the chart's ServiceAccount:
    shown = await deployment.kubectl(
        "exec", "-n", NAMESPACE, f"deploy/{RELEASE}", "--", "kopf-reconcile", "leases"
    )
    assert LEASE in shown, shown
    used = {
        Attributes(
            e["verb"],
            e["objectRef"].get("apiGroup", ""),
            e["objectRef"]["resource"],
            e["objectRef"].get("subresource", ""),
            e["objectRef"].get("namespace", ""),
        )
        for e in operator_requests(deployment.node)
        if "objectRef" in e and e.get("responseStatus", {}).get("code", 0) < 400
    }
    used |= {  # its fenced writes act as itself, with the lease as user extras
        a
        for e in operator_requests(deployment.node)
        if "impersonatedUser" in e and e.get("responseStatus", {}).get("code", 0) < 400
        for a in impersonated(
            e["impersonatedUser"]["username"], e["impersonatedUser"].get("extra") or {}
        )
    }
    manifest = await deployment.run(["helm", "get", "manifest", RELEASE, "-n", NAMESPACE])
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    async with deployment.node.http_session() as http:
        await assert_every_verb_is_needed(http, docs, NAMESPACE, SERVICE_ACCOUNT, used)


async def test_deleting_the_leaders_pod_hands_over_with_a_higher_epoch(
    deployment: Deployment,
) -> None:
    before = await deployment.lease()
    old_holder, old_epoch = before["holderIdentity"], int(before["leaseTransitions"])
    await deployment.kubectl("delete", "pod", pod_of(old_holder), "-n", NAMESPACE, "--wait=false")

    async def handed_over() -> bool:
        lease = await deployment.lease()
        return lease.get("holderIdentity") not in (None, "", old_holder)

    await eventually(handed_over, timeout=60, message="another pod takes the lease")
    after = await deployment.lease()
    assert int(after["leaseTransitions"]) > old_epoch
    shown = await deployment.run(command("kubectl", "reconcile", "leases"))
    assert after["holderIdentity"] in shown and str(after["leaseTransitions"]) in shown, shown
    names = [f"after-failover-{i}" for i in range(5)]
    await create_devices(deployment, names)
    new_epoch = int(after["leaseTransitions"])
    await eventually(
        lambda: converged(deployment, names, min_epoch=new_epoch),
        timeout=60,
        message="the new leader converges new Devices at its epoch",
    )
    await assert_no_stale_write(deployment.dsn)


async def test_helm_upgrade_rolls_every_pod_with_never_two_leaders(
    deployment: Deployment,
) -> None:
    before = {p["metadata"]["name"] for p in await deployment.pods()}

    async def rolled() -> bool:
        pods = await deployment.pods()
        ready = [
            p for p in pods
            if p["metadata"].get("deletionTimestamp") is None
            and any(c["type"] == "Ready" and c["status"] == "True"
                    for c in p["status"].get("conditions", []))
        ]  # fmt: skip
        return len(ready) == 3 and not {p["metadata"]["name"] for p in ready} & before

    async with LogRecorder(deployment.node) as recorder:
        await deployment.run(command("helm", "upgrade"))
        await eventually(rolled, timeout=180, message="every pod replaced")
        await eventually(
            lambda: _lease_held_by_a_new_pod(deployment, before),
            timeout=60,
            message="a new leader",
        )
    intervals = [i for pod, log in recorder.logs.items() for i in leaderships(pod, log)]
    assert len({i.pod for i in intervals}) >= 2, intervals  # the lease did move
    assert not overlaps(intervals), overlaps(intervals)
    await assert_no_stale_write(deployment.dsn)


async def _lease_held_by_a_new_pod(deployment: Deployment, old: set[str]) -> bool:
    holder = (await deployment.lease()).get("holderIdentity")
    return bool(holder) and pod_of(holder) not in old


class LogRecorder:
    """Snapshots of the operator containers' logs while pods come and go.

    A deleted pod's log stays on the node only until the kubelet's garbage
    collection: the recorder keeps the longest copy it has seen of each pod's.
    """

    def __init__(self, node: PodNode) -> None:
        self.node = node
        self.logs: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None

    def snapshot(self) -> None:
        for pod, text in self.node.container_logs(NAMESPACE, "operator").items():
            if len(text) >= len(self.logs.get(pod, "")):
                self.logs[pod] = text

    async def _run(self) -> None:
        while True:
            self.snapshot()
            await asyncio.sleep(0.3)

    async def __aenter__(self) -> LogRecorder:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.snapshot()


# After the upgrade: the frozen pod's leadership, as its own log tells it, overlaps its
# successor's (it could not log its step-down while frozen), which the upgrade test must not see.
async def test_a_frozen_leader_pod_gets_no_stale_write_into_the_api(
    deployment: Deployment,
) -> None:
    """The zombie in pods: the leader's container frozen past its lease while it works, a
    takeover, then thawed. The API server's audit log shows no write it admitted from the
    old term after the new one (the chart's fence), the database no stale write."""
    before = await deployment.lease()
    old_holder, old_epoch = before["holderIdentity"], int(before["leaseTransitions"])
    names = [f"frozen-{i}" for i in range(10)]
    await create_devices(deployment, names)  # work in flight as it freezes
    task = await deployment.node.freeze(NAMESPACE, pod_of(old_holder), "operator")
    try:

        async def taken_over() -> bool:
            lease = await deployment.lease()
            return lease.get("holderIdentity") not in (None, "", old_holder)

        await eventually(taken_over, timeout=90, message="another pod takes the lease over")
        new_epoch = int((await deployment.lease())["leaseTransitions"])
        assert new_epoch > old_epoch
        later = [f"after-freeze-{i}" for i in range(3)]
        await create_devices(deployment, later)
        await eventually(
            lambda: converged(deployment, later, min_epoch=new_epoch),
            timeout=60,
            message="the new leader converges new Devices at its epoch",
        )
        await eventually(
            lambda: converged(deployment, names),
            timeout=60,
            message="the Devices created as the leader froze converge too",
        )
    finally:
        await deployment.node.thaw(task)
    lease = f"{NAMESPACE}/{LEASE}"

    async def stepped_down() -> bool:  # the thawed pod's late writes are done by then
        logs = deployment.node.container_logs(NAMESPACE, "operator")
        log = next((text for pod, text in logs.items() if pod == pod_of(old_holder)), "")
        return any(i.end is not None for i in leaderships(pod_of(old_holder), log))

    await eventually(stepped_down, timeout=60, message="the thawed leader steps down")
    writes = [w for w in api_audit.api_writes(deployment.node.audit_log) if w.lease == lease]
    assert {w.epoch for w in writes if w.admitted} >= {new_epoch}, writes[-5:]
    stale = [w for w in api_audit.stale_api_writes(deployment.node.audit_log) if w.lease == lease]
    assert stale == [], stale
    await assert_no_stale_write(deployment.dsn)


async def test_helm_test_passes(deployment: Deployment) -> None:
    shown = await deployment.run(command("helm", "test"))
    assert "Succeeded" in shown, shown


async def test_helm_uninstall_leaves_nothing_running(deployment: Deployment) -> None:
    await deployment.run(command("helm", "uninstall"))

    async def gone() -> bool:
        return not await deployment.pods()

    await eventually(gone, timeout=120, message="every pod gone")
    async with deployment.node.http_session() as http:
        left = await api(http, "GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments")
        assert not left["items"]
    assert not await deployment.node.running_containers()
