"""``kopf-reconcile demo --shards N``: three replicas share the shards, one is killed.

The example operator runs with ``shards=N``: each shard of the Devices is led under
a lease of its own, with an epoch and a fencing scope of its own, and the replicas
balance the shards between them. The story:

1. Start the embedded cluster, PostgreSQL and the replicas; wait until every shard
   has one holder and the replicas hold about N / replicas shards each (their
   ``kopf_reconcile_leader{shard=...}`` and ``kopf_reconcile_epoch{shard=...}``).
2. Create the Devices and watch them converge, each written by its shard's holder.
3. SIGKILL the replica holding the most shards while Devices change. After the TTL
   the survivors take over its shards, at higher epochs; the other shards keep
   their holder and their epoch (a shard lease moves only when its holder is gone).
4. Verify: every Device converged, and the database's audit
   (:mod:`kopf_reconcile.testing.audit`) shows no stale write accepted in any
   shard's scope.

The holders and epochs come from the replicas' /metrics (the ``shard`` label), and
``kopf-reconcile leases`` shows the same from the leases themselves.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time

from kopf_reconcile.demo.stack import Replica
from kopf_reconcile.demo.story import NAMESPACE, Demo, Options, Summary, _output
from kopf_reconcile.demo.view import View, held_shards
from kopf_reconcile.integration.tables import format_table

Holders = dict[int, tuple[str, int]]  # shard -> (its holder's name, its epoch)


@dataclasses.dataclass
class ShardMoves:
    """Who held which shard before and after the SIGKILL."""

    shards: int
    replicas: int
    killed: str = ""
    killed_shards: list[int] = dataclasses.field(default_factory=list)
    before: Holders = dataclasses.field(default_factory=dict)
    after: Holders = dataclasses.field(default_factory=dict)
    takeover_seconds: float = 0.0  # from the SIGKILL until every shard had a live holder

    @property
    def moved(self) -> list[int]:
        """Shards whose holder changed."""
        return sorted(k for k in self.before if self.after.get(k, ("", 0))[0] != self.before[k][0])

    @property
    def kept(self) -> int:
        """Shards of the survivors with the same holder and the same epoch after the kill."""
        return sum(
            1
            for k, held in self.before.items()
            if k not in self.killed_shards and self.after.get(k) == held
        )

    @property
    def higher_epoch(self) -> int:
        """The killed replica's shards led again by a survivor, at a higher epoch."""
        return sum(
            1
            for k in self.killed_shards
            if k in self.after
            and self.after[k][0] != self.killed
            and self.after[k][1] > self.before[k][1]
        )

    def ok(self) -> bool:
        return (
            bool(self.killed_shards)
            and self.moved == sorted(self.killed_shards)
            and self.kept == self.shards - len(self.killed_shards)
            and self.higher_epoch == len(self.killed_shards)
        )


