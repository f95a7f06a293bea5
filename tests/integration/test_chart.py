"""The Helm chart and the image: rendered, validated, installed and run against the real API server.

Rendering tests hold the chart to what a platform team expects (a strict values
schema, the Restricted pod security standard, replicas spread across nodes, a
grace period that outlasts the stop timeout, the default CRD identical to ``crds/``). On
the real kube-apiserver tier the chart is installed with Helm 4's defaults
(server-side apply), and the operator of the image ``make image`` builds runs
as the chart's ServiceAccount, as uid 10001 in the image's root file system,
through a proxy that records every request it makes: none may be forbidden,
and taking any one verb out of any one rule must deny one of them (every
permission is used). The helm test hook's program runs there too, with the
in-cluster credentials of the hook's own ServiceAccount. No kubelet runs on this
tier, so the operator runs as processes, not pods (docs/testing.md).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from chart_support import (
    CHART,
    HELM,
    KUBECTL,
    ROOT,
    OperatorProcess,
    Recorded,
    RecordingProxy,
    SocketForwarder,
    ahelm,
    api,
    assert_every_verb_is_needed,
    attributes,
    build_image_module,
    helm,
    image_archive,
    image_problem,
    service_account_kubeconfig,
    unpack_image,
)
from kopf_reconcile.testing.chart_check import judge
from kopf_reconcile.testing.real_apiserver import dying_with_parent
from support import eventually

pytestmark = pytest.mark.skipif(
    not HELM.exists() or not KUBECTL.exists(),
    reason="helm/kubectl are installed into .venv/bin by `make tools`",
)

IN_CI = os.environ.get("CI") == "true"
UID = 10001
RECONCILER_ID = "reconcile-device"
_SERVING = re.compile(r"serving (http://[0-9.]+:[0-9]+)/metrics")


def render(*settings: str, kube_version: str = "1.37.2") -> list[dict[str, Any]]:
    sets = [f"--set={s}" for s in ("database.existingSecret=db", *settings)]
    result = helm(
        "template",
        "devices",
        str(CHART),
        "--namespace=ops",
        *sets,
        f"--kube-version={kube_version}",
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def operator_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(docs, "Deployment")
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


# --- rendering -------------------------------------------------------------------------


def test_chart_lints() -> None:
    result = helm("lint", str(CHART), "--set=database.existingSecret=db", "--strict")
    assert result.returncode == 0, result.stdout + result.stderr


def test_dsn_secret_is_required_with_a_clear_message() -> None:
    result = helm("template", "devices", str(CHART))
    assert result.returncode != 0
    assert "database.existingSecret is required" in result.stderr


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("replicas=3", "additional properties 'replicas' not allowed"),
        ("image.tagg=1", "additional properties 'tagg' not allowed"),
        ("replicaCount=three", "replicaCount"),
        ("clusterWide=maybe", "clusterWide"),
        ("logFormat=xml", "logFormat"),
        ("metrics.port=0", "metrics/port"),
        ("watch[0].verbs={get}", "additional properties 'verbs' not allowed"),
    ],
)
def test_values_schema_rejects_unknown_keys_and_bad_values(setting: str, complaint: str) -> None:
    result = helm(
        "template", "devices", str(CHART), "--set=database.existingSecret=db", f"--set={setting}"
    )
    assert result.returncode != 0, f"{setting} was accepted"
    assert complaint in result.stderr, result.stderr


def test_chart_crds_are_identical_to_the_crds_directory() -> None:
    """The example's CRD, the chart's default (crds.manifests empty), is the one of crds/."""
    chart_crds = {p.name: p.read_bytes() for p in (CHART / "files").glob("*.yaml")}
    crds = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    assert "devices.yaml" in chart_crds, "the example's CRD is the chart's default"
    for name, text in chart_crds.items():
        assert text == crds.get(name), f"charts/kopf-reconcile/files/{name} must copy crds/{name}"
    assert not (CHART / "crds").exists(), "Helm's crds/ would install the example's CRD always"


def test_deployment_wires_identity_database_probes_and_stop_timeout() -> None:
    docs = render("replicaCount=3", "stopTimeoutSeconds=40")
    (deployment,) = by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    pod = operator_pod(docs)
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    secret_ref = env["KOPF_RECONCILE_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert secret_ref == {"name": "db", "key": "database-url"}
    assert env["KOPF_RECONCILE_STOP_TIMEOUT"]["value"] == "40"
    assert "KUBERNETES_SERVICE_HOST" not in env  # in-cluster discovery unless asked
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # What the pod runs is the image's entrypoint (the Dockerfile's, as `make image` sets it)
    # followed by the chart's arguments.
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.M)
    assert entrypoint is not None
    argv = [*json.loads(entrypoint[1]), *container["args"]]
    assert argv == ["kopf-reconcile", "run", "/app/handlers.py", "--namespace=ops"]
    assert container["image"] == "kopf-reconcile:0.1.0"  # the chart's appVersion
    # The kubelet's SIGKILL comes after the stop timeout and a margin to release the lease.
    assert pod["terminationGracePeriodSeconds"] > 40


def test_api_server_address_can_be_given_for_clusters_without_service_routing() -> None:
    pod = operator_pod(render("apiServer.host=10.1.0.1", "apiServer.port=6443"))
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["KUBERNETES_SERVICE_HOST"] == "10.1.0.1"
    assert env["KUBERNETES_SERVICE_PORT"] == "6443"


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What the Restricted pod security standard finds wrong with ``pod``."""
    found = []
    pod_context = pod.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            found.append(flag)
    for volume in pod.get("volumes") or []:
        allowed = {
            "configMap",
            "emptyDir",
            "projected",
            "secret",
            "downwardAPI",
            "persistentVolumeClaim",
            "ephemeral",
            "csi",
        }
        if not set(volume) - {"name"} <= allowed:
            found.append(f"volume {volume['name']}")
    for container in pod["containers"] + pod.get("initContainers", []):
        context = container.get("securityContext") or {}
        name = container["name"]
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation must be false")
        if not (context.get("runAsNonRoot") or pod_context.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot")
        if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = context.get("seccompProfile") or pod_context.get("seccompProfile") or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{name}: capabilities must drop ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"{name}: hostPort")
    return found


