"""One replica of a reconciler in its own OS process, for failover tests and benchmarks.

Run ``python tests/reliability/replica.py --elector kubernetes --kubeconfig PATH`` (or
``--elector postgres --dsn DSN``). The replica runs one Loop whose leadership comes
from a real lease store and reports what it does as JSON lines on stdout, each with
``event``, ``pid``, ``holder`` and ``t`` (``time.monotonic()``, which every process
on the machine shares, so a parent can compare it with its own):

* ``ready``: the Loop has started (it is acquiring or following);
* ``leader`` / ``follower`` with ``epoch``: a change of leadership as the Loop sees it;
* ``reconcile`` with ``entity`` and ``epoch``: a reconcile started;
* ``wrote`` with ``epoch`` and ``n``: the long-running reconcile of ``work`` made a
  fenced write of ``{"n": n, "epoch": epoch}`` (one every 50 ms while it runs);
* ``refused``: such a write was refused because the lease is no longer live;
* ``cancelled`` with ``entity``: a reconcile was cancelled, such as the one of ``wait``,
  which only waits (``--no-work`` leaves both ``work`` and ``wait`` out);
* ``stopped``: SIGTERM stopped the Loop (releasing the lease); the process exits 0;
* ``pausing`` with ``entity``, ``epoch`` and ``mutation``, then ``answered`` with
  ``accepted``: see SIGUSR1 below.

Fenced writes go to an in-process repository by default: what is tested then is
that the replica itself checks its lease before acting, so a paused leader that
wakes up past its lease writes nothing. With ``--fence-dsn`` they go to a
``PostgresFencedRepository``, where the database checks the epoch. SIGUSR1 makes
the next fenced write pause the whole process (it sends itself SIGSTOP) after the
writer's local lease check and before the repository call, the worst moment for
a garbage-collection pause; on SIGCONT the write goes out with the epoch it had,
and is answered even if the Loop cancels the reconcile meanwhile.

With ``--api-namespace NS`` the reconcile of ``work`` writes to the Kubernetes API instead,
through a fenced client (``kr.FencedClient``: the lease's epoch sent for the API server's
fence): it patches the ConfigMap ``work`` of NS every 50 ms (``wrote``). SIGUSR1 then arms
*late* writes of the kind ``--late`` names (``status``: a status patch of the Gadget
``work`` of ``--gadgets GROUP``; ``create``: the ConfigMap ``late``; ``update``: the key
``late`` into ConfigMap ``work``; ``delete``: the ConfigMap ``victim``; ``all``: the four
at once), which pause the process after the client's local check and before any request is
sent (``pausing``), then go out (``answered`` per write, with ``kind``, ``accepted`` and, if
refused, ``reason``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from kubernetes_asyncio.client import ApiClient

import kopf_reconcile as kr
from kopf_reconcile.fencing.postgres import PostgresFencedRepository
from kopf_reconcile.fencing.writer import reconcile_lease
from kopf_reconcile.integration.api_client import LazyApiClient
from kopf_reconcile.integration.fence_lease import LeaseFence
from kopf_reconcile.integration.fenced_client import ClientContext, FencedClient
from kopf_reconcile.leader.kubernetes import KubernetesLeaseElector
from kopf_reconcile.leader.postgres import PostgresLeaseElector
from kopf_reconcile.sharded_loop import ShardedLoop
from kopf_reconcile.testing.memory import MemoryFencedRepository

WORK = "work"  # writes (fenced) every WRITE_EVERY seconds until cancelled
WAIT = "wait"  # awaits until cancelled, doing nothing
WRITE_EVERY = 0.05
STATUS_POLL = 0.005


class Reporter:
    """Writes one JSON line per event, flushed at once (the parent reads them live)."""

    def __init__(self, holder: str) -> None:
        self.holder = holder

    def __call__(self, event: str, **fields: Any) -> None:
        line = {"event": event, "t": time.monotonic(), "pid": os.getpid(), "holder": self.holder}
        sys.stdout.write(json.dumps({**line, **fields}) + "\n")
        sys.stdout.flush()


def make_elector(args: argparse.Namespace) -> KubernetesLeaseElector | PostgresLeaseElector:
    ttl = kr.LeaseTTL(args.ttl)
    if args.elector == "kubernetes":
        return KubernetesLeaseElector(args.namespace, ttl=ttl, kubeconfig=args.kubeconfig)
    return PostgresLeaseElector(args.dsn, ttl=ttl)


class PausingRepository:
    """The replica's repository; once armed, its next write stops the process first."""

    def __init__(self, inner: Any, report: Reporter) -> None:
        self.inner = inner
        self.armed = False
        self._report = report
        self._root = self  # whose ``armed`` counts: a shard's is its sharded repository's

    def for_shard(self, shard: int) -> PausingRepository:
        """A shard's repository (``--shards``), paused by the same SIGUSR1."""
        child = PausingRepository(self.inner.for_shard(shard), self._report)
        child._root = self
        return child

    def __getattr__(self, name: str) -> Any:  # bind_loop, highest_epoch: the Loop uses them
        return getattr(self.inner, name)

    async def apply_fenced(self, entity_id: str, epoch: int, mutation: object) -> bool:
        if not self._root.armed:
            return bool(await self.inner.apply_fenced(entity_id, epoch, mutation))
        self._root.armed = False
        self._report("pausing", entity=entity_id, epoch=epoch, mutation=mutation)
        # Frozen here, event loop included, until SIGCONT; nothing can run before the
        # write resumes, just as nothing runs during a long garbage-collection pause.
        os.kill(os.getpid(), signal.SIGSTOP)
        # The write was already under way when the process froze: it goes out and is
        # answered even if the Loop, seeing its lease lapsed, cancels the reconcile
        # while the write waits (for a connection, or to prepare its statement on one
        # the pool has not used for it yet). Without the shield such a cancellation
        # would keep the late write from the database, which is what is tested.
        write = asyncio.ensure_future(self.inner.apply_fenced(entity_id, epoch, mutation))
        try:
            accepted = bool(await asyncio.shield(write))
        except asyncio.CancelledError:
            accepted = bool(await asyncio.shield(write))
            self._report("answered", entity=entity_id, epoch=epoch, accepted=accepted)
            raise
        self._report("answered", entity=entity_id, epoch=epoch, accepted=accepted)
        return accepted


