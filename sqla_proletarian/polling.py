"""The poll loop's decisions, one set for the threaded worker and the asyncio worker.

A poller (a worker thread, a worker task, or lease mode's one poller that feeds the threads)
calls ``step()`` in a loop: it polls once and says what comes next, a ``Decision``: poll again
at once (``Ran``), wait for a wake-up at most so long (``Idle``), wait out a transient error
(``Backoff``), or stop the worker (``Stop``). The workers only do the waiting: a thread
blocks, a task awaits, and the asyncio worker runs each step in a greenlet, where
``await_only`` awaits what an ``async def`` on_polling_error returns.

Transaction mode: one idle poller at a time, the watcher, polls for all of them while the
others wait for a wake-up; under LISTEN it waits until the queue's next job is due. Lease
mode: each poller waits on its own.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sqla_proletarian import wakeups
from sqla_proletarian.errors import is_transient, polling_error_hint, transient_hint
from sqla_proletarian.leases import LeaseRunner
from sqla_proletarian.logs import Outage, log_event

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from sqla_proletarian.execution import JobRunner
    from sqla_proletarian.feeder import Feeder
    from sqla_proletarian.leases import LeaseConnections
    from sqla_proletarian.options import WorkerOptions
    from sqla_proletarian.periodic import Scheduler
    from sqla_proletarian.running import RunnerBase

#: Seconds an idle worker waits between polls while LISTEN/NOTIFY wakes it (PostgreSQL,
#: transaction mode), unless a job is due sooner: a committed job wakes it at once, and a job
#: scheduled for later (a retry, an expired lease) wakes it when due, so this is only a safety
#: net for what no notification announces. Never shorter than ``polling_interval``.
LISTENING_POLL_INTERVAL = 10.0
#: Seconds an idle worker sleeps past a job's due time, so that its poll finds it due.
DUE_MARGIN = 0.002
#: Longest pause between attempts to poll while the database is unreachable.
MAX_TRANSIENT_BACKOFF = 5.0
#: The first pause after a transient error; each further one doubles, up to the maximum.
MIN_TRANSIENT_BACKOFF = 0.05


# --- the pause rules -------------------------------------------------------------------------


def next_backoff(previous: float) -> float:
    """The pause after a transient error, given the previous one (0 after a success)."""
    return min(MAX_TRANSIENT_BACKOFF, max(MIN_TRANSIENT_BACKOFF, previous * 2))


def transient_backoff(outage: Outage, exc: Exception, backoff: float) -> tuple[float, float]:
    """Count a transient polling error in the worker's outage (which logs it, or not); the
    next backoff, and the jittered pause to take now."""
    backoff = next_backoff(backoff)
    outage.failed(exc, transient_hint(exc), retry_in=round(backoff, 3))
    return backoff, backoff * random.uniform(0.5, 1.0)


def polling_pause(burst: int, polling_interval: float) -> tuple[int, float]:
    """The pause of an idle poller, and the short waits left after it: after an in-process
    wake-up (``burst`` waits left) the next of ``wakeups.BURST``, else the polling interval."""
    if burst:
        return burst - 1, wakeups.BURST[len(wakeups.BURST) - burst]
    return 0, polling_interval


def listening_pause(
    options: WorkerOptions, scheduler: Scheduler | None, runner: RunnerBase, conn: Connection
) -> float:
    """The pause of an idle watcher that LISTEN/NOTIFY wakes for every committed job: until
    the queue's next job (read on ``conn``) or periodic occurrence is due, at most
    ``LISTENING_POLL_INTERVAL``, at least the polling interval once a job is due."""
    interval = options.polling_interval
    pause = max(LISTENING_POLL_INTERVAL, interval)
    if scheduler is not None:
        look = scheduler.next_look()
        if look is not None:
            pause = min(pause, max(look, interval))
    due = runner.next_due(conn)
    if due is not None:
        wait = (due - runner.now()).total_seconds()
        # Due already (running in another transaction, or held): poll as usual.
        pause = min(pause, wait + DUE_MARGIN if wait > 0 else interval)
    return float(pause)


# --- the decisions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ran:
    """Jobs were run (or claimed, with room for more): poll again at once."""


@dataclass(frozen=True)
class Idle:
    """Nothing to do: wait for a wake-up, ``pause`` seconds at most (None: no limit, while
    the watcher polls for this poller)."""

    pause: float | None


@dataclass(frozen=True)
class Backoff:
    """A transient error: wait ``pause`` seconds; only a stop ends the wait early."""

    pause: float


@dataclass(frozen=True)
class Stop:
    """A polling error that on_polling_error stops on: the worker stops because of it."""

    error: Exception


Decision = Ran | Idle | Backoff | Stop

RAN = Ran()


class Listening(Protocol):
    """A worker's LISTEN listener, as the pause rules see it."""

    listening: bool