def test_every_pod_passes_the_restricted_pod_security_standard() -> None:
    docs = render("handlers.inline=import kopf_reconcile")
    pods = [operator_pod(docs), *(d["spec"] for d in by_kind(docs, "Pod"))]
    assert len(pods) == 2, "the operator's pod and the helm test pod"
    for pod in pods:
        assert restricted_violations(pod) == []
    # ... and the check itself catches a pod that does not.
    loose = copy.deepcopy(pods[0])
    del loose["securityContext"]["seccompProfile"]
    loose["containers"][0]["securityContext"] = {}
    assert len(restricted_violations(loose)) >= 3


def test_replicas_spread_across_nodes_by_default() -> None:
    (spread,) = operator_pod(render())["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # one node still runs them all
    assert spread["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "devices"
    assert "topologySpreadConstraints" not in operator_pod(render("topologySpread.enabled=false"))


def test_service_ports_name_their_protocol_for_server_side_apply() -> None:
    docs = render()
    for service in by_kind(docs, "Service"):
        assert all(port.get("protocol") == "TCP" for port in service["spec"]["ports"])
    for container in operator_pod(docs)["containers"]:
        assert all(port.get("protocol") == "TCP" for port in container["ports"])


def rules_by_role(docs: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    return {
        (d["kind"], d["metadata"]["name"]): d["rules"]
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
        and "helm.sh/hook" not in (d["metadata"].get("annotations") or {})
    }


def test_rbac_namespaced_mode_reads_crds_and_namespaces_cluster_wide() -> None:
    roles = rules_by_role(render())
    scan = roles[("ClusterRole", "devices-ops-scan")]
    assert {r["resources"][0] for r in scan} == {"customresourcedefinitions", "namespaces"}
    watch = roles[("Role", "devices-watch")]
    assert {"devices", "devices/status", "events"} == {r["resources"][0] for r in watch}
    events = next(r for r in watch if r["resources"] == ["events"])
    assert events["verbs"] == ["list", "create", "patch"]
    assert not any(r["resources"] == ["devices"] and "patch" in r["verbs"] for r in watch)


def test_rbac_cluster_wide_mode_needs_no_namespace_rule() -> None:
    roles = rules_by_role(render("clusterWide=true"))
    assert not any(kind == "Role" and name.endswith("-watch") for kind, name in roles)
    scan = roles[("ClusterRole", "devices-ops-scan")]
    assert [r["resources"] for r in scan] == [["customresourcedefinitions"]]
    assert ("ClusterRole", "devices-ops-watch") in roles


@pytest.mark.parametrize("kube_version", ["1.33.0", "1.37.2"])
def test_the_chart_renders_for_every_supported_release(kube_version: str) -> None:
    (pdb,) = by_kind(render(kube_version=kube_version), "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"


def test_the_chart_refuses_a_cluster_older_than_its_range() -> None:
    refused = helm("template", "devices", str(CHART), "--set=database.existingSecret=db",
                   "--kube-version=1.32.9")  # fmt: skip
    assert refused.returncode != 0
    assert "kubeVersion" in refused.stderr and ">=1.33.0-0" in refused.stderr


def test_inline_handlers_are_mounted_from_a_configmap() -> None:
    docs = render("handlers.inline=import kopf_reconcile")
    (config_map,) = by_kind(docs, "ConfigMap")
    assert "import kopf_reconcile" in config_map["data"]["handlers.py"]
    assert operator_pod(docs)["containers"][0]["args"][0] == "/handlers/handlers.py"


def test_chart_metadata_carries_artifact_hub_annotations() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    annotations = chart["annotations"]
    crds = yaml.safe_load(annotations["artifacthub.io/crds"])
    assert [c["name"] for c in crds] == ["devices.example.com"]
    assert yaml.safe_load(annotations["artifacthub.io/crdsExamples"])[0]["kind"] == "Device"
    assert yaml.safe_load(annotations["artifacthub.io/images"])[0]["image"].endswith(
        chart["appVersion"]
    )
    assert annotations["artifacthub.io/license"] == "MIT"


def test_notes_say_how_to_check_the_leaders() -> None:
    result = helm(
        "install",
        "devices",
        str(CHART),
        "--dry-run=client",
        "--namespace=ops",
        "--set=database.existingSecret=db",
    )
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "helm test devices -n ops" in notes
    assert "kubectl reconcile leases -n ops" in notes


# --- the helm test's verdict -----------------------------------------------------------


NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


def lease(holder: str, renewed_ago: float, duration: int = 15) -> dict[str, Any]:
    renewed = NOW - datetime.timedelta(seconds=renewed_ago)
    return {
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": duration,
            "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "leaseTransitions": 2,
        }
    }


@pytest.mark.parametrize(
    ("leases", "healthy", "why"),
    [
        ({"r": lease("pod-a-x1y2", 1)}, True, "held by pod-a-x1y2 at epoch 2"),
        ({"r": None}, False, "no Lease"),
        ({"r": lease("", 1)}, False, "no holder"),
        ({"r": lease("pod-a-x1y2", 60)}, False, "expired"),
        ({"r": lease("pod-gone-x1y2", 1)}, False, "none of the running pods"),
    ],
)
def test_helm_test_verdict(leases: dict[str, Any], healthy: bool, why: str) -> None:
    verdict = judge(["pod-a", "pod-b"], ["r"], leases, NOW)
    assert verdict.healthy is healthy
    assert why in verdict.lines[0]


def test_helm_test_verdict_needs_pods_and_reconcilers() -> None:
    assert not judge([], ["r"], {}, NOW).healthy
    assert not judge(["pod-a"], [], {}, NOW).healthy


# --- the image -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def image_rootfs() -> Iterator[Path]:
    """The root file system of the image ``make image`` built, unpacked once per session."""
    archive = image_archive()
    problem = image_problem()
    if problem is None and (os.geteuid() != 0 or shutil.which("umoci") is None):
        problem = "unpacking and running the image needs root and umoci (`make image` installs it)"
    if problem is not None:
        if IN_CI:
            pytest.fail(f"the image is required under CI=true: {problem}", pytrace=False)
        pytest.skip(problem)
    assert archive is not None
    where = Path(tempfile.mkdtemp(prefix="kopf-reconcile-image-test-"))
    try:
        yield unpack_image(archive, where)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def in_image(rootfs: Path, *argv: str) -> list[str]:
    """``argv`` run in the image's root file system as its user, dying with this process."""
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"  # found here: PATH is the image's
    return dying_with_parent([chroot, f"--userspec={UID}:{UID}", str(rootfs), *argv])


async def run_in_image(rootfs: Path, *argv: str, env: dict[str, str]) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *in_image(rootfs, *argv),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode or 0, out.decode(errors="replace")


def image_env(**extra: str) -> dict[str, str]:
    return {
        "PATH": "/opt/kopf-reconcile/bin:/usr/bin:/bin",
        "HOME": "/home/kopf",
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def test_image_is_configured_as_the_dockerfile_says() -> None:
    archive, problem = image_archive(), image_problem()
    if problem is not None or archive is None:
        if IN_CI:
            pytest.fail(f"the image is required under CI=true: {problem}", pytrace=False)
        pytest.skip(str(problem))
    config: Any = build_image_module().image_config(archive)
    assert config["config"]["User"] == f"{UID}:{UID}"
    assert config["config"]["Entrypoint"] == ["kopf-reconcile", "run"]
    assert config["config"]["Cmd"] == ["/app/handlers.py"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"USER {UID}:{UID}" in dockerfile
    assert 'ENTRYPOINT ["kopf-reconcile", "run"]' in dockerfile
    assert 'CMD ["/app/handlers.py"]' in dockerfile


async def test_image_user_has_a_passwd_entry_kopf_can_use(image_rootfs: Path) -> None:
    code, out = await run_in_image(
        image_rootfs,
        "python",
        "-c",
        "import getpass, kopf; from kopf._core.engines import peering; "
        "print(getpass.getuser(), peering.detect_own_id(manual=False))",
        env=image_env(),
    )
    assert code == 0, out
    assert out.startswith("kopf kopf@"), out
    assert (image_rootfs / "app" / "handlers.py").read_bytes() == (
        ROOT / "operator" / "examples" / "devices.py"
    ).read_bytes()


# --- installed on the real API server, the operator running as its ServiceAccount ------


class Release:
    """The chart installed into a fresh namespace of the real tier, with what it created."""

    def __init__(self, cluster: Any, namespace: str, name: str) -> None:
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.user = f"system:serviceaccount:{namespace}:{name}"

    async def install(self, *settings: str) -> subprocess.CompletedProcess[str]:
        async with self.cluster.http_session() as http:
            await api(http, "POST", "/api/v1/namespaces", {"metadata": {"name": self.namespace}})
            await api(
                http,
                "POST",
                f"/api/v1/namespaces/{self.namespace}/secrets",
                {"metadata": {"name": "db"}, "stringData": {"database-url": "unused"}},
            )
        return await ahelm(
            "install",
            self.name,
            str(CHART),
            f"--namespace={self.namespace}",
            "--set=database.existingSecret=db",
            *(f"--set={s}" for s in settings),
            kubeconfig=self.cluster.kubeconfig,
        )

    async def manifest(self) -> list[dict[str, Any]]:
        result = await ahelm(
            "get",
            "manifest",
            self.name,
            f"--namespace={self.namespace}",
            kubeconfig=self.cluster.kubeconfig,
        )
        assert result.returncode == 0, result.stderr
        return [d for d in yaml.safe_load_all(result.stdout) if d]

    async def token(self, account: str = "") -> str:
        """A token of ``account`` (default: the operator's ServiceAccount)."""
        account = account or self.name
        path = f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token"
        async with self.cluster.http_session() as http:
            answer = await api(http, "POST", path, {"spec": {"expirationSeconds": 3600}})
        return str(answer["status"]["token"])

    async def uninstall(self) -> None:
        await ahelm(
            "uninstall",
            self.name,
            f"--namespace={self.namespace}",
            kubeconfig=self.cluster.kubeconfig,
        )


@pytest_asyncio.fixture(loop_scope="session")
async def release(real_cluster: Any) -> AsyncIterator[Release]:
    made = Release(real_cluster, f"chart-{secrets.token_hex(4)}", "devices")
    try:
        yield made
    finally:
        await made.uninstall()


class Operators:
    """Operators from the image, as the release's ServiceAccount, through a recording proxy."""

    def __init__(
        self, rootfs: Path, release: Release, proxy: RecordingProxy, dsn: str, clusterwide: bool
    ) -> None:
        self.rootfs, self.release, self.proxy = rootfs, release, proxy
        self.dsn, self.clusterwide = dsn, clusterwide
        self.processes: list[OperatorProcess] = []
        self.inside = rootfs / "tmp" / f"run-{secrets.token_hex(3)}"

    async def prepare(self) -> None:
        self.inside.mkdir()
        token = await self.release.token()
        service_account_kubeconfig(
            self.inside / "kubeconfig", self.proxy.url, token, self.release.namespace
        )
        os.chown(self.inside / "kubeconfig", UID, UID)

    def env(self, pod: str) -> dict[str, str]:
        return image_env(
            KUBECONFIG=f"/{self.inside.relative_to(self.rootfs)}/kubeconfig",
            POD_NAME=pod,
            POD_NAMESPACE=self.release.namespace,
            KOPF_RECONCILE_LEADER="kubernetes",
            KOPF_RECONCILE_DATABASE_URL=self.dsn,
            KOPF_RECONCILE_METRICS_HOST="127.0.0.1",
            KOPF_RECONCILE_METRICS_PORT="0",
            KOPF_RECONCILE_LEASE_TTL="5",
            KOPF_RECONCILE_RENEW_INTERVAL="1",
            KOPF_RECONCILE_METRICS_AUTH="kubernetes",  # as the chart sets it
        )

    async def start(self, pod: str) -> OperatorProcess:
        scope = "--all-namespaces" if self.clusterwide else f"--namespace={self.release.namespace}"
        process = OperatorProcess(
            in_image(self.rootfs, "kopf-reconcile", "run", "/app/handlers.py", scope),
            self.env(pod),
            Path(tempfile.gettempdir()) / f"kopf-reconcile-{self.inside.name}-{pod}.log",
        )
        await process.start()
        self.processes.append(process)
        return process

    async def leases_command(self) -> tuple[int, str]:
        return await run_in_image(
            self.rootfs,
            "kopf-reconcile",
            "leases",
            f"--namespace={self.release.namespace}",
            env=self.env("cli"),
        )

    async def stop_all(self) -> None:
        for process in self.processes:
            await process.stop()
            process.log.unlink(missing_ok=True)
        shutil.rmtree(self.inside, ignore_errors=True)


async def readyz(process: OperatorProcess, token: str = "") -> tuple[int, dict[str, Any]]:
    """The status and body of ``/readyz`` (its reason only with a token that may read metrics)."""
    status, body = await scrape(process, "/readyz", token)
    return status, json.loads(body) if status in (200, 503) else {}


async def scrape(process: OperatorProcess, path: str, token: str = "") -> tuple[int, str]:
    match = _SERVING.search(process.output)
    if match is None:
        return 0, ""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{match[1]}{path}", headers=headers) as response,
        ):
            return response.status, await response.text()
    except aiohttp.ClientError:
        return 0, ""


async def device_converged(http: aiohttp.ClientSession, namespace: str, name: str) -> bool:
    path = f"/apis/example.com/v1/namespaces/{namespace}/devices/{name}"
    async with http.get(path) as response:
        body = await response.json()
    status = body.get("status") or {}
    return bool(status.get("observed") == body["spec"]["desired"] and status.get("epoch", 0) >= 1)


async def device_events(
    http: aiohttp.ClientSession, namespace: str, name: str, reason: str
) -> list[dict[str, Any]]:
    found = await api(http, "GET", f"/api/v1/namespaces/{namespace}/events")
    return [
        e
        for e in found["items"]
        if e["involvedObject"].get("name") == name and e["reason"] == reason
    ]


async def create_device(
    http: aiohttp.ClientSession, namespace: str, name: str, desired: str = "on"
) -> None:
    await api(
        http,
        "POST",
        f"/apis/example.com/v1/namespaces/{namespace}/devices",
        {
            "apiVersion": "example.com/v1",
            "kind": "Device",
            "metadata": {"name": name},
            "spec": {"desired": desired},
        },
    )


@pytest.mark.real_apiserver
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("clusterwide", [False, True], ids=["namespaced", "cluster-wide"])
async def test_operator_uses_every_permission_of_the_chart_and_no_other(
    clusterwide: bool,
    release: Release,
    real_cluster: Any,
    image_rootfs: Path,
    embedded_postgres_dsn: str,
) -> None:
    # Helm 4 installs with server-side apply: every object must pass it on the real server.
    installed = await release.install(f"clusterWide={str(clusterwide).lower()}")
    assert installed.returncode == 0, installed.stderr
    assert "STATUS: deployed" in installed.stdout, installed.stdout
    ns = release.namespace
    async with (
        RecordingProxy(real_cluster.url, real_cluster.ca_file) as proxy,
        SocketForwarder(embedded_postgres_dsn) as database,
        real_cluster.http_session() as http,
    ):
        operators = Operators(image_rootfs, release, proxy, database.dsn, clusterwide)
        await operators.prepare()
        try:
            first = await operators.start("devices-0")
            second = await operators.start("devices-1")  # a follower: it watches the Lease
            await create_device(http, ns, "device-1")
            await eventually(
                lambda: device_converged(http, ns, "device-1"),
                timeout=60,
                message="the Device converging",
            )
            # A malformed Device: a DeadLettered Event (create), then, failing again after
            # a change, the same Event counted twice (patch).
            await create_device(http, ns, "device-bad", desired="sideways")

            async def dead_lettered(count: int) -> bool:
                found = await device_events(http, ns, "device-bad", "DeadLettered")
                return len(found) == 1 and found[0]["count"] == count

            await eventually(lambda: dead_lettered(1), timeout=60, message="a DeadLettered Event")
            async with http.patch(
                f"/apis/example.com/v1/namespaces/{ns}/devices/device-bad",
                json={"spec": {"desired": "upside-down"}},
                headers={"Content-Type": "application/merge-patch+json"},
            ) as response:
                assert response.status == 200, await response.text()
            await eventually(
                lambda: dead_lettered(2), timeout=60, message="the DeadLettered Event, counted"
            )
            for process in (first, second):
                await eventually(
                    lambda p=process: _ready(p),
                    timeout=60,  # type: ignore[misc]
                    message="both replicas ready",
                )
            # /metrics: refused without a token, served to the chart's scraper (the operator
            # creates a TokenReview and a SubjectAccessReview).
            assert (await scrape(first, "/metrics"))[0] == 401
            scraper = await release.token(f"{release.name}-metrics-scraper")
            status, text = await scrape(first, "/metrics", scraper)
            assert status == 200 and "# TYPE" in text, text[:500]
            code, out = await operators.leases_command()  # NOTES: `kopf-reconcile leases`
            assert code == 0 and RECONCILER_ID in out, out
        finally:
            await operators.stop_all()  # the leader releases its Lease on the way out
        logs = first.output + second.output
        # (But the fence's coverage probe: a dry-run update of the Lease, impersonating a
        # holder that does not hold it, which the API server must refuse.)
        probes = [r for r in proxy.records if fence_probe(r)]
        assert probes and all(r.status == 403 for r in probes), probes
        forbidden = [r for r in proxy.records if r.status == 403 and not fence_probe(r)]
        assert not forbidden, f"forbidden requests: {forbidden}\n{logs[-3000:]}"
        assert "Not enough permissions" not in logs
        used = {a for a in map(attributes, proxy.records) if a is not None}
        used |= {a for r in proxy.records if r.status < 400 for a in r.impersonation}

        # Take each verb out of each rule in turn: the server must then deny something used.
        await assert_every_verb_is_needed(http, await release.manifest(), ns, release.user, used)


def fence_probe(request: Recorded) -> bool:
    return request.method == "PUT" and "dryRun=" in request.query and bool(request.impersonation)


async def _ready(process: OperatorProcess) -> bool:
    status, _ = await readyz(process)
    return status == 200


@pytest.mark.real_apiserver
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_readyz_is_not_ready_while_a_watch_is_forbidden(
    release: Release, real_cluster: Any, image_rootfs: Path, embedded_postgres_dsn: str
) -> None:
    installed = await release.install()
    assert installed.returncode == 0, installed.stderr
    ns = release.namespace
    path = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/{release.name}-watch"
    async with (
        RecordingProxy(real_cluster.url, real_cluster.ca_file) as proxy,
        SocketForwarder(embedded_postgres_dsn) as database,
        real_cluster.http_session() as http,
    ):
        role = await api(http, "GET", path)
        await api(http, "DELETE", path)  # the Devices may no longer be listed or watched
        operators = Operators(image_rootfs, release, proxy, database.dsn, False)
        await operators.prepare()
        try:
            process = await operators.start("devices-0")

            async def forbidden_reason() -> bool:
                status, body = await readyz(process, real_cluster.admin_token)
                return status == 503 and "forbidden" in str(body.get("reason"))

            await eventually(forbidden_reason, timeout=60, message="/readyz naming the 403")
            assert any(r.status == 403 for r in proxy.records)
            # Allowed again: ready again, and the operator does its work.
            await api(
                http,
                "POST",
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
                {
                    **role,
                    "metadata": {
                        "name": role["metadata"]["name"],
                        "labels": role["metadata"].get("labels"),
                    },
                },
            )
            await eventually(lambda: _ready(process), timeout=60, message="ready once allowed")
            await create_device(http, ns, "device-1")
            await eventually(
                lambda: device_converged(http, ns, "device-1"),
                timeout=60,
                message="the Device converging once allowed",
            )
        finally:
            await operators.stop_all()


async def free_port() -> int:
    from kopf_reconcile.testing.real_apiserver import free_loopback_port

    return free_loopback_port()


@pytest.mark.real_apiserver
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_helm_test_hook_passes_only_while_a_live_leader_holds_the_lease(
    release: Release, real_cluster: Any, image_rootfs: Path, embedded_postgres_dsn: str
) -> None:
    """The hook's program, in the image, with in-cluster credentials of the hook's account.

    No kubelet runs here, so the operator is a process and its pod an object whose status
    says it runs at 127.0.0.1, where that process serves /healthz.
    """
    installed = await release.install()
    assert installed.returncode == 0, installed.stderr
    ns = release.namespace
    hook = await ahelm(
        "template",
        release.name,
        str(CHART),
        f"--namespace={ns}",
        "--set=database.existingSecret=db",
        "--kube-version=1.37.2",
        "--show-only=templates/tests/leases.yaml",
    )
    assert hook.returncode == 0, hook.stderr
    hook_docs = [d for d in yaml.safe_load_all(hook.stdout) if d]
    (hook_pod,) = by_kind(hook_docs, "Pod")
    command = hook_pod["spec"]["containers"][0]["command"]
    port = await free_port()
    async with (
        RecordingProxy(real_cluster.url, real_cluster.ca_file) as proxy,
        SocketForwarder(embedded_postgres_dsn) as database,
        real_cluster.http_session() as http,
    ):
        for doc in hook_docs:  # the hook's account and its Role, as `helm test` creates them
            if doc["kind"] != "Pod":
                plural = {
                    "ServiceAccount": "serviceaccounts",
                    "Role": "roles",
                    "RoleBinding": "rolebindings",
                    "ClusterRoleBinding": "clusterrolebindings",  # to read /healthz reports
                }[doc["kind"]]
                base = (
                    "/api/v1"
                    if doc["kind"] == "ServiceAccount"
                    else ("/apis/rbac.authorization.k8s.io/v1")
                )
                where = "" if doc["kind"] == "ClusterRoleBinding" else f"/namespaces/{ns}"
                await api(http, "POST", f"{base}{where}/{plural}", doc)
        account = hook_pod["spec"]["serviceAccountName"]
        token = await api(
            http,
            "POST",
            f"/api/v1/namespaces/{ns}/serviceaccounts/{account}/token",
            {"spec": {"expirationSeconds": 3600}},
        )
        secrets_dir = image_rootfs / "run" / "secrets" / "kubernetes.io" / "serviceaccount"
        secrets_dir.mkdir(parents=True, exist_ok=True)
        (secrets_dir / "token").write_text(token["status"]["token"])
        shutil.copy(real_cluster.ca_file, secrets_dir / "ca.crt")
        hook_env = image_env(
            KUBERNETES_SERVICE_HOST="127.0.0.1",
            KUBERNETES_SERVICE_PORT=real_cluster.url.rsplit(":", 1)[1],
        )
        check = [*command[:-2], f"--port={port}", "--timeout=5"]
        assert command[-2].startswith("--port=") and command[-1].startswith("--timeout=")

        operators = Operators(image_rootfs, release, proxy, database.dsn, False)
        await operators.prepare()
        try:
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "devices-0",
                    "labels": {
                        "app.kubernetes.io/name": "kopf-reconcile",
                        "app.kubernetes.io/instance": release.name,
                    },
                },
                "spec": {
                    "serviceAccountName": release.name,
                    "automountServiceAccountToken": False,  # no token controller here
                    "containers": [{"name": "operator", "image": "kopf-reconcile"}],
                },
            }
            await api(http, "POST", f"/api/v1/namespaces/{ns}/pods", pod)
            process = OperatorProcess(
                in_image(
                    image_rootfs, "kopf-reconcile", "run", "/app/handlers.py", f"--namespace={ns}"
                ),
                {**operators.env("devices-0"), "KOPF_RECONCILE_METRICS_PORT": str(port)},
                Path(tempfile.gettempdir()) / f"kopf-reconcile-{operators.inside.name}-hook.log",
            )
            operators.processes.append(process)
            await process.start()
            async with http.patch(
                f"/api/v1/namespaces/{ns}/pods/devices-0/status",
                json={"status": {"phase": "Running", "podIP": "127.0.0.1"}},
                headers={"Content-Type": "application/merge-patch+json"},
            ) as response:
                assert response.status == 200, await response.text()
            await eventually(lambda: _ready(process), timeout=60, message="the operator ready")

            code, out = 1, ""

            async def passes() -> bool:
                nonlocal code, out
                code, out = await run_in_image(image_rootfs, *check, env=hook_env)
                return code == 0

            await eventually(passes, timeout=60, interval=1, message="the hook passing")
            assert "ok   " in out and "held by devices-0-" in out, out
            await process.stop()  # the leader leaves and releases its Lease
            code, out = await run_in_image(image_rootfs, *check, env=hook_env)
            assert code == 1, out
            assert "not every reconciler's lease is held" in out, out
        finally:
            await operators.stop_all()
            shutil.rmtree(image_rootfs / "run" / "secrets", ignore_errors=True)


# The default watch entry, with finalizer= declared (a list index replaces the whole list).
FINALIZED = (
    "watch[0].apiGroup=example.com",
    "watch[0].resources={devices}",
    "watch[0].status=true",
    "watch[0].finalizer=true",
)


def test_rbac_follows_declared_children_watches_and_finalizers() -> None:
    assert not any(name.endswith("-related") for _, name in rules_by_role(render()))
    roles = rules_by_role(
        render(
            "related[0].apiGroup=batch",
            "related[0].resources={jobs}",
            "related[0].write=true",
            "related[1].apiGroup=apps",
            "related[1].resources={deployments}",
            *FINALIZED,
        )
    )
    related = roles[("Role", "devices-related")]
    assert related[0] == {
        "apiGroups": ["batch"],
        "resources": ["jobs"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    }
    assert related[1]["resources"] == ["deployments"] and related[1]["verbs"] == ["list", "watch"]
    assert related[2] == {
        "apiGroups": ["example.com"],
        "resources": ["devices"],
        "verbs": ["get", "patch"],
    }
    cluster_wide = rules_by_role(render("clusterWide=true", *FINALIZED))
    assert ("ClusterRole", "devices-ops-related") in cluster_wide
