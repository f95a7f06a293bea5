"""Holding a lease: acquire, renew, step down, release — the Loop's control plane.

(Over 400 lines on purpose: acquire, renew, step down and release are one state machine
over one lease.)

A :class:`LeaseHolder` drives one :class:`LeaderElector` for one reconciler
id and tells its owner (the Loop) when it starts and stops leading:

* acquire (when the optional ``may_acquire`` gate allows: a shard's balance, see
  :mod:`kopf_reconcile.control.balance`; the gate can only withhold an attempt),
  retried every ``renew_interval`` (jittered by a factor of 1 to 1.2, as client-go),
  or sooner when the elector says when the holder's lease runs out, each
  attempt bounded by the renew deadline, so a hung API cannot keep a replica a
  follower forever;
* while leading, renew every ``renew_interval``; when no renewal succeeded
  within the renew deadline — measured on this process's monotonic clock from
  when the last successful renewal was *sent*, never by comparing clocks of
  two machines — or the elector says :class:`LeaseLost`, step down at once;
* before leading, an optional confirmation runs (the Loop records the epoch in
  its fenced store), then the lease is renewed once and the deadline counts
  from that renewal: an epoch is never used before the store knows it, so an
  elector whose lease record was deleted and recreated cannot hand the same
  epoch to two leaders. A confirmation that fails with a
  :class:`~kopf_reconcile.ConfigError` (e.g. the fenced scope belongs to
  another reconciler's lease) stops the control plane: retrying cannot help;
* stepping down first stops the lease from counting as live (so no fenced
  write passes the local check), then lets the owner cancel its work, then
  releases the lease when it may still hold it — but never while work it
  guards still runs: the holder waits for that work only as long as the lease
  can still be held (until a TTL after the last successful renewal was sent),
  and if any is still running then, it lets the lease lapse instead
  of releasing it, so no peer takes over while a reconcile of this process
  still runs (client-go's ReleaseOnCancel contract);
* :meth:`stop` lets an acquire in flight finish (cancelling it could lose a
  lease just taken, held for a whole TTL by a stopped process) and hands back
  whatever is held, by the same rule.

The renew deadline must be shorter than the TTL, so a leader steps down before
its lease can expire for the others.

Errors are logged on one line with what the server said (for an API error: status,
reason and message, see :mod:`kopf_reconcile.remote_errors`), and counted in
``lease_errors_total``; a refusal that retrying cannot fix (a 4xx such as 403 Forbidden
or a missing namespace), and a lease record with no epoch left
(:class:`~kopf_reconcile.leader.protocol.LeaseEpochExhausted`), are counted in
``lease_permanent_errors_total`` too, logged as errors rather than warnings, and say so in
their line, so an operator that can never lead is told apart from a flaky API.

Observers. :meth:`LeaseHolder.observe` registers a callable told of every lease holder of
this process that starts or stops leading (a :class:`LeadershipChange`): just *before* it
starts leading, and just *after* it has given up (a step-down, a stop, an abandoned stop),
so an interval between the two always covers the real leadership (not reconciles that
outlive their cancellation: they may still end after it). The chaos harness's replicas
report their leadership with it (:mod:`kopf_reconcile.testing.chaos.replica`). An observer
that raises is logged and changes nothing of the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import Awaitable, Callable
from typing import ClassVar

from kopf_reconcile.api import ConfigError
from kopf_reconcile.leader.protocol import (
    LeaderElector,
    LeaseContended,
    LeaseEpochExhausted,
    LeaseLost,
    LeaseToken,
    ReleaseAwareElector,
)
from kopf_reconcile.leader.timing import LeaseTiming
from kopf_reconcile.metrics import BoundMetrics
from kopf_reconcile.remote_errors import describe_error, is_permanent

logger = logging.getLogger("kopf_reconcile.leader")

ACQUIRE_RETRY_JITTER = 1.2  # client-go JitterFactor on RetryPeriod
MIN_RETRY = 0.01  # never spin on a lease reported as expiring right now


@dataclasses.dataclass(frozen=True)
class LeadershipChange:
    """A lease holder of this process starts (``leading``) or stops leading."""

    leading: bool
    reconciler_id: str
    epoch: int
    holder_id: str | None = None  # the holder of the term that starts or ends


LeadershipObserver = Callable[[LeadershipChange], None]


class LeaseHolder:
    """The acquire/renew/release loop of one reconciler's lease."""

    _observers: ClassVar[list[LeadershipObserver]] = []

    @classmethod
    def observe(cls, observer: LeadershipObserver) -> Callable[[], None]:
        """Tell ``observer`` whenever a lease holder of this process starts or stops leading.

        Called on the event loop, synchronously, so it must not block. Returns the
        function that stops the observing.
        """
        cls._observers.append(observer)

        def forget() -> None:
            with contextlib.suppress(ValueError):
                cls._observers.remove(observer)

        return forget

    def __init__(
        self,
        elector: LeaderElector,
        reconciler_id: str,
        *,
        name: str,
        timing: LeaseTiming,
        rng: random.Random,
        metrics: BoundMetrics,
        on_lead: Callable[[LeaseToken], None],
        on_lose: Callable[[], set[asyncio.Task[None]]],
        confirm: Callable[[LeaseToken], Awaitable[None]] | None = None,
        may_acquire: Callable[[], bool] | None = None,
    ) -> None:
        self._elector = elector
        self._reconciler_id = reconciler_id
        self._name = name
        self._ttl = timing.ttl
        self._renew_interval = timing.retry_period
        self._renew_deadline = timing.renew_deadline
        self._rng = rng
        self._metrics = metrics
        self._on_lead = on_lead
        self._on_lose = on_lose
        self._confirm = confirm
        # Asked before each acquire attempt (a shard's balance); None: always try.
        self._may_acquire = may_acquire
        self._clock = asyncio.get_running_loop().time
        self._token: LeaseToken | None = None
        self._leading = False
        self._epoch = 0
        self._holder_id: str | None = None
        self._valid_until = 0.0  # the local lease check: 0 once stepping down
        self._lease_until = 0.0  # a TTL after the last successful renewal was sent
        self._acquiring = False
        self._stopping = False
        self._step_down_reason: str | None = None
        self._refused: str | None = None  # why this lease can never lead (a ConfigError)
        self._early_wakeups = 0  # release wake-ups in a row that found the lease held
        self._recheck = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def leading(self) -> bool:
        return self._leading

    @property
    def holder_id(self) -> str | None:
        """The holder identity of the lease held last (None before any was taken)."""
        return self._holder_id

    @property
    def epoch(self) -> int:
        """The epoch of the lease held last (kept after stepping down, for logs and stats)."""
        return self._epoch

    def is_live(self, epoch: int) -> bool:
        """Whether the lease of ``epoch`` is held and within its renew deadline, locally."""
        return self._leading and self._epoch == epoch and self._clock() < self._valid_until

    def deadline_passed(self) -> bool:
        """True once no renewal succeeded within the renew deadline (e.g. after a stall)."""
        return self._clock() >= self._valid_until

    def step_down_soon(self, reason: str) -> None:
        """Ask the control plane to step down (and release) at once; idempotent."""
        if self._step_down_reason is None:
            self._step_down_reason = reason
        self._valid_until = 0.0  # nothing passes the local lease check from now on
        self._recheck.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"{self._name}: lease control plane")

    async def stop(self, guarded: set[asyncio.Task[None]] | None = None) -> None:
        """Stop acquiring and renewing; hand back the lease once ``guarded`` work has ended.

        ``guarded`` are the owner's cancelled reconciles that may still run; if one
        outlives the lease, the lease lapses instead of being released.
        """
        self._stopping = True
        if self._leading:  # logged before the release: a successor's "leads" comes after it
            logger.info(
                "%s stops leading %s (epoch %d): stopping",
                self._name,
                self._reconciler_id,
                self._epoch,
                extra={"controller": self._name, "epoch": self._epoch},
            )
        self._give_up_locally()
        if self._task is not None:
            if self._acquiring:
                await asyncio.wait({self._task}, timeout=self._renew_deadline)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._release_when_done(guarded or set())
        self._metrics.leader.set(0)

    def abandon(self) -> None:
        """Stop at once, without releasing: the lease lapses after its TTL (a cancelled stop)."""
        self._stopping = True
        self._give_up_locally()
        self._token = None
        if self._task is not None:
            self._task.cancel()

    # -- the control loop ----------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            if self._may_acquire is not None and not self._may_acquire():
                jitter = self._rng.uniform(1.0, ACQUIRE_RETRY_JITTER)
                await asyncio.sleep(self._renew_interval * jitter)
                continue
            sent = self._clock()
            self._acquiring = True
            retry_after: float | None = None
            try:
                # A lease taken just before this deadline is re-acquired as "still ours".
                async with asyncio.timeout(self._renew_deadline):
                    token = await self._elector.acquire_lease(self._reconciler_id)
            except LeaseContended as exc:
                logger.debug("%s: lease is held elsewhere: %s", self._name, exc)
                retry_after = exc.retry_after
            except Exception as exc:
                self._count_error(exc)
                logger.log(
                    _level(exc),
                    "%s: acquiring lease %s failed: %s",
                    self._name,
                    self._reconciler_id,
                    _explained(exc),
                    extra={"controller": self._name},
                )
            else:
                self._acquiring = False
                self._token = token
                if self._stopping:  # acquired while stop() waited: hand it back
                    await self._release()
                    return
                confirmed = await self._confirmed(token, sent)
                if confirmed is not None:
                    self._lead(token, confirmed)
                    await self._hold(token, confirmed)
                elif self._refused is not None:
                    return  # a configuration error: retrying cannot help
            self._acquiring = False
            retry = self._renew_interval * self._rng.uniform(1.0, ACQUIRE_RETRY_JITTER)
            if retry_after is not None:  # try again as the holder's lease runs out
                retry = min(retry, max(retry_after, 0.0) + MIN_RETRY)
                await self._wait_for_release(retry)
            else:
                await asyncio.sleep(retry)

    async def _wait_for_release(self, retry: float) -> None:
        """Sleep ``retry`` seconds, or less when the elector reports a release."""
        elector = self._elector
        if not isinstance(elector, ReleaseAwareElector):
            await asyncio.sleep(retry)
            return
        started = self._clock()
        try:
            async with asyncio.timeout(retry):
                await elector.wait_for_release(self._reconciler_id)
        except TimeoutError:
            self._early_wakeups = 0
            return
        except Exception as exc:
            # A failed wait is no news of a release: wait out the retry period.
            logger.debug("%s: waiting for a release failed: %r", self._name, exc)
            await asyncio.sleep(max(0.0, retry - (self._clock() - started)))
            return
        # Never spin: wake-ups that keep finding the lease held (anyone who can notify
        # the elector's channel can send them) space the attempts out, doubling up to
        # the retry period; a wait that ran its course starts again from MIN_RETRY.
        gap = min(retry, MIN_RETRY * 2**self._early_wakeups)
        self._early_wakeups = min(self._early_wakeups + 1, 30)
        await asyncio.sleep(max(0.0, gap - (self._clock() - started)))

    async def _confirmed(self, token: LeaseToken, sent: float) -> float | None:
        """Run the owner's confirmation (record the epoch), then re-check the lease.

        Returns when the last renewal that counts was sent (the lease's deadline runs
        from there), or ``None`` when this epoch must not lead.
        """
        if self._confirm is None:
            return sent
        try:
            async with asyncio.timeout(self._renew_deadline):
                await self._confirm(token)
                renewed = self._clock()
                await self._elector.renew_lease(token)
        except ConfigError as exc:
            self._refused = str(exc)
            logger.error(
                "%s cannot lead %s, and stops trying: %s",
                self._name,
                self._reconciler_id,
                exc,
                extra={"controller": self._name},
            )
            await self._release()
            return None
        except LeaseLost as exc:
            self._token = None
            logger.warning(
                "%s: lease %s at epoch %d was lost before leading: %s",
                self._name,
                self._reconciler_id,
                token.epoch,
                exc,
                extra={"controller": self._name},
            )
            return None
        except Exception as exc:
            self._count_error(exc)
            logger.warning(
                "%s: cannot confirm lease %s at epoch %d, handing it back: %s",
                self._name,
                self._reconciler_id,
                token.epoch,
                _explained(exc),
                extra={"controller": self._name},
            )
            await self._release()
            return None
        return renewed

    def _count_error(self, exc: Exception) -> None:
        self._metrics.lease_errors.inc()
        if _needs_a_person(exc):
            self._metrics.lease_permanent_errors.inc()

    def _lead(self, token: LeaseToken, sent: float) -> None:
        self._notify(LeadershipChange(True, token.reconciler_id, token.epoch, token.holder_id))
        self._early_wakeups = 0
        self._epoch = token.epoch
        self._holder_id = token.holder_id
        self._valid_until = sent + self._renew_deadline
        self._lease_until = sent + self._ttl
        self._step_down_reason = None
        self._recheck.clear()
        self._leading = True
        self._metrics.leader.set(1)
        self._metrics.epoch.set(token.epoch)
        self._metrics.lease_transitions.inc()
        logger.info(
            "%s leads %s as %s (epoch %d)",
            self._name,
            token.reconciler_id,
            token.holder_id,
            token.epoch,
            extra={"controller": self._name, "epoch": token.epoch},
        )
        self._on_lead(token)

    async def _hold(self, token: LeaseToken, last_ok: float) -> None:
        """Renew until the lease is lost, the deadline passes or a step-down is asked for."""
        while True:
            remaining = last_ok + self._renew_deadline - self._clock()
            if self._step_down_reason is None and remaining > 0:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(self._renew_interval, remaining)):
                        await self._recheck.wait()
            if self._step_down_reason is not None:
                await self._step_down(self._step_down_reason, release=True)
                return
            remaining = last_ok + self._renew_deadline - self._clock()
            if remaining <= 0:
                await self._step_down("no renewal succeeded within the renew deadline", True)
                return
            sent = self._clock()
            try:
                async with asyncio.timeout(remaining):
                    await self._elector.renew_lease(token)
            except LeaseLost as exc:
                await self._step_down(f"lease lost: {exc}", release=False)
                return
            except Exception as exc:
                self._count_error(exc)
                logger.log(
                    _level(exc),
                    "%s: renewing lease %s failed (%.1fs left before stepping down): %s",
                    self._name,
                    self._reconciler_id,
                    max(0.0, last_ok + self._renew_deadline - self._clock()),
                    _explained(exc),
                    extra={"controller": self._name},
                )
            else:
                last_ok = sent
                self._lease_until = sent + self._ttl
                if self._step_down_reason is None:
                    self._valid_until = sent + self._renew_deadline
                self._metrics.lease_renew.observe(self._clock() - sent)

    async def _step_down(self, reason: str, release: bool) -> None:
        self._give_up_locally()
        logger.warning(
            "%s steps down from %s (epoch %d): %s",
            self._name,
            self._reconciler_id,
            self._epoch,
            reason,
            extra={"controller": self._name, "epoch": self._epoch},
        )
        running = self._on_lose()
        if release:
            await self._release_when_done(running)
        self._token = None

    def _give_up_locally(self) -> None:
        """From now on nothing of this process passes the local lease check."""
        was_leading = self._leading
        self._leading = False
        self._valid_until = 0.0
        self._metrics.leader.set(0)
        if was_leading:
            change = LeadershipChange(False, self._reconciler_id, self._epoch, self._holder_id)
            self._notify(change)

    def _notify(self, change: LeadershipChange) -> None:
        for observer in tuple(self._observers):
            try:
                observer(change)
            except Exception:
                logger.exception("%s: a leadership observer failed", self._name)

    async def _release_when_done(self, guarded: set[asyncio.Task[None]]) -> None:
        """Release once ``guarded`` work has ended, if that happens while the lease is live.

        Otherwise keep quiet and let the lease lapse: a peer takes over only after
        the TTL, never at once while this process may still be inside a reconcile.
        (Releasing after the work ended is safe at any time; waiting past the TTL
        is pointless, the lease may be someone else's by then.)
        """
        if self._token is None:
            return
        pending = {task for task in guarded if not task.done()}
        if pending:
            remaining = self._lease_until - self._clock()
            if remaining > 0:
                _, pending = await asyncio.wait(pending, timeout=remaining)
        if pending:
            logger.error(
                "%s: %d reconcile(s) still run after cancellation; not releasing lease %s "
                "(epoch %d): it lapses after its ttl instead",
                self._name,
                len(pending),
                self._reconciler_id,
                self._epoch,
                extra={"controller": self._name, "epoch": self._epoch},
            )
            self._token = None
            return
        await self._release()

    async def _release(self) -> None:
        token = self._token
        if token is None:
            return
        try:
            async with asyncio.timeout(self._renew_deadline):
                await self._elector.release_lease(token)
        except Exception as exc:
            logger.warning(
                "%s: releasing lease %s failed (it will expire by itself): %s",
                self._name,
                self._reconciler_id,
                _explained(exc),
                extra={"controller": self._name},
            )
        # Only now: a release cancelled half-way is retried by stop().
        self._token = None


def _level(exc: BaseException) -> int:
    """An error for a refusal that retrying cannot fix (it needs a person), else a warning."""
    return logging.ERROR if _needs_a_person(exc) else logging.WARNING


def _needs_a_person(exc: BaseException) -> bool:
    """A refusal by the server (a 4xx no retry fixes), or a lease record with no epoch left."""
    return is_permanent(exc) or isinstance(exc, LeaseEpochExhausted)


def _explained(exc: BaseException) -> str:
    """The error on one line; a permanent one says that retrying will not fix it."""
    text = describe_error(exc)
    if is_permanent(exc):
        text += " (refused by the server: retrying cannot help until this is fixed)"
    elif isinstance(exc, LeaseEpochExhausted):
        text += " (retrying cannot help until the record is repaired)"
    return text
