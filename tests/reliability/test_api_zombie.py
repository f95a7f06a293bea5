"""A zombie leader's late API writes are refused by the API server: real processes, both tiers.

Two replica processes (``replica.py --api-namespace``) contend for a Kubernetes Lease and
write to the Kubernetes API through their fenced client. The leader, A, is paused (SIGSTOP)
in the middle of its writes: four of them (a status patch, a child's creation, an update, a
deletion) past the client's local check, none sent. Past A's lease, B takes over and
writes. When A resumes (SIGCONT) the writes go out with the old epoch; the fence (a
ValidatingAdmissionPolicy over the namespace's Leases, installed as the chart installs it)
refuses each of them, and the objects show only B's work; the API server's audit log shows
no stale write. With the policy's binding left out the late write is admitted, and the
audit finds it: the API server, not the replica, is the guard.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from fleet import Event, first_event, replicas

from kopf_reconcile.control.holding import ACQUIRE_RETRY_JITTER
from kopf_reconcile.integration import fence_policy
from kopf_reconcile.testing import api_audit
from support import CRDS, eventually, gadget_crd, install_crd

pytestmark = pytest.mark.slow

TTL, RENEW = 2.0, 0.2
TAKEOVER_BOUND = TTL + 2 * RENEW * ACQUIRE_RETRY_JITTER + 5
STARTUP = 30.0
ADMISSION = "/apis/admissionregistration.k8s.io/v1"


def is_stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] == "T"


def event_is(name: str, **fields: object) -> Callable[[Event], bool]:
    def matches(event: Event) -> bool:
        return event["event"] == name and all(event[k] == v for k, v in fields.items())

    return matches


@pytest_asyncio.fixture
async def gadgets(kube: Any) -> AsyncIterator[str]:
    group = f"g{uuid.uuid4().hex[:8]}.example.com"
    crd = gadget_crd(group)
    crd["spec"]["versions"][0]["subresources"] = {"status": {}}
    async with kube.http_session() as http:
        await install_crd(http, crd)
        yield group
        await http.delete(f"{CRDS}/gadgets.{group}")


async def call(http: Any, method: str, path: str, body: object = None, **headers: str) -> Any:
    async with http.request(method, path, json=body, headers=headers) as response:
        assert response.status < 300, await response.text()
        return await response.json()


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(("all", True), id="status-create-update-delete"),
        pytest.param(("status", False), id="status-without-the-policy"),
    ],
)
async def test_a_paused_leaders_late_api_write_is_refused_by_the_api_server(
    kube: Any, kube_namespace: str, kube_audit_log: Path, gadgets: str, case: tuple[str, bool]
) -> None:
    late, fenced = case
    start = api_audit.log_size(kube_audit_log)  # a real tier's log is shared: read from here
    ns = kube_namespace
    name = f"fence-{ns}"
    async with kube.http_session() as http:
        if fenced:
            await call(
                http, "POST", f"{ADMISSION}/validatingadmissionpolicies", fence_policy.policy(name)
            )
            await call(
                http,
                "POST",
                f"{ADMISSION}/validatingadmissionpolicybindings",
                fence_policy.binding(name, name, ns),
            )
        gadget = {"apiVersion": f"{gadgets}/v1", "kind": "Gadget", "metadata": {"name": "work"}}
        await call(http, "POST", f"/apis/{gadgets}/v1/namespaces/{ns}/gadgets", gadget)
        for configmap in ("work", "victim"):
            await call(
                http,
                "POST",
                f"/api/v1/namespaces/{ns}/configmaps",
                {"metadata": {"name": configmap}},
            )
        args = ["--elector", "kubernetes", "--kubeconfig", kube.kubeconfig, "--namespace", ns]
        options = (
            "--ttl",
            str(TTL),
            "--renew",
            str(RENEW),
            "--api-namespace",
            ns,
            "--late",
            late,
            "--gadgets",
            gadgets,
        )
        try:
            async with replicas(args, 2, *options) as group:
                a, leading = await first_event(group, event_is("leader"), STARTUP)
                [b] = [replica for replica in group if replica is not a]
                epoch = leading["epoch"]
                await a.wait_for(event_is("wrote", epoch=epoch), STARTUP)
                a.signal(signal.SIGUSR1)  # pause inside the next write
                await a.wait_for(event_is("pausing"), 5)
                try:
                    await eventually(lambda: is_stopped(a.pid), message="A stops inside its write")
                    await b.wait_for(event_is("leader", epoch=epoch + 1), TAKEOVER_BOUND)
                    await b.wait_for(event_is("wrote", epoch=epoch + 1), 10)
                    resumed_from = len(a.events)
                finally:
                    a.signal(signal.SIGCONT)
                kinds = ["status", "create", "update", "delete"] if late == "all" else [late]
                answers = {}
                for kind in kinds:
                    answers[kind] = await a.wait_for(
                        event_is("answered", kind=kind), 10, after=resumed_from
                    )
        finally:
            if fenced:
                await http.delete(f"{ADMISSION}/validatingadmissionpolicybindings/{name}")
                await http.delete(f"{ADMISSION}/validatingadmissionpolicies/{name}")

        work = await call(http, "GET", f"/api/v1/namespaces/{ns}/configmaps/work")
        gadget = await call(http, "GET", f"/apis/{gadgets}/v1/namespaces/{ns}/gadgets/work")
        async with http.get(f"/api/v1/namespaces/{ns}/configmaps/late") as response:
            late_exists = response.status == 200
        async with http.get(f"/api/v1/namespaces/{ns}/configmaps/victim") as response:
            victim_exists = response.status == 200
        applied = {
            "status": (gadget.get("status") or {}).get("late") is True,
            "create": late_exists,
            "update": (work.get("data") or {}).get("late") == "yes",
            "delete": not victim_exists,
        }
    # The API server's own record: only this test's Lease counts (a real tier's log is shared).
    lease = f"{ns}/devices"

    async def logged() -> bool:  # the log is written as requests complete
        return any(w.lease == lease and w.epoch == epoch for w in late_writes())

    def late_writes() -> list[api_audit.ApiWrite]:
        after_b = [w for w in api_audit.api_writes(kube_audit_log, start) if w.lease == lease]
        first_b = next(w.seq for w in after_b if w.epoch == epoch + 1)
        return [w for w in after_b if w.epoch == epoch and w.seq > first_b]

    async def all_logged() -> bool:
        return len(late_writes()) >= len(kinds)

    await eventually(logged, interval=0.2, message="the late write in the audit log")
    await eventually(all_logged, interval=0.2, message="every late write in the audit log")
    stale = [w for w in api_audit.stale_api_writes(kube_audit_log, start) if w.lease == lease]
    if not fenced:
        assert all(answer["accepted"] for answer in answers.values()), answers
        assert all(applied[kind] for kind in kinds), "without the policy the late writes land"
        assert stale and all(w.epoch == epoch for w in stale), stale  # and the audit sees it
        return
    assert stale == []
    assert [w.code for w in late_writes()] == [403] * len(kinds)
    for answer in answers.values():
        assert not answer["accepted"], answer
        assert "stale write refused by the kopf-reconcile fence" in answer["reason"], answer
        assert f"now at epoch {epoch + 1} held by {b.events[0]['holder']}" in answer["reason"]
    assert not any(applied.values()), applied
    assert work["data"]["epoch"] == str(epoch + 1)  # B's work, never A's after it
