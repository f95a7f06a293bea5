"""Sharded throughput: one replica vs two, and what sharding costs when the work is light.

A sharded reconciler (``Builder.with_shards``) lets several replicas lead at once,
each its share of the shards. This measures what that buys on one machine, with
every replica a real OS process (its own interpreter, so its own GIL), the shard
leases on PostgreSQL lease rows (``PostgresLeaseElector``) and every reconcile
ending in a fenced write to PostgreSQL (``PostgresFencedRepository``, fenced per
shard), all on an embedded PostgreSQL:

* **CPU-bound**: each reconcile spends ``--cpu-ms`` (5 ms) of CPU in a busy loop
  (on the event loop: a thread would gain nothing under the GIL), then writes.
  ``--objects`` (2,000) objects in ``--shards`` (8) shards, reconciled by one
  replica process, then by two (same run, fresh database each time). Target on two
  cores: two replicas at least 1.7x as fast as one.
* **light work**: no CPU per object, ``--light-objects`` objects; one replica
  unsharded (one lease, concurrency 8) against one replica with 8 shards
  (concurrency 1 per shard: 8 in all). The ratio is what sharding costs.

Each run starts its replicas, waits until the leadership has settled (every shard
held, and with two replicas four each: the balance hands shards off to the one
that joined), and only then sends every replica the objects at once, as a watch's
initial listing would (each replica's follower shards keep them queued). The time
measured runs from that moment until every object was reconciled at least once
(the last replica's report); the settling before it is reported apart, and so is
the CPU the replicas got meanwhile (on a machine shared with other work, two
replicas may get well under two cores).

Run: ``.venv/bin/python benchmarks/sharded_throughput.py [--runs N] [--objects N]
[--cpu-ms MS] [--shards N] [--light-objects N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import kopf_reconcile as kr
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.sharded_loop import ShardedLoop
from kopf_reconcile.testing.postgres import EmbeddedPostgres
from kopf_reconcile.testing.real_apiserver import dying_with_parent
from results import result

RECONCILER = "throughput"
TTL = 2.0
RENEW = 0.2
STARTUP = 60.0
SETTLE_TIMEOUT = 90.0
STATUS_POLL = 0.05
TARGET_SPEEDUP = 1.7


# -- the replica process -----------------------------------------------------------


def burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU (a busy loop, not a sleep)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def emit(event: str, **fields: Any) -> None:
    line = {"event": event, "t": time.monotonic(), "pid": os.getpid(), **fields}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


async def replica(args: argparse.Namespace) -> None:
    """One replica: leads what it may, reconciles what it is sent (one id a line on stdin)."""
    cpu = args.cpu_ms / 1000
    done = 0

    async def reconcile(req: kr.Request) -> None:
        nonlocal done
        if not req.entity_id:  # a new holder's resync-all: nothing was listed before "go"
            return
        if cpu:
            burn(cpu)
        writer = kr.fenced_writer()
        assert writer is not None
        await writer.write(req.entity_id, {"reconciled": True})
        done += 1
        emit("done", entity=req.entity_id, cpu=time.process_time())

    requests: asyncio.Queue[kr.Request] = asyncio.Queue()
    elector = PostgresLeaseElector(args.dsn, ttl=kr.LeaseTTL(TTL))
    fenced = PostgresFencedRepository(args.dsn)
    builder = (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(requests))
        .with_leader(elector)
        .with_fenced_repo(fenced)
        .with_reconciler_id(RECONCILER)
        .with_renew_interval(RENEW)
        .with_interval(3600)  # no periodic requeue within a run
        .with_concurrency(args.concurrency)
    )
    if args.shards > 1:
        builder = builder.with_shards(args.shards)
    loop = builder.build()
    await loop.start()
    emit("ready")
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )

    async def report_held() -> None:
        held: list[int] | None = None
        while True:
            if isinstance(loop, ShardedLoop):
                now = loop.held_shards()
            else:
                now = [0] if loop.stats().is_leader else []
            if now != held:
                held = now
                emit("held", shards=held)
            await asyncio.sleep(STATUS_POLL)

    status = asyncio.create_task(report_held())
    try:
        while line := (await reader.readline()).decode().strip():
            if line == "stop":
                break
            count = int(line)  # "N": the objects obj-0 .. obj-(N-1), as a listing
            for index in range(count):
                requests.put_nowait(kr.Request(f"obj-{index}"))
            emit("listed", objects=count, cpu=time.process_time())
        emit("finished", done=done)
    finally:
        status.cancel()
        await loop.stop(timeout=0)
        await elector.close()
        await fenced.close()


# -- the measurement --------------------------------------------------------------


class Process:
    """A replica process and what it reported."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            self.events.append(json.loads(line))
            self.changed.set()

    def held(self) -> list[int]:
        last = [e for e in self.events if e["event"] == "held"]
        return list(last[-1]["shards"]) if last else []

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ConnectionError):
                self.send("stop")
                assert self.process.stdin is not None
                await self.process.stdin.drain()
            try:
                async with asyncio.timeout(10):
                    await self.process.wait()
            except TimeoutError:
                self.process.kill()
        await self.process.wait()
        await asyncio.gather(self.reader, return_exceptions=True)