class Polling:
    """What a worker's pollers share: the pause rules with the worker's options, the short
    waits left after an in-process enqueue, and the watcher.

    ``current`` gives the calling poller (a thread, a task); ``guard`` is held while the
    watcher changes hands (the threads' lock; tasks of one event loop need none);
    ``wake_all`` ends every idle poller's wait, ``wake_one`` one's (by default every one's);
    ``listener`` gives the worker's LISTEN
    listener, if it has one; ``await_result`` awaits what on_polling_error returned when it
    is awaitable (asyncio; the threaded worker gives none).
    """

    def __init__(
        self,
        options: WorkerOptions,
        runner: JobRunner | LeaseRunner,
        scheduler: Scheduler | None,
        *,
        current: Callable[[], object],
        wake_all: Callable[[], None],
        listener: Callable[[], Listening | None],
        wake_one: Callable[[], None] | None = None,
        guard: AbstractContextManager[Any] | None = None,
        await_result: Callable[[Any], Any] | None = None,
    ) -> None:
        self.worker_id = options.worker_id or ""
        self.options = options
        self.runner = runner
        self.scheduler = scheduler
        #: The run of failed polls the pollers are in, if any (logged as one outage).
        self.outage = Outage("transient-polling-error", worker_id=self.worker_id)
        #: Transaction mode: one idle poller at a time (the watcher) polls for all of them.
        #: Lease mode: each idle poller polls on its own.
        self.shared_idle = options.lease_seconds is None
        #: Short waits left after an in-process wake-up (the enqueue may not be visible yet).
        self.burst = 0
        self.watcher: object | None = None
        self._current = current
        self._wake_all = wake_all
        self._wake_one = wake_one
        self._listener = listener
        self._guard: AbstractContextManager[Any] = guard if guard is not None else nullcontext()
        self._await_result = await_result
        #: Claims begun, and those under way (with their runs, but for the lease-mode
        #: poller's, whose runs the runner holds): what a burst checks (``activity``).
        self._claims = 0
        self._claiming = 0
        self._claims_lock = threading.Lock()
        if self.shared_idle:
            runner.on_claim = self.end_watch

    @contextlib.contextmanager
    def claiming(self) -> Iterator[None]:
        """Around a poll that may enqueue periodic jobs, claim jobs and run them."""
        with self._claims_lock:
            self._claims += 1
            self._claiming += 1
        try:
            yield
        finally:
            with self._claims_lock:
                self._claiming -= 1

    def activity(self) -> int | None:
        """How many polls have begun, or None while one is under way or a job claimed has
        not ended (lease mode: its lease is held). The same number before and after a look
        at the queues means the worker claimed and ended nothing meanwhile: a burst that
        found no job due then has drained them (a leased job is not due, yet not done)."""
        with self._claims_lock:
            if self._claiming:
                return None
            claims = self._claims
        runner = self.runner
        held = runner.in_flight() if isinstance(runner, LeaseRunner) else 0
        with self._claims_lock:
            return None if held or self._claiming or claims != self._claims else claims

    def enqueued(self, committing: bool) -> None:
        """An enqueue in this process woke the worker: while its transaction is committing,
        the next pauses are the short ones of ``wakeups.BURST``, until the commit shows."""
        if committing:
            self.burst = len(wakeups.BURST)

    def own_pause(self) -> float:
        """The pause of a poller that polls on its own (see ``polling_pause``)."""
        self.burst, pause = polling_pause(self.burst, self.options.polling_interval)
        return pause

    def idle_pause(self, connections: Any) -> float | None:
        """After an empty poll: how long the calling poller waits before polling again, or
        None to wait for a wake-up while another idle poller, the watcher, polls for all."""
        if not self.shared_idle:
            return self.own_pause()
        with self._guard:
            current = self._current()
            if self.watcher is None:
                self.watcher = current
            elif self.watcher is not current:
                return None
        listener = self._listener()
        if self.burst or listener is None or not listener.listening:
            return self.own_pause()
        return listening_pause(self.options, self.scheduler, self.runner, connections.conn)

    def drained_pause(self, feeder: Feeder, connections: LeaseConnections) -> float:
        """How long the poller of a drained queue waits: a few short waits after an
        in-process enqueue; else as a listening watcher (listening_pause) while LISTEN is in
        effect, the polling interval while it is not (no listener, or its connection is being
        made again); never past the queue's next due time (a scheduled job,
        an expiring lease)."""
        interval = self.options.polling_interval
        if self.burst:
            return self.own_pause()
        listener = self._listener()
        if listener is not None and listener.listening:
            return listening_pause(self.options, self.scheduler, feeder.runner, connections.conn)
        due_in = feeder.next_due_in(connections)
        if due_in is None:
            return interval
        return min(interval, due_in + DUE_MARGIN if due_in > 0 else interval)

    def end_watch(self) -> None:
        """The calling poller claimed jobs: more may be due. With ``wake_one``, another idle
        poller polls (and, claiming, wakes the next); without, if the caller was the
        watcher, every idle poller polls. The first to find the queue empty watches next."""
        with self._guard:
            was_watching = self.watcher is not None and self.watcher is self._current()
            if was_watching:
                self.watcher = None
                if self._wake_one is None:
                    self._wake_all()
        if self._wake_one is not None:
            self._wake_one()

    def polling_error(self, exc: Exception) -> bool:
        """Log a polling error that is not transient and hand it to on_polling_error; True
        means stop (so does an on_polling_error that raises)."""
        log_event(
            logging.ERROR,
            "polling-error",
            worker_id=self.worker_id,
            error=repr(exc),
            hint=polling_error_hint(exc),
        )
        try:
            result = self.options.on_polling_error(exc)
            if self._await_result is not None and inspect.isawaitable(result):
                result = self._await_result(result)
            return bool(result)
        except Exception as error:
            log_event(
                logging.ERROR,
                "polling-error-handler-error",
                worker_id=self.worker_id,
                error=repr(error),
            )
            return True


