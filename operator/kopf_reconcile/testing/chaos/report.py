"""What a chaos run is asked to do (:class:`Options`), and what it found (:class:`Report`):
the counts of the nemesis' actions, the measures of the checks, every violation."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path


@dataclasses.dataclass
class Options:
    seed: int = 1
    duration: float = 60.0
    replicas: int = 3
    elector: str = "kubernetes"
    tier: str = "embedded"  # or "real": the real kube-apiserver with etcd (RealCluster)
    devices: int = 200
    changes_per_second: float = 10.0
    ttl: int = 3
    renew_interval: float = 0.3
    work_delay: float = 0.05
    converge_timeout: float = 120.0
    keep: bool = False
    handlers: Path | None = None
    shards: int = 1  # > 1: the example runs sharded; replicas also join and leave
    # Sharded by namespace: the Devices in one namespace per shard, each replica watching
    # only the shards it leads (a takeover lists its shard first).
    by_namespace: bool = False


@dataclasses.dataclass
class Report:
    """What was done, what was measured, and whether every invariant held."""

    options: Options
    counts: Counter[str] = dataclasses.field(default_factory=Counter)
    leaderships: int = 0
    epochs_led: int = 0
    writes_accepted: int = 0
    stale_rejected: int = 0
    stale_accepted: list[str] = dataclasses.field(default_factory=list)
    api_writes_refused: int = 0  # by the API server's fence (its audit log)
    api_writes_admitted: int = 0  # fenced (carrying their lease), admitted
    stale_api_accepted: list[str] = dataclasses.field(default_factory=list)
    # Admitted API writes naming a Lease the API server had no record of: unchecked.
    unfenced_api: list[str] = dataclasses.field(default_factory=list)
    lost_updates: list[str] = dataclasses.field(default_factory=list)
    max_leaders: int = 0
    max_leaders_believed: int = 0
    overlap: list[str] = dataclasses.field(default_factory=list)
    reconciles: int = 0
    handoffs: int = 0  # shards handed off for balance, by any replica (their reports)
    narrowed_watches: int = 0  # by namespace: watch starts for the shards a replica led
    # Two processes inside one reconciler's (one shard's) reconcile of one entity at once.
    reconcile_overlaps: list[str] = dataclasses.field(default_factory=list)
    # Per scope (one per shard when sharded): epochs led by two holders.
    epochs_led_twice: dict[str, dict[int, set[str]]] = dataclasses.field(default_factory=dict)
    # Leaderships at an epoch the fence never recorded (it must be recorded before leading).
    unrecorded: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # Per scope: the epoch its lease record (Lease or row) holds at the end (None: missing),
    # and the highest that led it.
    lease_epochs: dict[str, int | None] = dataclasses.field(default_factory=dict)
    highest_led: dict[str, int] = dataclasses.field(default_factory=dict)
    # Per scope: leaderships, in order of start, whose epoch is below the previous one's.
    reversed_epochs: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    converged_in: float | None = None
    chaos_seconds: float = 0.0

    @property
    def failovers(self) -> int:
        return max(0, self.leaderships - max(1, len(self.highest_led)))

    def lease_records_behind(self) -> dict[str, tuple[int | None, int]]:
        """Scopes whose lease record ends below the highest epoch that led them."""
        return {
            scope: (self.lease_epochs.get(scope), led)
            for scope, led in self.highest_led.items()
            if (epoch := self.lease_epochs.get(scope)) is None or epoch < led
        }

    def violations(self) -> list[str]:
        found = []
        if self.stale_accepted:
            found.append(
                f"{len(self.stale_accepted)} stale write(s) accepted: {self.stale_accepted[:5]}"
            )
        if self.stale_api_accepted:
            found.append(
                f"{len(self.stale_api_accepted)} stale API write(s) admitted: "
                f"{self.stale_api_accepted[:5]}"
            )
        if self.writes_accepted and not self.api_writes_admitted:
            found.append("no status patch carried its lease: the API writes went unfenced")
        if self.unfenced_api:
            found.append(
                f"{len(self.unfenced_api)} API write(s) named a Lease the API server did not "
                f"know (unchecked by its fence): {self.unfenced_api[:5]}"
            )
        if self.lost_updates:
            found.append(f"{len(self.lost_updates)} lost update(s): {self.lost_updates[:5]}")
        if self.max_leaders > 1:
            found.append(f"{self.max_leaders} effective leaders at once: {self.overlap}")
        if self.reconcile_overlaps:
            found.append(
                f"{len(self.reconcile_overlaps)} time(s) two replicas inside one reconcile of "
                f"one entity: {self.reconcile_overlaps[:5]}"
            )
        if self.epochs_led_twice:
            found.append(f"epochs led by two holders: {self.epochs_led_twice}")
        if behind := self.lease_records_behind():
            found.append(
                "lease records below the highest epoch that led their scope "
                f"(scope: (record, highest led)): {behind}"
            )
        if self.unrecorded:
            found.append(f"led at epochs the fence never recorded: {self.unrecorded}")
        if self.reversed_epochs:
            found.append(f"a leadership at an epoch below the one before: {self.reversed_epochs}")
        if self.counts["api_zombie_accepted"]:
            found.append(
                f"{self.counts['api_zombie_accepted']} status patch(es) below the Lease's "
                "epoch admitted by the API server"
            )
        if self.counts["zombie_accepted"]:
            found.append(
                f"{self.counts['zombie_accepted']} direct write(s) below the epoch accepted"
            )
        if self.leaderships == 0:
            found.append("no replica ever led")
        return found

    def ok(self) -> bool:
        return not self.violations()

    def table(self) -> str:
        c, o = self.counts, self.options
        converged = "-" if self.converged_in is None else f"{self.converged_in:.1f}s"
        rows: list[tuple[str, object, str]] = [
            ("replicas SIGKILLed", c["kill"], "then restarted"),
            ("replicas SIGSTOPped", c["pause"], "then SIGCONTed"),
            ("graceful restarts", c["restart"], "SIGTERM, then a new process"),
            (
                "partitions from the API",
                c["partition"],
                f"refuse {c['partition_refuse']}, blackhole {c['partition_blackhole']}; "
                f"{c['partition_leader']} of the leader",
            ),
            (
                "API faults",
                c["api_500"] + c["api_slow"] + c["watch_cut"] + c["api_pause"] + c["api_restart"],
                f"500s {c['api_500']}, slow {c['api_slow']}, watch cuts {c['watch_cut']}, "
                f"server paused {c['api_pause']}, restarted {c['api_restart']}",
            ),
            (
                "database faults",
                c["db_stop"] + c["db_kill"],
                f"server stopped {c['db_stop']}, backends killed {c['db_kill']} "
                f"({c['db_backends']} connections)",
            ),
            ("unexpected replica exits", c["unexpected_exit"], "restarted as a Deployment would"),
            (
                "joins and leaves",
                c["join"] + c["leave"],
                f"joined {c['join']}, left {c['leave']}; {self.handoffs} hand-offs in all, "
                f"{c['handoff']} after a join, {c['handoff_strike']} struck during one",
            ),
            ("spec changes", c["spec_change"], f"{c['spec_change_failed']} failed (faults)"),
            *(
                [
                    (
                        "narrowed watch starts",
                        self.narrowed_watches,
                        "a list of the shards then led, at each change of them",
                    )
                ]
                if o.by_namespace
                else []
            ),
            (
                "failovers",
                self.failovers,
                f"{self.leaderships} leaderships, {self.epochs_led} epochs recorded",
            ),
            ("writes accepted", self.writes_accepted, "applied by PostgreSQL (audit)"),
            (
                "stale writes rejected",
                self.stale_rejected,
                f"by the database (audit); {c['zombie']} of them sent straight to it "
                f"at the epoch below the scope's",
            ),
            ("stale writes accepted", len(self.stale_accepted), "must be 0"),
            ("fenced API writes", self.api_writes_admitted, "status patches carrying their lease"),
            (
                "API writes refused",
                self.api_writes_refused,
                f"by the API server's fence (its audit log); {c['api_zombie']} of them sent "
                "straight to it at the epoch below the Lease's",
            ),
            ("stale API writes accepted", len(self.stale_api_accepted), "must be 0"),
            (
                "API writes unfenced",
                len(self.unfenced_api),
                "must be 0: each names a Lease the API server knew",
            ),
            (
                "lost updates",
                len(self.lost_updates),
                f"must be 0; converged {converged} after quiescing",
            ),
            (
                "max simultaneous leaders",
                self.max_leaders,
                f"must be 1; {self.max_leaders_believed} as believed, paused replicas included",
            ),
            (
                "overlapping reconciles",
                len(self.reconcile_overlaps),
                f"must be 0: two replicas inside one entity ({self.reconciles} reconciles)",
            ),
            ("epochs led by two holders", len(self.epochs_led_twice), "must be 0"),
            (
                "lease records behind",
                len(self.lease_records_behind()),
                f"must be 0: each lease record's epoch at the end >= the highest that led "
                f"its scope ({len(self.highest_led)} scope(s), highest "
                f"{max(self.highest_led.values(), default=0)})",
            ),
            (
                "epochs out of order",
                sum(map(len, self.unrecorded.values()))
                + sum(map(len, self.reversed_epochs.values())),
                "must be 0 (never below the last leadership's; recorded in the fence first)",
            ),
        ]
        sharding = (
            f"{o.shards} shards{' by namespace' if o.by_namespace else ''}, "
            if o.shards > 1
            else ""
        )
        head = (
            f"Process chaos: seed {o.seed}, {self.chaos_seconds:.0f}s of chaos, "
            f"{o.replicas} replicas, {sharding}{o.elector} leases, {o.tier} API server, "
            f"{o.devices} Devices, lease TTL {o.ttl}s"
        )
        lines = [head, f"  {'':<28} {'value':>7}  note"]
        lines += [f"  {name:<28} {value!s:>7}  {note}" for name, value, note in rows]
        verdict = self.violations()
        lines.append("  every invariant held" if not verdict else "  INVARIANT BROKEN:")
        lines += [f"    - {v}" for v in verdict]
        return "\n".join(lines)
