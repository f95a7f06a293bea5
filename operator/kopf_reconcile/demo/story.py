"""The demo's scenario, scene by scene, and the invariants it checks.

1. Start an embedded cluster, an embedded PostgreSQL and N replicas of the
   example operator (``kopf-reconcile run operator/examples/devices.py``), with
   Kubernetes Lease leader election and fenced writes.
2. Create the Devices and watch them converge; one more Device is malformed
   (``spec.desired: sideways``): its reconcile raises PermanentError, so it gets a
   Warning ``DeadLettered`` Event and a dead letter in PostgreSQL.
3. SIGKILL the leader while Devices change: a follower takes over after the
   lease expires (epoch + 1) and converges them.
4. SIGSTOP the new leader in the middle of its work, past its lease: a third
   replica takes over (epoch + 1). SIGCONT the paused one: its late work is
   refused (by its writer's lease check, or by the database) or cancelled, and
   it steps down. A write at its old epoch sent straight to PostgreSQL is
   rejected by the database.
5. Verify: every Device converged (database state and status equal the
   latest spec: no lost update), and the database's own audit
   (:mod:`kopf_reconcile.testing.audit`) shows no stale write accepted: none
   applied at an epoch below one that had already led the scope, whichever
   Device it targets, nor below one its own Device had already seen. The
   malformed Device's dead letter is still in PostgreSQL after both failovers
   (each new leader loaded it, and counted it again when its resync retried it).

Nothing here is staged: the numbers come from the replicas' /metrics, the
database and the API server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import yaml
from kubernetes_asyncio import client, config

from kopf_reconcile.api import ConfigError
from kopf_reconcile.demo.stack import DemoError, Replica, Stack
from kopf_reconcile.demo.view import View
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.fencing.protocol import StaleEpochError
from kopf_reconcile.fencing.writer import ReconcileLease
from kopf_reconcile.integration.api_client import LazyApiClient
from kopf_reconcile.integration.fence_lease import LeaseFence
from kopf_reconcile.integration.fenced_client import ClientContext, FencedClient, Resource
from kopf_reconcile.integration.tables import format_table
from kopf_reconcile.sharding import shard_id
from kopf_reconcile.testing import api_audit, audit
from kopf_reconcile.testing.examples import find_crd, find_handlers
from kopf_reconcile.testing.fence import install_fence

GROUP, VERSION, PLURAL = "example.com", "v1", "devices"
DEVICES = Resource(GROUP, VERSION, PLURAL)
NAMESPACE = "default"
# The example's reconciler id: its lease name, fence scope and the metrics' controller label.
SCOPE = "devices.example.com-reconcile-device"
STATES = ("on", "off", "standby")
MALFORMED = "device-malformed"  # spec.desired outside STATES: dead-lettered
CONVERGE_TIMEOUT = 90.0
POLL = 0.2
MAX_SHARDS = 64  # a table per shard stays readable


@dataclasses.dataclass
class Options:
    objects: int = 200
    replicas: int = 3
    keep: bool = False
    ttl: int = 3
    work_delay: float = 0.2
    handlers: Path | None = None
    seed: int = 7
    shards: int = 1  # > 1: the sharded story (kopf_reconcile.demo.sharded)


@dataclasses.dataclass
class Summary:
    objects: int = 0
    converged: int = 0
    failovers: list[tuple[str, float, int, int]] = dataclasses.field(default_factory=list)
    # The paused leader's late writes its writer refused: by its own lease check, or
    # on the database's answer (its fenced_writes_total{outcome="stale"}).
    refused_late: int = 0
    cancelled: int = 0
    # Fenced writes that reached PostgreSQL and changed nothing (the audit's count,
    # the direct write included; overlaps refused_late when the database answered it).
    rejected_by_database: int = 0
    # Applied writes that were stale when applied (audit.stale_writes: scope-wide).
    stale_accepted: int = 0
    # API writes (status patches) the API server admitted after a newer term of their
    # Lease, and those its fence refused (api_audit, from its audit log).
    stale_api_accepted: int = 0
    refused_by_api_server: int = 0
    unfenced_api: int = 0  # admitted naming a Lease the API server did not know
    lost_updates: int = 0
    direct_write_rejected: bool = False
    direct_api_write_refused: bool = False
    # The malformed Device: its DeadLettered Event's count, and its dead letter's
    # attempts in PostgreSQL after both failovers (0: gone).
    dead_lettered_events: int = 0
    dead_letter_attempts: int = 0

    def ok(self) -> bool:
        return (
            self.converged == self.objects
            and self.lost_updates == 0
            and self.stale_accepted == 0
            and self.stale_api_accepted == 0
            and self.unfenced_api == 0
            and len(self.failovers) == 2
            and self.direct_write_rejected
            and self.direct_api_write_refused
            and self.dead_lettered_events >= 1
            and self.dead_letter_attempts >= 1
        )


class Demo:
    #: The fence scope whose writes the audit judges; None: every scope of the database
    #: (a sharded reconciler's: one per shard).
    audited_scope: str | None = SCOPE

    def __init__(self, options: Options, view: View) -> None:
        if options.objects < 1:
            raise ConfigError(f"--objects must be >= 1, got {options.objects}")
        if options.replicas < 3:
            raise ConfigError(
                f"--replicas must be >= 3 (a leader to kill, one to pause, one to take over), "
                f"got {options.replicas}"
            )
        if options.ttl < 1:
            raise ConfigError(f"--ttl must be a whole number of seconds >= 1, got {options.ttl}")
        if not 1 <= options.shards <= MAX_SHARDS:
            raise ConfigError(f"--shards must be from 1 to {MAX_SHARDS}, got {options.shards}")
        self.options = options
        self.view = view
        self.handlers = find_handlers(options.handlers)
        self.crd = find_crd(self.handlers)
        self.rng = random.Random(options.seed)
        self.desired: dict[str, str] = {}
        self.summary = Summary(objects=options.objects)
        self.stack = Stack(keep=options.keep, reconciler=SCOPE)
        self._api: client.ApiClient | None = None
        self._db: asyncpg.Pool | None = None

    # -- the scenes --------------------------------------------------------------

    async def run(self) -> Summary:
        async with self.stack:
            try:
                await self._scenes()
            finally:
                if self._api is not None:
                    await self._api.close()
                if self._db is not None:
                    await self._db.close()
                if self.options.keep:
                    self.view.note(f"kept {self.stack.workdir} (logs, kubeconfig)")
        return self.summary

    def summary_lines(self, summary: Summary) -> list[str]:
        """The story's summary table and verdict."""
        times = "; ".join(
            f"{kind}: {seconds:.2f}s (epoch {old} -> {new})"
            for kind, seconds, old, new in summary.failovers
        )
        rows = [
            ("objects", summary.objects, ""),
            ("converged", summary.converged, "must equal objects"),
            ("failovers", len(summary.failovers), times),
            ("late writes refused", summary.refused_late,
             "by the paused leader (its lease check, or the database's answer)"),
            ("rejected by the database", summary.rejected_by_database,
             "reached PostgreSQL, changed nothing (the direct write included)"),
            ("late reconciles cancelled", summary.cancelled, "by the lost lease"),
            ("stale writes accepted", summary.stale_accepted,
             "must be 0 (none below an epoch that led the scope)"),
            ("refused by the API server", summary.refused_by_api_server,
             "late status patches its fence refused (the API server's audit log)"),
            ("stale API writes accepted", summary.stale_api_accepted,
             "must be 0 (none admitted after a newer term of its Lease)"),
            ("API writes unfenced", summary.unfenced_api,
             "must be 0 (each named a Lease the API server knew)"),
            ("lost updates", summary.lost_updates, "must be 0"),
            ("dead-lettered events", summary.dead_lettered_events,
             "the malformed Device's Warning DeadLettered Event (its count)"),
            ("dead letter attempts", summary.dead_letter_attempts,
             "its dead letter in PostgreSQL after both failovers (must be >= 1)"),
        ]  # fmt: skip
        lines = format_table(("", "value", "note"), rows)
        verdict = "every invariant held" if summary.ok() else "AN INVARIANT WAS BROKEN"
        return [*lines, "", verdict]

    def ok(self) -> bool:
        """Every invariant of the story held."""
        return self.summary.ok()

    async def _scenes(self) -> None:
        await self._start()
        await self._create_devices()
        await self._malformed_device()
        await self._kill_the_leader()
        await self._pause_the_leader()
        await self._verify()
        await self._show_leases()
        await self._show_dead_letters()

    async def _start(self) -> None:
        url = await self.stack.start_cluster()
        self.view.note(f"embedded Kubernetes API at {url}")
        dsn = await self.stack.start_postgres()
        self.view.note("embedded PostgreSQL started")
        await config.load_kube_config(config_file=str(self.stack.kubeconfig))
        self._api = client.ApiClient()
        crd = yaml.safe_load(self.crd.read_text())
        await client.ApiextensionsV1Api(self._api).create_custom_resource_definition(crd)
        # The API server's fence, as the chart installs it: late API writes are refused.
        async with aiohttp.ClientSession(base_url=url) as http:
            await install_fence(http, NAMESPACE, name="demo")
        async with PostgresFencedRepository(dsn, scope=SCOPE) as repository:
            await repository.migrate()
        await audit.install(dsn)
        self._db = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
        env = {
            "KOPF_RECONCILE_DATABASE_URL": dsn,
            "KOPF_RECONCILE_LEADER": "kubernetes",
            "POD_NAMESPACE": NAMESPACE,
            "KOPF_RECONCILE_LEASE_TTL": str(self.options.ttl),
            "KOPF_RECONCILE_RENEW_INTERVAL": str(round(self.options.ttl / 10, 3)),
            "DEVICES_WORK_DELAY": str(self.options.work_delay),
            "DEVICES_SHARDS": str(self.options.shards),
        }
        replicas = [
            await self.stack.start_replica(self.handlers, env) for _ in range(self.options.replicas)
        ]
        await asyncio.gather(*(self.stack.wait_ready(r) for r in replicas))
        self.view.note(
            f"{len(replicas)} replicas of {self.handlers.name} running "
            f"(lease TTL {self.options.ttl}s, Kubernetes Lease election, fenced PostgreSQL)"
        )
        await self._elected()

    async def _elected(self) -> None:
        await self._until(lambda: self._leader() is not None, "electing a leader", 30)
        leader = self._leader()
        assert leader is not None
        self.view.note(f"{leader.name} leads at epoch {leader.last.epoch}")

    async def _create_devices(self) -> None:
        names = [f"device-{i:03d}" for i in range(self.options.objects)]
        api = client.CustomObjectsApi(self._api)
        limit = asyncio.Semaphore(16)

        async def create(name: str) -> None:
            desired = self.rng.choice(STATES)
            body = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "Device",
                "metadata": {"name": name},
                "spec": {"desired": desired},
            }
            async with limit:
                await api.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)
            self.desired[f"{NAMESPACE}/{name}"] = desired

        started = time.monotonic()
        await asyncio.gather(*(create(n) for n in names))
        self.view.note(f"created {len(names)} Devices")
        await self._until_converged("converging")
        self.view.note(f"all {len(names)} Devices converged in {time.monotonic() - started:.1f}s")

    async def _malformed_device(self) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Device",
            "metadata": {"name": MALFORMED},
            "spec": {"desired": "sideways"},
        }
        api = client.CustomObjectsApi(self._api)
        await api.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)
        self.view.note(f"created {MALFORMED} with spec.desired 'sideways' (not a power state)")
        events: list[Any] = []

        async def dead_lettered() -> bool:
            events[:] = await self._events_of(MALFORMED)
            return any(e.reason == "DeadLettered" for e in events)

        await self._until_async(dead_lettered, f"a DeadLettered Event on {MALFORMED}", 30)
        self.summary.dead_lettered_events = max(
            e.count or 1 for e in events if e.reason == "DeadLettered"
        )
        self.view.block(
            f"$ kubectl describe device {MALFORMED}   (its Events)",
            [f"{e.type:<8} {e.reason:<13} x{e.count or 1:<3} {e.message}" for e in events],
        )
        await self._until_async(self._dead_letters, "its dead letter in PostgreSQL", 30)
        out = await _output(sys.executable, "-m", "kopf_reconcile", "dead-letters",
                            env={"KOPF_RECONCILE_DATABASE_URL": self.stack.dsn})  # fmt: skip
        self.view.block("$ kopf-reconcile dead-letters", out.splitlines())

    async def _events_of(self, name: str) -> list[Any]:
        listing = await client.CoreV1Api(self._api).list_namespaced_event(NAMESPACE)
        return [e for e in listing.items if e.involved_object.name == name]

    async def _dead_letters(self) -> int:
        """The attempts of the malformed Device's dead letter in PostgreSQL (0: none)."""
        async with PostgresFencedRepository(self.stack.dsn, scope=SCOPE) as repository:
            letters = await repository.list_dead_letters(scope=SCOPE)
        return sum(d.attempts for d in letters if d.entity_id == f"{NAMESPACE}/{MALFORMED}")

    async def _show_dead_letters(self) -> None:
        self.summary.dead_letter_attempts = await self._dead_letters()
        env = {"KOPF_RECONCILE_DATABASE_URL": self.stack.dsn}
        out = await _output(sys.executable, "-m", "kopf_reconcile", "dead-letters", env=env)
        self.view.block(
            "$ kopf-reconcile dead-letters   (after two failovers: each new leader knew it)",
            out.splitlines(),
        )
        out = await _output(sys.executable, "-m", "kopf_reconcile", "status",
                            f"--kubeconfig={self.stack.kubeconfig}", "-n", NAMESPACE,
                            env=env)  # fmt: skip
        self.view.block(f"$ kopf-reconcile status -n {NAMESPACE}", out.splitlines())
        events = await self._events_of(MALFORMED)
        self.view.block(
            f"$ kubectl describe device {MALFORMED}   (its Events, aggregated)",
            [f"{e.type:<8} {e.reason:<13} x{e.count or 1:<3} {e.message}" for e in events],
        )

    async def _kill_the_leader(self) -> None:
        leader = self._leader()
        assert leader is not None
        old = leader.last.epoch
        self.view.note(f"SIGKILL {leader.name} (pid {leader.pid}), the leader at epoch {old}")
        killed_at = time.monotonic()
        self.stack.kill(leader)
        await self._flip(max(1, self.options.objects // 10))
        await self._failover("SIGKILL", old, killed_at)
        await self._until_converged("converging under the new leader")

    async def _pause_the_leader(self) -> None:
        leader = self._leader()
        assert leader is not None
        old = leader.last.epoch
        await self._flip(max(1, self.options.objects // 5))
        await self._until(lambda: leader.last.in_flight > 0, f"{leader.name} is working", 10)
        before = dataclasses.replace(leader.last)
        old_holder = await self._lease_holder()
        self.view.note(
            f"SIGSTOP {leader.name} (pid {leader.pid}), the leader at epoch {old}, "
            f"in the middle of {leader.last.in_flight} reconcile(s)"
        )
        paused_at = time.monotonic()
        self.stack.pause(leader)
        await self._failover("SIGSTOP past the TTL", old, paused_at)
        await self._until_converged("converging under the third leader")
        self.view.note(f"SIGCONT {leader.name}: it wakes up believing it leads at epoch {old}")
        self.stack.resume(leader)
        await self._until(
            lambda: (
                not leader.last.leader
                and (leader.last.stale > before.stale or leader.last.canceled > before.canceled)
            ),
            f"{leader.name} notices it lost the lease",
            self.options.ttl * 3 + 10,
        )
        await asyncio.sleep(1.0)  # let its last refusals reach the metrics
        await self.stack.scrape(leader)
        self.summary.refused_late = leader.last.stale - before.stale
        self.summary.cancelled = leader.last.canceled - before.canceled
        self.view.note(
            f"{leader.name} stepped down: {self.summary.refused_late} late write(s) refused "
            f"(its lease check or the database), {self.summary.cancelled} reconcile(s) "
            f"cancelled, none applied"
        )
        # The database is the real guard: a write at the old epoch to a Device the new
        # leader has written must be rejected there (its epoch is below the row's
        # last_epoch, and below the epoch recorded as leading the scope).
        assert self._db is not None
        entity = await self._db.fetchval(
            "SELECT entity_id FROM kopf_reconcile_fence "
            "WHERE scope = $1 AND last_epoch > $2 "
            "ORDER BY entity_id LIMIT 1",
            SCOPE,
            old,
        )
        async with PostgresFencedRepository(self.stack.dsn, scope=SCOPE) as repository:
            accepted = await repository.apply_fenced(entity, old, {"desired": "zombie"})
        self.summary.direct_write_rejected = not accepted
        verdict = "REJECTED by the database" if not accepted else "ACCEPTED (fencing is broken!)"
        self.view.note(f"a write to {entity} at epoch {old}, straight to PostgreSQL: {verdict}")
        # So is the API server: the same Device's status patch, sent as the paused leader's
        # fenced client sends it (its Lease, holder and old epoch), is refused there.
        self.summary.direct_api_write_refused = await self._api_write_refused(
            entity, old, old_holder
        )
        verdict = (
            "REFUSED by the API server"
            if self.summary.direct_api_write_refused
            else "ADMITTED (the API fence is broken!)"
        )
        self.view.note(f"a status patch of {entity} at epoch {old}, to the API: {verdict}")

    async def _lease_holder(self) -> str:
        assert self._api is not None
        lease = await client.CoordinationV1Api(self._api).read_namespaced_lease(SCOPE, NAMESPACE)
        return str(lease.spec.holder_identity)

    async def _api_write_refused(self, entity: str, epoch: int, holder: str) -> bool:
        assert self._api is not None

        async def namespace() -> str:
            return NAMESPACE

        source = LazyApiClient(self._api)
        lease = ReconcileLease(epoch, lambda _: True, lease_id=SCOPE, holder=holder)
        fenced = FencedClient(
            ClientContext(source, field_manager="demo", fence=LeaseFence(source, namespace)), lease
        )
        name = entity.split("/", 1)[1]
        try:
            await fenced.patch_status(DEVICES, name, {"observed": "zombie"}, namespace=NAMESPACE)
        except StaleEpochError:
            return True
        return False

    async def _verify(self) -> None:
        await self._until_converged("final convergence", strict=False)
        states = await self._states()
        api = client.CustomObjectsApi(self._api)
        listing = await api.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
        observed = {
            f"{NAMESPACE}/{o['metadata']['name']}": (o.get("status") or {}).get("observed")
            for o in listing["items"]
        }
        lost = [
            e
            for e, want in self.desired.items()
            if states.get(e, {}).get("desired") != want or observed.get(e) != want
        ]
        self.summary.converged = self.summary.objects - len(lost)
        self.summary.lost_updates = len(lost)
        # Scope-wide: a late write at an old epoch is stale even on a Device the newer
        # leader never wrote (a per-entity comparison would miss it).
        history = await audit.history(self.stack.dsn, scope=self.audited_scope)
        self.summary.stale_accepted = len(audit.stale_writes(history))
        self.summary.rejected_by_database = len(await audit.rejected_writes(self.stack.dsn))
        self.summary.stale_api_accepted = len(api_audit.stale_api_writes(self.stack.audit_log))
        self.summary.refused_by_api_server = len(api_audit.refused_api_writes(self.stack.audit_log))

    async def _show_leases(self) -> None:
        kubeconfig = str(self.stack.kubeconfig)
        kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which(
            "kubectl"
        )
        if kubectl is None:
            self.view.block("kubectl get leases", ["(kubectl not installed: skipped)"])
        else:
            out = await _output(kubectl, f"--kubeconfig={kubeconfig}", "get", "leases", "-n",
                                NAMESPACE)  # fmt: skip
            self.view.block(f"$ kubectl get leases -n {NAMESPACE}", out.splitlines())
        out = await _output(sys.executable, "-m", "kopf_reconcile", "leases",
                            f"--kubeconfig={kubeconfig}", "-n", NAMESPACE)  # fmt: skip
        self.view.block(f"$ kopf-reconcile leases -n {NAMESPACE}", out.splitlines())

    # -- helpers -----------------------------------------------------------------

    def _leader(self) -> Replica | None:
        leaders = [r for r in self.stack.replicas if r.state == "running" and r.last.leader]
        return max(leaders, key=lambda r: r.last.epoch) if leaders else None

    async def _flip(self, count: int) -> None:
        """Change the desired state of ``count`` Devices (work for whoever leads)."""
        api = client.CustomObjectsApi(self._api)
        for entity in self.rng.sample(sorted(self.desired), count):
            desired = self.rng.choice([s for s in STATES if s != self.desired[entity]])
            name = entity.split("/", 1)[1]
            patch = [{"op": "replace", "path": "/spec/desired", "value": desired}]
            await api.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name, patch)
            self.desired[entity] = desired
        self.view.note(f"changed spec.desired of {count} Devices")

    async def _failover(self, kind: str, old_epoch: int, since: float) -> None:
        """Wait for a new leader's first accepted write at a higher epoch; record the time."""

        async def written_by_new_leader() -> bool:
            assert self._db is not None
            count = await self._db.fetchval(
                "SELECT count(*) FROM kopf_reconcile_fence WHERE scope = $1 AND last_epoch > $2",
                SCOPE,
                old_epoch,
            )
            return bool(count)

        await self._until_async(
            written_by_new_leader, f"waiting for a new leader ({kind})", self.options.ttl * 4 + 20
        )
        took = time.monotonic() - since
        leader = self._leader()
        new_epoch = leader.last.epoch if leader else old_epoch + 1
        self.summary.failovers.append((kind, took, old_epoch, new_epoch))
        who = leader.name if leader else "a replica"
        self.view.note(
            f"{who} took over at epoch {new_epoch}; first write {took:.2f}s after the {kind}"
        )

    async def _states(self) -> dict[str, dict[str, Any]]:
        assert self._db is not None
        # The reconciler's scope, and its shards' when it is sharded.
        scopes = [SCOPE, *(shard_id(SCOPE, k) for k in range(self.options.shards))]
        rows = await self._db.fetch(
            "SELECT entity_id, state::text FROM kopf_reconcile_fence WHERE scope = ANY($1)",
            scopes,
        )
        return {r["entity_id"]: json.loads(r["state"] or "{}") for r in rows}

    async def _converged(self) -> int:
        states = await self._states()
        return sum(
            1 for e, want in self.desired.items() if states.get(e, {}).get("desired") == want
        )

    async def _until_converged(self, what: str, strict: bool = True) -> None:
        total = len(self.desired)
        converged = 0

        async def done() -> bool:
            nonlocal converged
            converged = await self._converged()
            return converged == total

        try:
            await self._until_async(
                done, what, CONVERGE_TIMEOUT, lambda: f"{what}: {converged}/{total} converged"
            )
        except DemoError:
            if strict:
                raise

    async def _until(self, condition: Callable[[], bool], what: str, timeout: float) -> None:
        async def check() -> bool:
            return condition()

        await self._until_async(check, what, timeout)

    async def _until_async(
        self,
        condition: Callable[[], Any],
        what: str,
        timeout: float,
        status: Callable[[], str] | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for replica in self.stack.replicas:
                await self.stack.scrape(replica)
            if await condition():
                self.view.update(status() if status else what, self.stack.replicas)
                return
            self.view.update(status() if status else what, self.stack.replicas)
            if time.monotonic() > deadline:
                raise DemoError(f"timed out after {timeout:.0f}s: {what}")
            await asyncio.sleep(POLL)


async def _output(*command: str, env: dict[str, str] | None = None) -> str:
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=None if env is None else {**os.environ, **env},
    )
    out, _ = await process.communicate()
    return out.decode(errors="replace").rstrip()