class PausingApi:
    """The API client of the replica's fenced writes. Armed with N (``arm``), it lets the
    next N requests pass the fenced client's local check and gather here, then stops the
    process (SIGSTOP) before any of them is sent: N writes in flight, paused together."""

    def __init__(self, kubeconfig: str, report: Reporter) -> None:
        self.inner = LazyApiClient(kubeconfig=kubeconfig)
        self.report = report
        self.armed = 0
        self._gathered = 0
        self._resumed = asyncio.Event()

    def arm(self, writes: int) -> None:
        self.armed, self._gathered = writes, 0
        self._resumed.clear()

    async def get(self) -> ApiClient:
        if self.armed:
            self._gathered += 1
            if self._gathered < self.armed:
                await self._resumed.wait()
            else:
                self.report("pausing")
                os.kill(os.getpid(), signal.SIGSTOP)
                self.armed = 0
                self._resumed.set()
        return await self.inner.get()


CONFIGMAPS = kr.Resource("", "v1", "configmaps")
LATE_KINDS = ("status", "create", "update", "delete")


async def late_write(client: FencedClient, kind: str, namespace: str, gadgets: str) -> None:
    """The write a paused leader makes when it wakes up."""
    if kind == "status":
        resource = kr.Resource(gadgets, "v1", "gadgets")
        await client.patch_status(resource, WORK, {"late": True}, namespace=namespace)
    elif kind == "create":
        await client.create(CONFIGMAPS, {"metadata": {"name": "late", "namespace": namespace}})
    elif kind == "update":
        await client.patch(CONFIGMAPS, WORK, {"data": {"late": "yes"}}, namespace=namespace)
    else:
        await client.delete(CONFIGMAPS, "victim", namespace=namespace)


def make_reconcile(
    report: Reporter, work: bool, api: PausingApi | None = None, args: Any = None
) -> Any:
    context = None
    if api is not None:

        async def namespace() -> str:
            return str(args.namespace)

        mirror = None if args.elector == "kubernetes" else int(args.ttl)
        fence = LeaseFence(api, namespace, mirror_ttl_seconds=mirror)
        context = ClientContext(api, field_manager="replica", fence=fence)

    async def reconcile(req: kr.Request) -> None:
        writer = kr.fenced_writer()
        assert writer is not None
        epoch = writer.epoch
        report("reconcile", entity=req.entity_id, epoch=epoch)
        if req.entity_id not in (WORK, WAIT) or not work:
            return
        try:
            if req.entity_id == WAIT:
                await asyncio.Event().wait()
            if context is not None:
                await write_to_the_api(FencedClient(context, reconcile_lease()), epoch)
                return
            for n in range(1, sys.maxsize):
                try:
                    await writer.write(WORK, {"n": n, "epoch": epoch})
                except kr.StaleEpochError as exc:
                    report("refused", entity=req.entity_id, epoch=epoch, reason=str(exc))
                    raise
                report("wrote", entity=req.entity_id, epoch=epoch, n=n)
                await asyncio.sleep(WRITE_EVERY)
        except asyncio.CancelledError:
            report("cancelled", entity=req.entity_id, epoch=epoch)
            raise

    async def write_to_the_api(client: FencedClient, epoch: int) -> None:
        assert api is not None
        for n in range(1, sys.maxsize):
            if api.armed:  # these writes pause, then go out whatever the Loop does meanwhile
                kinds = LATE_KINDS if args.late == "all" else (args.late,)
                writes = [
                    asyncio.ensure_future(
                        late_write(client, kind, args.api_namespace, args.gadgets)
                    )
                    for kind in kinds
                ]
                cancelled = False
                for write in writes:
                    while True:
                        try:
                            await asyncio.shield(write)
                        except asyncio.CancelledError:
                            if not write.done():
                                cancelled = True  # the Loop's; the write still goes out
                                continue
                        except BaseException:
                            pass
                        break
                for kind, write in zip(kinds, writes, strict=True):
                    error = write.exception()
                    report("answered", kind=kind, epoch=epoch, accepted=error is None,
                           reason="" if error is None else str(error))  # fmt: skip
                if cancelled:
                    raise asyncio.CancelledError
                if any(w.exception() for w in writes):
                    raise kr.StaleEpochError("late writes refused")
                continue
            try:
                await client.patch(
                    CONFIGMAPS,
                    WORK,
                    {"data": {"n": str(n), "epoch": str(epoch)}},
                    namespace=args.api_namespace,
                )
            except kr.StaleEpochError as exc:
                report("refused", entity=WORK, epoch=epoch, reason=str(exc))
                raise
            report("wrote", entity=WORK, epoch=epoch, n=n)
            await asyncio.sleep(WRITE_EVERY)

    return reconcile


