"""The checks of a chaos run, once everything is healed and no spec changes any more.

* no stale write accepted: :func:`audit.stale_writes` over the database's own history of
  writes applied and epochs that led the scope, and no zombie write answered "applied";
* at most one effective leader at any instant, from the replicas' own monotonic-stamped
  leadership reports (:mod:`.leadership`); never two replicas inside a reconcile of one
  entity at once (:mod:`.reconciles`); no epoch led by two holders; every epoch that led
  recorded in the fence first, none below the leadership before it, and the lease record
  not below the highest;
* no lost update: every Device's fenced state and status reach its final
  ``spec.desired`` (and generation) within ``converge_timeout``.

Sharded, every invariant is checked per shard scope.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time

import aiohttp
import asyncpg

from kopf_reconcile.leader.timing import RENEW_DEADLINE_FRACTION
from kopf_reconcile.testing import api_audit, audit
from kopf_reconcile.testing.chaos.leadership import (
    Leadership,
    epochs_led_twice,
    intervals,
    max_overlap,
    read_events,
)
from kopf_reconcile.testing.chaos.reconciles import Span, overlaps, spans
from kopf_reconcile.testing.chaos.stage import (
    ALL_DEVICES_PATH,
    HTTP_TIMEOUT,
    NAMESPACE,
    PAUSE_GRACE,
    START_TIMEOUT,
    ChaosError,
    Stage,
)

# What a replica logs when its watch starts carrying the shards it leads (shard_watch).
NARROWED_WATCH = "carries shards"


class Checks(Stage):
    """Quiescing (heal, then wait for convergence) and the invariants of the run."""

    async def _quiesce(self) -> None:
        for slot in self.slots:
            slot.proxy.heal()
        with contextlib.suppress(ChaosError, aiohttp.ClientError, OSError, TimeoutError):
            await self._api("DELETE", "/_embedded/faults")
        await self._until(
            lambda: all(s.alive for s in self.slots if not s.standby),
            "every replica up",
            START_TIMEOUT,
        )
        started = time.monotonic()
        converged = 0

        async def done() -> bool:
            nonlocal converged
            lost = await self._unconverged()
            converged = self.options.devices - len(lost)
            self.report.lost_updates = lost
            return not lost

        try:
            await self._until_async(done, "convergence", self.options.converge_timeout)
        except ChaosError:
            self.say(f"NOT converged: {converged}/{self.options.devices} Devices")
            return
        self.report.converged_in = time.monotonic() - started
        self.say(
            f"all {self.options.devices} Devices converged "
            f"{self.report.converged_in:.1f}s after quiescing"
        )

    async def _check(self) -> None:
        deadline = self.options.ttl * RENEW_DEADLINE_FRACTION
        for scope in self.scopes:
            await self._check_scope(scope, deadline)
        self.report.stale_rejected = len(await audit.rejected_writes(self.dsn))
        # The API server's own record of the Devices' status patches (its audit log).
        self.report.api_writes_refused = len(api_audit.refused_api_writes(self.audit_log))
        self.report.stale_api_accepted = [
            str(w) for w in api_audit.stale_api_writes(self.audit_log)
        ]
        self.report.unfenced_api = [str(w) for w in api_audit.unfenced_api_writes(self.audit_log)]
        writes = api_audit.api_writes(self.audit_log)
        self.report.api_writes_admitted = sum(1 for w in writes if w.admitted)
        inside: list[Span] = []
        for process in self.histories:
            inside += spans(process, deadline, PAUSE_GRACE)
            self.report.handoffs += sum(
                1 for e in read_events(process.events) if e["event"] == "handoff"
            )
        self.report.reconciles = len(inside)
        self.report.reconcile_overlaps = overlaps(inside, self._origin)
        # By namespace: how often a replica's watch started again for the shards it led.
        self.report.narrowed_watches = sum(
            log.read_text(errors="replace").count(NARROWED_WATCH)
            for log in self.workdir.glob("replica-*.log")
        )

    async def _check_scope(self, scope: str, deadline: float) -> None:
        """The invariants of one fencing scope and its lease (one shard's, when sharded)."""
        report = self.report
        history = await audit.history(self.dsn, scope=scope)
        report.writes_accepted += sum(1 for e in history if isinstance(e, audit.Applied))
        # Epoch 0 is the scope's row as the migration creates it: nothing led at 0.
        report.epochs_led += len(
            {e.epoch for e in history if isinstance(e, audit.Led) and e.epoch > 0}
        )
        report.highest_led[scope] = max(
            (e.epoch for e in history if isinstance(e, audit.Led)), default=0
        )
        report.lease_epochs[scope] = await self._lease_epoch(scope)
        report.stale_accepted += [str(w) for w in audit.stale_writes(history)]
        leaderships: list[Leadership] = []
        for process in self.histories:
            leaderships += intervals(process, scope, deadline, PAUSE_GRACE)
        report.leaderships += len(leaderships)
        believed, _ = max_overlap(leaderships, effective=False)
        effective, witnesses = max_overlap(leaderships, effective=True)
        report.max_leaders_believed = max(report.max_leaders_believed, believed)
        report.max_leaders = max(report.max_leaders, effective)
        if effective > 1:
            report.overlap += [f"{scope}: {w.describe(self._origin)}" for w in witnesses]
        if twice := epochs_led_twice(leaderships):
            report.epochs_led_twice[scope] = twice
        recorded = {e.epoch for e in history if isinstance(e, audit.Led)}
        if unrecorded := sorted({x.epoch for x in leaderships} - recorded):
            report.unrecorded[scope] = unrecorded
        # A leadership that began on waking from a pause and ended at once is left out
        # (its process stopped between winning the lease and leading: see leadership.py).
        # One holder may lead again at its own epoch (it stepped down, then took back the
        # lease that still named it: no change of holder, no new epoch); two holders at
        # one epoch are epochs_led_twice.
        ordered = sorted(
            (x for x in leaderships if x.effective_end > x.start), key=lambda x: x.start
        )
        if reversed_epochs := [
            (before.epoch, after.epoch)
            for before, after in itertools.pairwise(ordered)
            if after.epoch < before.epoch
        ]:
            report.reversed_epochs[scope] = reversed_epochs

    async def _lease_epoch(self, scope: str) -> int | None:
        """The epoch ``scope``'s lease record holds (a Lease's ``leaseTransitions``, or a row's)."""
        if self.options.elector == "postgres":
            connection = await asyncpg.connect(self.dsn, timeout=HTTP_TIMEOUT)
            try:
                epoch = await connection.fetchval(
                    "SELECT epoch FROM kopf_reconcile_lease WHERE reconciler_id = $1", scope
                )
            finally:
                await connection.close()
            return None if epoch is None else int(epoch)
        path = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{scope}"
        lease = await self._api("GET", path)
        transitions = lease.get("spec", {}).get("leaseTransitions")
        return None if transitions is None else int(transitions)

    async def _all_converged(self) -> bool:
        return not await self._unconverged()

    async def _unconverged(self) -> list[str]:
        """Devices whose fenced state or status does not match their spec (and generation)."""
        try:
            listing = await self._api("GET", ALL_DEVICES_PATH)
            connection = await asyncpg.connect(self.dsn, timeout=HTTP_TIMEOUT)
        except (ChaosError, aiohttp.ClientError, OSError, asyncpg.PostgresError, TimeoutError):
            return ["(API or database not reachable)"]
        try:
            rows = await connection.fetch(
                "SELECT scope, entity_id, state::text FROM kopf_reconcile_fence "
                "WHERE scope = ANY($1::text[])",
                list(self.scopes),
            )
        finally:
            await connection.close()
        states = {(r["scope"], r["entity_id"]): json.loads(r["state"] or "{}") for r in rows}
        lost = []
        for item in listing["items"]:
            entity = f"{item['metadata']['namespace']}/{item['metadata']['name']}"
            want, generation = item["spec"]["desired"], item["metadata"]["generation"]
            status = item.get("status") or {}
            state = states.get((self._scope_of(entity), entity)) or {}
            if (
                state.get("desired") != want
                or state.get("generation") != generation
                or status.get("observed") != want
                or status.get("observedGeneration") != generation
            ):
                lost.append(
                    f"{entity}: spec {want}@{generation}, fenced {state.get('desired')}@"
                    f"{state.get('generation')}, status {status.get('observed')}@"
                    f"{status.get('observedGeneration')}"
                )
        return lost
