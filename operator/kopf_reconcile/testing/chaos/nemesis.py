"""The nemesis of a chaos run: a schedule of faults drawn from ``random.Random(seed)``.

It SIGKILLs (and restarts), SIGSTOPs/SIGCONTs and gracefully restarts replicas, injects
API faults (500s, slow answers, cut watches), pauses or restarts the API server, stops
PostgreSQL and terminates its backends, partitions a replica from the API while it still
reaches PostgreSQL, sends writes one epoch below the scope's straight to PostgreSQL
(zombie writes), and, sharded, makes replicas join and leave and strikes during the
hand-offs that causes; meanwhile the workload keeps changing the Devices' specs, and a
supervisor restarts a replica that exited by itself (as its Deployment would).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import asyncpg

from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.integration.fence_lease import Identity
from kopf_reconcile.integration.fence_policy import (
    EPOCH_EXTRA,
    FENCE_MARKER,
    HOLDER_EXTRA,
    LEASE_EXTRA,
)
from kopf_reconcile.testing.chaos.stage import (
    API_FAULT_TARGETS,
    HTTP_TIMEOUT,
    NAMESPACE,
    SCOPE,
    STATES,
    STOP_GRACE,
    ChaosError,
    Slot,
    Stage,
    devices_path,
)


class Nemesis(Stage):
    """The faults of a chaos run, the spec changes and the supervisor."""

    async def _chaos(self) -> None:
        o = self.options
        self._chaos_on = True
        self._changing = True
        changer = self._spawn(self._change_specs(), "spec changes")
        status = self._spawn(self._status(), "status")
        actions: list[tuple[str, int, Callable[[], Awaitable[None]]]] = [
            ("kill", 3, self._kill),
            ("pause", 3, self._pause),
            ("restart", 1, self._restart),
            ("partition", 3, self._partition),
            ("api_500", 2, self._api_500),
            ("api_slow", 2, self._api_slow),
            ("watch_cut", 1, self._watch_cut),
            ("api_pause", 1, self._api_pause),
            ("db_stop", 1, self._db_stop),
            ("db_kill", 2, self._db_kill),
            ("zombie", 1, self._zombie_write),
        ]
        if self.sharded:  # only then: an unsharded seed keeps its schedule
            actions.append(("join", 8, self._join_or_leave))
        names = [a[0] for a in actions]
        weights = [a[1] for a in actions]
        run = {a[0]: a[2] for a in actions}
        started = time.monotonic()
        end = started + o.duration
        if self.sharded:  # a join first: hand-offs are what a sharded run is about
            self._spawn(self._join_or_leave(), "join")
        while time.monotonic() < end:
            await asyncio.sleep(self.rng.uniform(0.5, 2.0))
            if time.monotonic() >= end:
                break
            choice = self.rng.choices(names, weights)[0]
            # Each action draws its parameters now, so the schedule depends on the seed alone.
            self._spawn(run[choice](), choice)
        self._chaos_on = False
        self.report.chaos_seconds = time.monotonic() - started
        self.say("chaos over: healing everything, then no more spec changes")
        # Actions in flight end by themselves (their pauses and outages are bounded).
        await self._wait_actions(exclude={changer, status})
        self._changing = False
        await asyncio.gather(changer, return_exceptions=True)
        status.cancel()

    def _pick(self, prefer_leader: float) -> Slot | None:
        """A replica that is not paused or restarting: the leader with some probability."""
        roll = self.rng.random()
        candidates = [s for s in self.slots if s.alive and not s.busy]
        if not candidates:
            return None
        leaders = [s for s in candidates if s.leading() is not None]
        if leaders and roll < prefer_leader:
            return leaders[0]
        return candidates[int(roll * 1000) % len(candidates)]

    def _role(self, slot: Slot) -> str:
        led = slot.led()
        if not led:
            return "a follower"
        if not self.sharded:
            return f"the leader at epoch {led[SCOPE]}"
        shards = sorted(int(scope.rsplit("-", 1)[1]) for scope in led)
        return f"the holder of shards {shards}"

    async def _join_or_leave(self) -> None:
        """A replica joins (then the nemesis strikes during the hand-off it causes), or leaves.

        A join makes the others hand shards off to the newcomer. Once one has begun,
        the nemesis SIGKILLs, SIGSTOPs or gracefully restarts the replica handing off,
        or the one that joined, or lets it be (drawn now, like every parameter).
        """
        strike = self.rng.choice(("kill", "pause", "restart", "kill_joiner", "pause_joiner", None))
        pause = self.rng.uniform(0.3, 3.0 * self.options.ttl)
        downtime = self.rng.uniform(0.3, 3.0)
        slot = next(s for s in self.slots if s.standby)
        if slot.busy:
            return
        slot.busy = True
        try:
            if slot.alive:
                assert slot.process is not None
                self.say(f"{slot.name} leaves (SIGTERM), {self._role(slot)}")
                slot.expected_exit = True
                slot.process.send_signal(signal.SIGTERM)
                await self._reap(slot)
                self.report.counts["leave"] += 1
                return
            await self._start_replica(slot)
            self.report.counts["join"] += 1
            self.say(f"{slot.name} joins")
            giver = await self._hand_off_begun(timeout=4.0 * self.options.ttl)
        finally:
            slot.busy = False
        if giver is None:
            self.say("no hand-off followed the join")
            return
        self.report.counts["handoff"] += 1
        target = slot if strike in ("kill_joiner", "pause_joiner") else giver
        if strike is None or target.busy or not target.alive:
            return
        handing_off = giver.handing_off()
        self.report.counts["handoff_strike"] += bool(handing_off)
        self.say(
            f"{giver.name} is handing {handing_off or 'a shard (just done)'} off: "
            f"{strike.replace('_joiner', '')} {target.name}"
        )
        if strike.startswith("kill"):
            await self._kill(target, downtime)
        elif strike.startswith("pause"):
            await self._pause(target, pause)
        else:
            await self._restart(target)

    async def _hand_off_begun(self, timeout: float) -> Slot | None:
        """The first replica seen handing a shard off, within ``timeout`` seconds."""
        seen = {slot.index: _size(slot) for slot in self.slots}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for slot in self.slots:
                if slot.alive and not slot.busy and slot.handing_off():
                    return slot
                if slot.alive and not slot.busy and slot.history is not None:
                    # A hand-off that began and ended between two looks still counts.
                    with contextlib.suppress(OSError), slot.history.events.open("rb") as events:
                        events.seek(seen[slot.index])
                        if b'"handoff"' in events.read():
                            return slot
            await asyncio.sleep(0.02)
        return None

    async def _kill(self, target: Slot | None = None, downtime: float | None = None) -> None:
        slot = self._pick(0.6) if target is None else target
        if downtime is None:
            downtime = self.rng.uniform(0.3, 3.0)
        if slot is None or slot.process is None or slot.busy:
            return
        slot.busy = True
        try:
            self.say(f"SIGKILL {slot.name} (pid {slot.process.pid}), {self._role(slot)}")
            self._kill_now(slot)
            self.report.counts["kill"] += 1
            await asyncio.sleep(downtime)
            await self._start_replica(slot)
        finally:
            slot.busy = False

    def _kill_now(self, slot: Slot) -> None:
        assert slot.process is not None and slot.history is not None
        slot.expected_exit = True
        if slot.process.returncode is None:
            slot.process.send_signal(signal.SIGKILL)
        slot.history.killed_at = time.monotonic()

    async def _pause(self, target: Slot | None = None, length: float | None = None) -> None:
        slot = self._pick(0.7) if target is None else target
        if length is None:
            length = self.rng.uniform(0.3, 3.0 * self.options.ttl)
        if slot is None or slot.process is None or slot.history is None or slot.busy:
            return
        slot.busy = True
        try:
            self.say(f"SIGSTOP {slot.name} for {length:.1f}s, {self._role(slot)}")
            paused = time.monotonic()
            slot.process.send_signal(signal.SIGSTOP)
            slot.history.pauses.append((paused, None))
            self.report.counts["pause"] += 1
            await asyncio.sleep(length)
            if slot.process.returncode is None:
                slot.process.send_signal(signal.SIGCONT)
            slot.history.pauses[-1] = (paused, time.monotonic())
            self.say(f"SIGCONT {slot.name}")
        finally:
            slot.busy = False

    async def _restart(self, target: Slot | None = None) -> None:
        slot = self._pick(0.5) if target is None else target
        if slot is None or slot.process is None or slot.busy:
            return
        slot.busy = True
        try:
            self.say(f"SIGTERM {slot.name} (a graceful restart), {self._role(slot)}")
            slot.expected_exit = True
            slot.process.send_signal(signal.SIGTERM)
            await self._reap(slot)
            self.report.counts["restart"] += 1
            await self._start_replica(slot)
        finally:
            slot.busy = False

    async def _reap(self, slot: Slot) -> None:
        assert slot.process is not None and slot.history is not None
        try:
            async with asyncio.timeout(STOP_GRACE + 5):
                await slot.process.wait()
        except TimeoutError:
            self._kill_now(slot)
            await slot.process.wait()
        if slot.history.killed_at is None:
            slot.history.killed_at = time.monotonic()

    async def _partition(self) -> None:
        slot = self._pick(0.7)
        length = self.rng.uniform(1.0, 3.0 * self.options.ttl)
        mode = self.rng.choice(("refuse", "blackhole"))
        if slot is None or self._partitioned:
            return
        self._partitioned = True
        role = self._role(slot)
        try:
            self.say(f"partition {slot.name} from the API ({mode}) for {length:.1f}s, {role}")
            slot.proxy.partition(mode)
            self.report.counts["partition"] += 1
            self.report.counts[f"partition_{mode}"] += 1
            if role != "a follower":
                self.report.counts["partition_leader"] += 1
            await asyncio.sleep(length)
        finally:
            slot.proxy.heal()
            self._partitioned = False
            self.say(f"healed the partition of {slot.name}")

    async def _api_500(self) -> None:
        method, pattern = self.rng.choice(API_FAULT_TARGETS)
        times = self.rng.randint(1, 8)
        if self._real is not None:
            await self._api_restart()  # no fault injection there: a crash and restart instead
            return
        if await self._fault(
            {"method": method, "path_pattern": pattern, "status": 500, "times": times}
        ):
            self.report.counts["api_500"] += 1
            self.say(f"API: the next {times} {method} {pattern} answer 500")

    async def _api_slow(self) -> None:
        method, pattern = self.rng.choice(API_FAULT_TARGETS)
        times = self.rng.randint(1, 8)
        delay = round(self.rng.uniform(0.2, 2.5), 2)
        if self._real is not None:  # every replica's connection slowed, at its proxy
            length = times * delay
            self.say(f"API: every byte to and from it held {delay}s, for {length:.1f}s")
            self.report.counts["api_slow"] += 1
            for slot in self.slots:
                slot.proxy.delay = delay
            try:
                await asyncio.sleep(length)
            finally:
                for slot in self.slots:
                    slot.proxy.delay = 0.0
            return
        if await self._fault(
            {"method": method, "path_pattern": pattern, "delay": delay, "times": times}
        ):
            self.report.counts["api_slow"] += 1
            self.say(f"API: the next {times} {method} {pattern} answer after {delay}s")

    async def _fault(self, fault: dict[str, Any]) -> bool:
        if self._cluster_paused:
            return False
        try:
            await self._api("POST", "/_embedded/faults", fault)
        except (ChaosError, aiohttp.ClientError, OSError, TimeoutError):
            return False
        return True

    async def _watch_cut(self) -> None:
        pattern = self.rng.choice((None, r".*/devices", r".*/leases"))
        if self._real is not None:  # every replica's connections reset, watches included
            cut = sum(slot.proxy.reset() for slot in self.slots)
            self.report.counts["watch_cut"] += 1
            self.say(f"API: reset {cut} connection(s) of the replicas, watches included")
            return
        if self._cluster_paused:
            return
        body = {} if pattern is None else {"path_pattern": pattern}
        with contextlib.suppress(ChaosError, aiohttp.ClientError, OSError, TimeoutError):
            answer = await self._api("POST", "/_embedded/watches/cut", body)
            self.report.counts["watch_cut"] += 1
            self.say(
                f"API: cut {answer.get('cut', '?')} watch(es) matching {pattern or 'anything'}"
            )

    async def _api_restart(self) -> None:
        """SIGKILL the real kube-apiserver and start it again on the same etcd and port."""
        if self._cluster_paused or self._real is None:
            return
        self._cluster_paused = True
        try:
            self.say("SIGKILL the kube-apiserver, then start it again")
            started = time.monotonic()
            await self._real.restart_apiserver()
            self.report.counts["api_restart"] += 1
            self.say(f"kube-apiserver serving again after {time.monotonic() - started:.1f}s")
        finally:
            self._cluster_paused = False

    async def _api_pause(self) -> None:
        length = self.rng.uniform(0.5, 4.0)
        if self._real is not None:
            await self._api_restart()
            return
        if self._cluster_paused or self._cluster is None:
            return
        self._cluster_paused = True
        try:
            self.say(f"SIGSTOP the API server for {length:.1f}s")
            self._cluster.send_signal(signal.SIGSTOP)
            self.report.counts["api_pause"] += 1
            await asyncio.sleep(length)
        finally:
            with contextlib.suppress(ProcessLookupError):  # it died: the run fails anyway
                self._cluster.send_signal(signal.SIGCONT)
            self._cluster_paused = False
            self.say("SIGCONT the API server")

    async def _db_stop(self) -> None:
        length = self.rng.uniform(0.5, 4.0)
        if self._postgres_down or self._postgres is None:
            return
        self._postgres_down = True
        try:
            self.say(f"stop PostgreSQL for {length:.1f}s")
            await self._postgres.stop()
            self.report.counts["db_stop"] += 1
            await asyncio.sleep(length)
        finally:
            await self._postgres.start()
            self._postgres_down = False
            self.say("PostgreSQL started again")

    async def _db_kill(self) -> None:
        if self._postgres_down:
            return
        try:
            connection = await asyncpg.connect(self.dsn, timeout=HTTP_TIMEOUT)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            return
        try:
            killed = await connection.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )
        except (OSError, asyncpg.PostgresError):
            return
        finally:
            with contextlib.suppress(Exception):
                await connection.close()
        self.report.counts["db_kill"] += 1
        self.report.counts["db_backends"] += int(killed)
        self.say(f"PostgreSQL: terminated {killed} backend(s)")

    async def _zombie_write(self) -> None:
        """A write at an epoch below the scope's, straight to PostgreSQL: must be rejected."""
        index = self.rng.randrange(self.options.devices)
        if self._postgres_down:
            return
        entity = "/".join(self.device(index))
        scope = self._scope_of(entity)
        try:
            async with asyncio.timeout(HTTP_TIMEOUT):
                connection = await asyncpg.connect(self.dsn)
                try:
                    led = await connection.fetchval(
                        "SELECT epoch FROM kopf_reconcile_fence_epochs WHERE scope = $1", scope
                    )
                finally:
                    await connection.close()
                if not led or led < 2:
                    return
                async with PostgresFencedRepository(self.dsn, scope=scope) as repository:
                    accepted = await repository.apply_fenced(
                        entity, led - 1, {"desired": "zombie", "generation": -1}
                    )
        except (OSError, asyncpg.PostgresError, TimeoutError):
            return
        self.report.counts["zombie"] += 1
        if accepted:
            self.report.counts["zombie_accepted"] += 1
        verdict = "ACCEPTED (fencing is broken)" if accepted else "rejected by the database"
        self.say(f"a write to {entity} at epoch {led - 1} ({scope} led at {led}): {verdict}")
        await self._zombie_api_write(entity, scope)

    async def _zombie_api_write(self, entity: str, scope: str) -> None:
        """A status patch at an epoch below its Lease's, as a paused leader's fenced client
        sends it (the Lease's holder, the epoch before): the API server must refuse it."""
        leases = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"
        try:
            lease = await self._api("GET", f"{leases}/{scope}")
            spec = lease.get("spec") or {}
            epoch, holder = int(spec.get("leaseTransitions") or 0), spec.get("holderIdentity")
            if epoch < 2 or not holder:
                return
            review = await self._api(
                "POST",
                "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
            )
            info = review["status"]["userInfo"]
            identity = Identity(info["username"], tuple(info.get("groups", ())))
            extras = {LEASE_EXTRA: f"{NAMESPACE}/{scope}", HOLDER_EXTRA: holder}
            headers = identity.headers({**extras, EPOCH_EXTRA: str(epoch - 1)})
            namespace, name = entity.split("/", 1)
            patch = {"status": {"observed": "zombie"}}
            await self._api(
                "PATCH",
                f"{devices_path(namespace)}/{name}/status",
                patch,
                "application/merge-patch+json",
                extra_headers=headers,
            )
        except ChaosError as exc:
            if "403" not in str(exc) or FENCE_MARKER not in str(exc):
                return  # the API was unreachable (a fault): not a verdict
            refused = True
        except (OSError, aiohttp.ClientError, TimeoutError):
            return
        else:
            refused = False
        self.report.counts["api_zombie"] += 1
        if not refused:
            self.report.counts["api_zombie_accepted"] += 1
        verdict = "refused by the API server" if refused else "ADMITTED (the API fence is broken)"
        self.say(f"a status patch of {entity} at epoch {epoch - 1} ({scope}): {verdict}")

    async def _change_specs(self) -> None:
        rate = self.options.changes_per_second
        while self._changing:
            await asyncio.sleep(self.workload.expovariate(rate))
            index = self.workload.randrange(self.options.devices)
            desired = self.workload.choice(STATES)
            patch = [{"op": "replace", "path": "/spec/desired", "value": desired}]
            try:
                await self._api("PATCH", self.device_path(index), patch,
                                content_type="application/json-patch+json")  # fmt: skip
            except (ChaosError, aiohttp.ClientError, OSError, TimeoutError):
                self.report.counts["spec_change_failed"] += 1
            else:
                self.report.counts["spec_change"] += 1

    async def _status(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            if self.sharded:
                held = {s.name: len(s.led()) for s in self.slots if s.alive}
                who = f"shards held {held} of {self.options.shards}"
            else:
                leader = self._leader()
                who = f"{leader.name} leads at epoch {leader.leading()}" if leader else "no leader"
            up = sum(1 for s in self.slots if s.alive)
            self.say(
                f"status: {who}; {up}/{len(self.slots)} replicas up; "
                f"{self.report.counts['spec_change']} spec changes"
            )

    async def _supervise(self) -> None:
        """Restart a replica that exited on its own (as its Deployment would), and say so."""
        while True:
            await asyncio.sleep(0.2)
            for slot in self.slots:
                if slot.busy or slot.alive or slot.process is None or slot.expected_exit:
                    continue
                assert slot.history is not None
                slot.expected_exit = True
                if slot.history.killed_at is None:
                    slot.history.killed_at = time.monotonic()
                self.report.counts["unexpected_exit"] += 1
                log = self.workdir / f"{slot.history.replica}.log"
                tail = log.read_text(errors="replace").splitlines()[-3:] if log.exists() else []
                self.say(
                    f"{slot.history.replica} exited by itself (status {slot.process.returncode}); "
                    f"restarting it. Last lines: {' | '.join(tail)[:400]}"
                )
                slot.busy = True
                try:
                    await asyncio.sleep(1.0)
                    await self._start_replica(slot)
                finally:
                    slot.busy = False

    # -- quiescing and checking ------------------------------------------------------


def _size(slot: Slot) -> int:
    """How long the leadership report of ``slot``'s current process is (bytes)."""
    if slot.history is None:
        return 0
    with contextlib.suppress(OSError):
        return slot.history.events.stat().st_size
    return 0