async def report_leadership(loop: kr.Loop, report: Reporter) -> None:
    seen: tuple[bool, int] | None = None
    shards: dict[str, int] | None = None
    while True:
        stats = loop.stats()
        if (stats.is_leader, stats.epoch) != seen:
            seen = (stats.is_leader, stats.epoch)
            report("leader" if stats.is_leader else "follower", epoch=stats.epoch)
        if isinstance(loop, ShardedLoop):  # ``shards``: the shards held, with their epochs
            held = {str(k): s.epoch for k, s in loop.shard_stats().items() if s.is_leader}
            if held != shards:
                shards = held
                report("shards", held=held)
        await asyncio.sleep(STATUS_POLL)


async def run(args: argparse.Namespace) -> None:
    elector = make_elector(args)
    report = Reporter(elector.holder_id)
    requests: asyncio.Queue[kr.Request] = asyncio.Queue()
    if args.work:
        requests.put_nowait(kr.Request(WORK))
        requests.put_nowait(kr.Request(WAIT))
    fenced = (
        MemoryFencedRepository()
        if args.fence_dsn is None
        else PostgresFencedRepository(args.fence_dsn)
    )
    repository = PausingRepository(fenced, report)
    api = None
    if args.api_namespace is not None:
        api = PausingApi(args.kubeconfig, report)
    loop = (
        kr.Builder(make_reconcile(report, args.work, api, args), kr.Tenancy.SINGLE_TENANT)
        .with_trigger(kr.ChannelTrigger(requests))
        .with_leader(elector)
        .with_fenced_repo(repository)
        .with_reconciler_id(args.reconciler_id)
        .with_renew_interval(args.renew)
        .with_concurrency(3)  # the resync-all, work and wait
        .with_shards(args.shards)
        .build()
    )
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGUSR1,
        lambda: (
            setattr(repository, "armed", True)
            if api is None
            else api.arm(len(LATE_KINDS) if args.late == "all" else 1)
        ),
    )
    await loop.start()
    status = asyncio.create_task(report_leadership(loop, report))
    report("ready", elector=args.elector)
    try:
        await stopping.wait()
    finally:
        # Nothing in flight is worth waiting for here: cancel it, then release at once.
        await loop.stop(timeout=0)
        status.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await status
        await elector.close()
        if isinstance(fenced, PostgresFencedRepository):
            await fenced.close()
        if api is not None:
            await api.inner.close()
    report("stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elector", choices=["kubernetes", "postgres"], required=True)
    parser.add_argument("--kubeconfig", help="for --elector kubernetes")
    parser.add_argument("--namespace", default="default", help="for --elector kubernetes")
    parser.add_argument("--dsn", help="for --elector postgres")
    parser.add_argument("--fence-dsn", help="fenced writes to PostgreSQL (default: in memory)")
    parser.add_argument("--reconciler-id", default="devices")
    parser.add_argument("--ttl", type=float, default=2.0, help="lease TTL in seconds")
    parser.add_argument("--renew", type=float, default=0.2, help="renew interval in seconds")
    parser.add_argument(
        "--no-work", dest="work", action="store_false", help="no long-running reconcile"
    )
    parser.add_argument("--shards", type=int, default=1, help="shards (needs --fence-dsn)")
    parser.add_argument("--api-namespace", help="write to the Kubernetes API there (--kubeconfig)")
    parser.add_argument(
        "--late", choices=["all", "status", "create", "update", "delete"], default="update"
    )
    parser.add_argument("--gadgets", default="", help="the group of the Gadgets (--late status)")
    args = parser.parse_args(argv)
    if args.api_namespace is not None and not args.kubeconfig:
        parser.error("--api-namespace needs --kubeconfig")
    if args.elector == "kubernetes" and not args.kubeconfig:
        parser.error("--elector kubernetes needs --kubeconfig")
    if args.elector == "postgres" and not args.dsn:
        parser.error("--elector postgres needs --dsn")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