class ShardedDemo(Demo):
    """The sharded story; the Devices, the stack and the audit are the default story's."""

    audited_scope = None  # every shard's scope

    def summary_lines(self, summary: Summary) -> list[str]:
        return summary_lines(summary, self.moves, self.ok())

    def __init__(self, options: Options, view: View) -> None:
        super().__init__(options, view)
        self.moves = ShardMoves(shards=self.options.shards, replicas=self.options.replicas)

    def ok(self) -> bool:
        s = self.summary
        return (
            s.converged == s.objects
            and s.lost_updates == 0
            and s.stale_accepted == 0
            and s.stale_api_accepted == 0
            and s.unfenced_api == 0
            and self.moves.ok()
        )

    async def _scenes(self) -> None:
        await self._start()
        self._show_holders("shards held per replica (from their /metrics)")
        await self._show_leases()
        await self._create_devices()
        await self._kill_a_replica()
        await self._verify()
        self._show_moves()
        await self._show_leases()

    async def _elected(self) -> None:
        # The first replica up may take every shard, then hand them off one per TTL
        # as the others join: wait for the balance, not only for every shard to be led.
        timeout = 30 + 3 * self.options.ttl * self.options.shards
        await self._until(self._balanced, f"sharing {self.options.shards} shards", timeout)
        counts = sorted(len(r.last.shards) for r in self._running())
        self.view.note(
            f"every one of {self.options.shards} shards has one holder; the replicas hold "
            f"{', '.join(map(str, counts))} shards"
        )

    async def _create_devices(self) -> None:
        await super()._create_devices()
        # Balance may still settle while the Devices are created: take the holders now.
        await self._until(self._balanced, "the shards settle", 30)
        self.moves.before = self._holders()

    async def _kill_a_replica(self) -> None:
        victim = max(self._running(), key=lambda r: (len(r.last.shards), -r.pid))
        self.moves.killed = victim.name
        self.moves.killed_shards = sorted(victim.last.shards)
        self.view.note(
            f"SIGKILL {victim.name} (pid {victim.pid}), holder of shards "
            f"{held_shards(victim.last.shards)}"
        )
        killed_at = time.monotonic()
        self.stack.kill(victim)
        await self._flip(max(1, self.options.objects // 10))
        await self._until(
            self._every_shard_led,
            f"the survivors take over shards {self.moves.killed_shards} after the TTL",
            self.options.ttl * 4 + 30,
        )
        self.moves.takeover_seconds = time.monotonic() - killed_at
        self.view.note(
            f"every shard has a live holder again, {self.moves.takeover_seconds:.2f}s "
            "after the SIGKILL"
        )
        await self._until_converged("converging under the survivors")
        self.moves.after = self._holders()
        self._show_holders("shards held per replica after the SIGKILL")

    # -- what the replicas say -----------------------------------------------------

    def _running(self) -> list[Replica]:
        return [r for r in self.stack.replicas if r.state == "running"]

    def _holders(self) -> Holders:
        return {k: (r.name, epoch) for r in self._running() for k, epoch in r.last.shards.items()}

    def _every_shard_led(self) -> bool:
        led = collections.Counter(k for r in self._running() for k in r.last.shards)
        return sorted(led) == list(range(self.options.shards)) and set(led.values()) == {1}

    def _balanced(self) -> bool:
        counts = [len(r.last.shards) for r in self._running()]
        return self._every_shard_led() and max(counts) - min(counts) <= 1

    # -- what the demo shows -------------------------------------------------------

    def _show_holders(self, title: str) -> None:
        rows = [
            (r.name, r.state, len(r.last.shards), held_shards(r.last.shards))
            for r in self._running()
        ]
        self.view.block(title, format_table(("replica", "state", "shards", "shard(epoch)"), rows))

    def _show_moves(self) -> None:
        m = self.moves
        rows = []
        for k in sorted(m.before):
            old, new = m.before[k], m.after.get(k, ("-", 0))
            verdict = "moved" if k in m.moved else "kept"
            rows.append((k, f"{old[0]} @ {old[1]}", f"{new[0]} @ {new[1]}", verdict))
        self.view.block(
            f"shard holders before and after the SIGKILL of {m.killed}",
            format_table(("shard", "before", "after", ""), rows),
        )

    async def _show_leases(self) -> None:
        out = await _output(sys.executable, "-m", "kopf_reconcile", "leases",
                            f"--kubeconfig={self.stack.kubeconfig}", "-n", NAMESPACE)  # fmt: skip
        self.view.block(f"$ kopf-reconcile leases -n {NAMESPACE}", out.splitlines())


def summary_lines(summary: Summary, moves: ShardMoves, ok: bool) -> list[str]:
    """The sharded story's summary table and verdict."""
    killed = len(moves.killed_shards)
    rows = [
        ("objects", summary.objects, ""),
        ("converged", summary.converged, "must equal objects"),
        ("shards shared", moves.shards, f"by {moves.replicas} replicas"),
        ("killed replica's shards", killed, f"{moves.killed}: {moves.killed_shards}"),
        ("shards moved", len(moves.moved), f"{moves.moved}: must be the killed replica's"),
        ("kept holder and epoch", moves.kept, f"must be {moves.shards - killed}"),
        ("taken over at a higher epoch", moves.higher_epoch, f"must be {killed}"),
        ("takeover", f"{moves.takeover_seconds:.2f}s", "SIGKILL to every shard led (TTL)"),
        ("stale writes accepted", summary.stale_accepted,
         "must be 0 (none below an epoch that led its shard's scope)"),
        ("stale API writes accepted", summary.stale_api_accepted,
         "must be 0 (none admitted after a newer term of its shard's Lease)"),
        ("API writes unfenced", summary.unfenced_api,
         "must be 0 (each named a Lease the API server knew)"),
        ("lost updates", summary.lost_updates, "must be 0"),
    ]  # fmt: skip
    verdict = "every invariant held" if ok else "AN INVARIANT WAS BROKEN"
    return [*format_table(("", "value", "note"), rows), "", verdict]