# --- the pollers -----------------------------------------------------------------------------


class _Poller:
    """A poller's own state: its backoff after transient errors."""

    def __init__(self, polling: Polling) -> None:
        self.polling = polling
        self.backoff = 0.0

    def _failed(self, exc: Exception, pause: Callable[[], float]) -> Decision:
        """After a failed poll: back off if the error is transient; else stop, or wait
        ``pause()``, as on_polling_error says."""
        if is_transient(exc):
            self.backoff, wait = transient_backoff(self.polling.outage, exc, self.backoff)
            return Backoff(wait)
        if self.polling.polling_error(exc):
            return Stop(exc)
        return Idle(pause())

    def announced(self) -> None:
        """A job was announced while the loop waited (Poll: its next claim polls at once)."""

    def _succeeded(self, began: float) -> None:
        """A poll that ``began`` then worked: the backoff starts again from the minimum; an
        outage that began before it is over."""
        self.backoff = 0.0
        self.polling.outage.ended(began)


class Poll(_Poller):
    """A worker thread's or task's poll loop: claim and run jobs on its own connections,
    opened at the first poll and again after an error."""

    def __init__(self, polling: Polling) -> None:
        super().__init__(polling)
        self.connections: Any = None

    def step(self) -> Decision:
        """Poll once: the periodic jobs' tick, then a due job run (or a batch)."""
        polling = self.polling
        began = polling.outage.now()
        try:
            if self.connections is None:
                self.connections = polling.runner.open_connections()
            with polling.claiming():
                if polling.scheduler is not None:
                    polling.scheduler.tick(self.connections.conn)
                polling.runner.sweep(self.connections.conn)
                ran = polling.runner.process_one(self.connections)
            decision: Decision = RAN if ran else Idle(polling.idle_pause(self.connections))
        except Exception as exc:
            self._close()
            return self._failed(exc, polling.own_pause)
        self._succeeded(began)
        return decision

    def announced(self) -> None:
        """A job was announced while the thread was idle: its next claim polls at once."""
        if self.connections is not None:
            self.connections.announced = True

    def end(self) -> None:
        """The loop is over: hand the watch on, close the connections."""
        self.polling.end_watch()
        self._close()

    def _close(self) -> None:
        if self.connections is not None:
            self.connections.close()
            self.connections = None


class Feed(_Poller):
    """Lease mode's one poller of the threaded worker: claim jobs into the threads' queue
    while they have room; with the queue drained, wait alone (``Polling.drained_pause``).
    Its waits end when a thread becomes free (the feeder's wake-up event)."""

    def __init__(self, polling: Polling, feeder: Feeder) -> None:
        super().__init__(polling)
        self.feeder = feeder
        self.connections = feeder.runner.open_connections()

    def step(self) -> Decision:
        """Claim once if a thread has room, else give the connection back."""
        polling, feeder, connections = self.polling, self.feeder, self.connections
        # Every thread busy: a thread that becomes free wakes the poller.
        pause, claimed = LISTENING_POLL_INTERVAL, False
        began = polling.outage.now()
        try:
            if feeder.room():
                with polling.claiming():
                    if polling.scheduler is not None:
                        polling.scheduler.tick(connections.conn)
                    feeder.runner.sweep(connections.conn)
                    claimed = feeder.claim(connections) > 0
                if not claimed:
                    pause = polling.drained_pause(feeder, connections)
            else:
                connections.release()
        except Exception as exc:
            connections.close()
            return self._failed(exc, lambda: polling.options.polling_interval)
        self._succeeded(began)
        if claimed and feeder.room():
            return RAN  # a thread is still free: claim again now
        return Idle(pause)

    def end(self) -> None:
        """The loop is over: close the connection, give back the leases not started."""
        self.connections.close()
        self.feeder.end()
