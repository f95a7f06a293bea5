"""A lease is never released while a reconcile it guards still runs, on every lease backend.

A sync reconciler in its thread cannot be interrupted: when its Loop stops, the
lease is released only once the thread has returned (while the lease can still
be held), so a peer never takes the entity over while the old replica is still
inside it. The same holds with PostgreSQL rows and Kubernetes Leases on both
API tiers. This failed before: the lease was released about a second after
the cancellation, with the thread still running.
"""

from __future__ import annotations

import asyncio
import threading

import kopf_reconcile as kr
from conftest import LeaseBackend
from support import eventually

RID = "guarded"


def leader_loop(reconcile: object, elector: object) -> kr.Loop:
    return (
        kr.Builder(reconcile, kr.Tenancy.SINGLE_TENANT)  # type: ignore[arg-type]
        .with_trigger(kr.ChannelTrigger(asyncio.Queue()))
        .with_reconciler_id(RID)
        .with_leader(elector)  # type: ignore[arg-type]
        .with_renew_interval(0.2)
        .with_stop_timeout(0.05)
        .build()
    )


async def test_stop_waits_for_a_running_sync_reconcile_before_releasing(
    lease_backend: LeaseBackend,
) -> None:
    lock = threading.Lock()
    inside = {"now": 0, "most": 0}
    entered = threading.Event()
    let_go = threading.Event()
    second_ran = asyncio.Event()

    def enter() -> None:
        with lock:
            inside["now"] += 1
            inside["most"] = max(inside["most"], inside["now"])

    def leave() -> None:
        with lock:
            inside["now"] -= 1

    def slow(req: kr.Request) -> None:
        if req.entity_id == "x":
            enter()
            entered.set()
            let_go.wait(20)
            leave()

    def quick(req: kr.Request) -> None:
        if req.entity_id == "x":
            enter()
            leave()
            second_ran.set()

    old = leader_loop(slow, lease_backend.make(ttl=6))
    new = leader_loop(quick, lease_backend.make(ttl=6))
    await old.start()
    try:
        await eventually(lambda: old.stats().is_leader, timeout=15)
        await new.start()
        await old.enqueue(kr.Request("x"))
        await asyncio.to_thread(entered.wait, 10)
        stopping = asyncio.create_task(old.stop())
        await new.enqueue(kr.Request("x"))
        await asyncio.sleep(1.5)  # the thread runs on, well inside the 6 s lease
        assert not new.stats().is_leader, "a peer took over while the old reconcile still ran"
        let_go.set()
        await stopping
        await eventually(lambda: new.stats().is_leader, timeout=15)
        await asyncio.wait_for(second_ran.wait(), 10)
        assert inside["most"] == 1
    finally:
        let_go.set()
        await old.stop()
        await new.stop()