@contextlib.asynccontextmanager
async def started(count: int, options: list[str]) -> AsyncIterator[list[Process]]:
    group: list[Process] = []
    try:
        for _ in range(count):
            argv = [sys.executable, __file__, "--replica", *options]
            process = await asyncio.create_subprocess_exec(
                *dying_with_parent(argv),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            group.append(Process(process))
        yield group
    finally:
        for process in group:
            await process.stop()


async def until(group: list[Process], condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        for process in group:
            if process.process.returncode is not None:
                raise RuntimeError(f"a replica exited ({process.process.returncode})")
        await asyncio.sleep(STATUS_POLL)


async def one_run(
    dsn: str, *, replicas: int, shards: int, objects: int, cpu_ms: float, concurrency: int
) -> tuple[float, float, list[int], float]:
    """Seconds to reconcile every object once, seconds to settle, objects per replica, and
    the CPU the replicas spent meanwhile (seconds of CPU per second: the cores they had)."""
    options = ["--dsn", dsn, "--shards", str(shards), "--cpu-ms", str(cpu_ms),
               "--concurrency", str(concurrency)]  # fmt: skip
    started_at = time.monotonic()
    async with started(replicas, options) as group:
        share = -(-shards // replicas)

        def settled() -> bool:
            held = [p.held() for p in group]
            every = sorted(k for h in held for k in h) == list(range(shards))
            return every and all(len(h) <= share for h in held)

        await until(group, settled, SETTLE_TIMEOUT, "the shards to settle")
        settle = time.monotonic() - started_at
        seen = [len(p.events) for p in group]
        go = time.monotonic()
        for process in group:
            process.send(str(objects))

        def reconciled() -> set[str]:
            return {
                e["entity"]
                for p, first in zip(group, seen, strict=True)
                for e in p.events[first:]
                if e["event"] == "done"
            }

        await until(group, lambda: len(reconciled()) >= objects, 600, "every object reconciled")
        end = max(
            e["t"]
            for p, first in zip(group, seen, strict=True)
            for e in p.events[first:]
            if e["event"] == "done"
        )
        per_replica = [
            sum(1 for e in p.events[first:] if e["event"] == "done")
            for p, first in zip(group, seen, strict=True)
        ]
        cpu = 0.0
        for p, first in zip(group, seen, strict=True):
            stamps = [e["cpu"] for e in p.events[first:] if e["event"] in ("listed", "done")]
            cpu += max(stamps) - min(stamps) if stamps else 0.0
        return end - go, settle, per_replica, cpu / (end - go)


async def fresh_dsn(postgres: EmbeddedPostgres) -> str:
    """A new database, migrated: no epochs, leases or rows of a previous run."""
    dsn = await postgres.create_database()
    async with PostgresFencedRepository(dsn) as repository:
        await repository.migrate()
    return dsn


def line(label: str, times: list[float]) -> str:
    shown = ", ".join(f"{t:.2f}" for t in times)
    return f"  {label:<34} median {statistics.median(times):6.2f}s  runs: {shown}"


async def measure(args: argparse.Namespace) -> None:
    print(
        f"sharded throughput: {args.objects} objects, {args.cpu_ms:g} ms CPU each, "
        f"{args.shards} shards (concurrency 1 per shard), {args.runs} run(s); light work: "
        f"{args.light_objects} objects, no CPU; {os.cpu_count()} CPUs; every reconcile "
        "ends in a fenced write to PostgreSQL; times from the objects' listing (leadership "
        "settled) to the last first reconcile",
        flush=True,
    )
    one, two, settle_one, settle_two, split = [], [], [], [], []
    cores: dict[int, list[float]] = {1: [], 2: []}
    unsharded, sharded = [], []
    async with EmbeddedPostgres() as postgres:
        for run in range(args.runs):
            for replicas, into, settles in ((1, one, settle_one), (2, two, settle_two)):
                seconds, settle, per, had = await one_run(
                    await fresh_dsn(postgres),
                    replicas=replicas,
                    shards=args.shards,
                    objects=args.objects,
                    cpu_ms=args.cpu_ms,
                    concurrency=1,
                )
                into.append(seconds)
                settles.append(settle)
                cores[replicas].append(had)
                if replicas == 2:
                    split.append(min(per) / max(1, sum(per)))
                print(
                    f"run {run + 1}: {replicas} replica(s): {seconds:.2f}s "
                    f"({args.objects / seconds:,.0f} objects/s; settled in {settle:.1f}s; "
                    f"per replica {per}; the replicas had {had:.2f} CPU cores)",
                    flush=True,
                )
            for shards, into in ((1, unsharded), (args.shards, sharded)):
                concurrency = args.shards if shards == 1 else 1
                seconds, _, _, _ = await one_run(
                    await fresh_dsn(postgres),
                    replicas=1,
                    shards=shards,
                    objects=args.light_objects,
                    cpu_ms=0,
                    concurrency=concurrency,
                )
                into.append(seconds)
                print(
                    f"run {run + 1}: light work, 1 replica, {shards} shard(s): {seconds:.2f}s "
                    f"({args.light_objects / seconds:,.0f} objects/s)",
                    flush=True,
                )
    speedup = statistics.median(one) / statistics.median(two)
    cost = statistics.median(sharded) / statistics.median(unsharded)
    print(line("CPU-bound, 1 replica", one))
    print(line("CPU-bound, 2 replicas", two))
    print(
        f"  speedup 2 replicas / 1: {speedup:.2f}x (target >= {TARGET_SPEEDUP}x: "
        f"{'met' if speedup >= TARGET_SPEEDUP else 'MISSED'}); settling: 1 replica "
        f"{statistics.median(settle_one):.1f}s, 2 replicas {statistics.median(settle_two):.1f}s "
        f"(median); smaller replica's share of the objects {statistics.median(split):.2f}"
    )
    print(line("light work, unsharded", unsharded))
    print(line(f"light work, {args.shards} shards", sharded))
    print(f"  sharding's cost when the work is light: {cost:.2f}x the unsharded time")
    result(
        "sharded_throughput",
        f"time until {args.objects} objects ({args.cpu_ms:g} ms CPU each, {args.shards} shards) "
        "are reconciled, 2 replica processes vs 1",
        ours=two,
        baseline=one,
        unit="s",
        ratio="baseline/ours",
        target=(">=", TARGET_SPEEDUP),
        extra={
            "CPU cores the replicas had, 1 replica": statistics.median(cores[1]),
            "2 replicas": statistics.median(cores[2]),
            "settling s, 2 replicas": statistics.median(settle_two),
        },
    )
    result(
        "sharded_throughput",
        f"time until {args.light_objects} objects (no CPU) are reconciled by 1 replica, "
        f"{args.shards} shards vs unsharded",
        ours=sharded,
        baseline=unsharded,
        unit="s",
        ratio="ours/baseline",
        target=None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--cpu-ms", type=float, default=5.0, help="CPU per object (ms)")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--light-objects", type=int, default=2000)
    # A replica process (started by the measurement itself).
    parser.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dsn", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica:
        asyncio.run(replica(args))
    else:
        asyncio.run(measure(args))


if __name__ == "__main__":
    main()
