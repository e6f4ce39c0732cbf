"""Lease mode: a claim commits a lease at once, and the handler runs with no transaction open.

A claim locks due jobs (``FOR UPDATE SKIP LOCKED``), writes a lease on each (a fresh token,
the worker, attempts + 1, and ``process_at`` moved to the lease's expiry, so that no poll of
either mode reads the job while the lease lives) and commits. The worker's heartbeat renews
all its leases in one statement every ``heartbeat_interval``; a lease that expired (its
worker died or froze) is due again for any worker's ordinary poll, which counts an unclean
end. The handler's ``job.session`` takes a connection on first use; the job is completed in
that transaction (delete where the row still carries the run's token, archive) and it
commits: a run whose lease another run took by then removes nothing and rolls back, so its
writes never commit and the job is archived once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar, cast

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session

from sqla_proletarian import direct, ledger, telemetry, workflows
from sqla_proletarian import statements as sql
from sqla_proletarian.dialects import Dialect
from sqla_proletarian.errors import (
    ConfigurationError,
    JobCrashedError,
    JobTimeoutError,
    Snooze,
    connection_loss_hint,
    driver_error,
    idle_limit_hit,
    idle_transaction_limit,
    is_transient,
    mysql_errno,
    sqlstate,
)
from sqla_proletarian.execution import JobRunner, poll_queues
from sqla_proletarian.flow import too_late
from sqla_proletarian.handlers import JobContext, JobSession, SessionOnFirstUse, StopSignal
from sqla_proletarian.logs import log_event, logger
from sqla_proletarian.running import (
    Failure,
    Outcome,
    QueueEnds,
    RunnerBase,
    RunSettings,
    describe,
    rollback_quietly,
)

#: Seconds between looks at the running jobs' timeouts (their heartbeats go by their own
#: interval).
TIMEOUT_CHECK = 0.1
#: Seconds between attempts to give a lease back, or to complete deferred successes, while
#: the database is out of reach.
GIVE_BACK_PAUSE = 0.5
#: Seconds close() waits at least for a timed-out job's outcome to be written.
OUTCOME_WAIT = 10.0
#: How many times in a row a claim, a heartbeat or a grouped completion is made when its
#: transaction loses a race with another (``lost_race``), and the longest pause between two
#: tries (the first is at once, the next after ``CONFLICT_PAUSE`` doubled, with jitter; see
#: ``LeaseRunner._again_when_lost``): about two seconds in all.
CONFLICT_TRIES = 16
CONFLICT_PAUSE = 0.005
MAX_CONFLICT_PAUSE = 0.2

T = TypeVar("T")


def lost_race(exc: BaseException) -> bool:
    """Whether a transaction was rolled back whole by a conflict with another one, so the
    same work can be made again at once: a deadlock (on a Galera cluster also a failed
    certification, or an abort by another node's write: error 1213 both) or a serialization
    failure. Not a lock wait timeout: that lock is still held, and the poller's backoff
    waits for it."""
    orig = driver_error(exc)
    return orig is not None and (sqlstate(orig) in ("40001", "40P01") or mysql_errno(orig) == 1213)


class LeaseSession(JobSession):
    """A leased job's Session: it takes a connection and opens the job's transaction on
    first use (no connection is held while the handler does not use it). What the handler
    writes is inside the worker's savepoint of that transaction, as in transaction mode; the
    worker completes the job in the same transaction."""

    def __init__(self, engine: Engine, dialect: Dialect) -> None:
        self._engine = engine
        self._dialect = dialect
        self._stack = ExitStack()
        self._conn: Connection | None = None
        self._handling = False
        #: When the job's connection was taken, and last ran a statement (time.monotonic()).
        self.opened_at = 0.0
        self.last_used = 0.0
        #: Why the job's connection could not be taken, if it could not.
        self.open_error: Exception | None = None
        super().__init__(None)  # type: ignore[arg-type]

    @property
    def bind(self) -> Connection | None:
        """The job's connection, taken on first use."""
        if getattr(self, "_closed", False) and self._conn is None:
            return None
        return self.job_connection

    @bind.setter
    def bind(self, value: object) -> None:
        """Session.__init__ sets it; the connection is the session's own."""

    @property
    def job_connection(self) -> Connection:
        if self._conn is None:
            self._conn = self._open()
            self.opened_at = self.last_used = time.monotonic()
        return self._conn

    @job_connection.setter
    def job_connection(self, value: object) -> None:
        """JobSession.__init__ sets it; the connection is taken on first use."""

    def _open(self) -> Connection:
        """A connection of the pool in a transaction; a second try if the pool's was dead
        (a session the server ended since it was pooled), so the handler does not fail."""
        for last in (False, True):
            try:
                conn = self._stack.enter_context(self._dialect.claim_connection(self._engine))
                self._dialect.begin_claim(conn)
                event.listen(conn, "after_cursor_execute", self._used)
                return conn
            except Exception as exc:
                with contextlib.suppress(Exception):
                    self._stack.close()
                if last or not is_transient(exc):
                    self.open_error = exc
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    @property
    def opened(self) -> bool:
        """Whether the job's connection was taken."""
        return self._conn is not None

    def _used(self, *args: object) -> None:
        """After each statement on the job's connection: when it last did something."""
        self.last_used = time.monotonic()

    @property
    def lost(self) -> bool:
        """Whether the job's connection was lost (or could not be taken: the server was out
        of reach)."""
        if self._conn is None:
            return self.open_error is not None and is_transient(self.open_error)
        return self._conn.invalidated

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """While the handler runs (the savepoint opens with the connection: see get_bind)."""
        self._handling = True
        try:
            yield
        finally:
            self._handling = False

    def outcome_connection(self) -> Connection:
        """The connection the job's outcome is written on, in a transaction (a fresh one if
        the session's was lost)."""
        if self.lost:
            self.release()
            self.open_error = None
        conn = self.job_connection
        if not conn.in_transaction():
            self._dialect.begin_claim(conn)
        return conn

    def abandon(self) -> None:
        """Roll back everything the session's transaction holds (the handler's writes)."""
        with contextlib.suppress(Exception):
            JobSession.close(self)
        if self._conn is not None:
            rollback_quietly(self._conn)

    def release(self) -> None:
        """Close the session for good and give its connection back to the pool."""
        self.abandon()
        try:
            self._stack.close()
        except Exception as exc:
            log_event(logging.DEBUG, "connection-close-error", error=repr(exc))
        self._conn = None


class RunSession:
    """A leased run's LeaseSession, made on first need: a run whose handler never reads
    ``job.session`` (nor writes its outcome through it) makes none, so there is nothing to
    finish or release. One made after the run was released is released at once."""

    __slots__ = ("_dialect", "_engine", "_released", "session")

    def __init__(self, engine: Engine, dialect: Dialect) -> None:
        self._engine = engine
        self._dialect = dialect
        self._released = False
        self.session: LeaseSession | None = None

    def made(self) -> LeaseSession:
        """The session, made now if it was not."""
        if self.session is None:
            self.session = LeaseSession(self._engine, self._dialect)
            if self._released:
                self.session.release()
        return self.session

    @property
    def opened(self) -> bool:
        return self.session is not None and self.session.opened

    @property
    def lost(self) -> bool:
        return self.session is not None and self.session.lost

    @property
    def last_used(self) -> float:
        return self.session.last_used if self.session is not None else 0.0

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """While the handler runs (see LeaseSession.handling)."""
        if self.session is None:
            yield
            return
        with self.session.handling():
            yield

    def finish(self) -> None:
        if self.session is not None:
            self.session.finish()

    def outcome_connection(self) -> Connection:
        return self.made().outcome_connection()

    def abandon(self) -> None:
        if self.session is not None:
            self.session.abandon()

    def release(self) -> None:
        self._released = True
        if self.session is not None:
            self.session.release()


class LeaseConnections:
    """A thread's claim connection in lease mode: taken for a claim (and the periodic jobs'
    check), given back before any handler runs."""

    def __init__(self, engine: Engine, dialect: Dialect) -> None:
        self._engine = engine
        self._dialect = dialect
        self._stack = ExitStack()
        self._conn: Connection | None = None
        #: Whether the thread's last claim took a job (no read of the queues first next time;
        #: nor at a thread's first claim, but on SQLite, where that read keeps an idle claim
        #: from taking the write lock).
        self.claimed_last = not dialect.claim_takes_write_lock
        #: The queues' ends read by the last claim, if it read them (``next_due_on``).
        self.ends: QueueEnds | None = None

    @property
    def conn(self) -> Connection:
        if self._conn is None:
            self._conn = self._stack.enter_context(self._dialect.claim_connection(self._engine))
        return self._conn

    def release(self) -> None:
        """Give the connection back to the pool (it is taken again when next needed)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            self._stack.close()
        except Exception as exc:
            log_event(logging.DEBUG, "connection-close-error", error=repr(exc))

    def close(self) -> None:
        self.release()

    def __enter__(self) -> LeaseConnections:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


#: "done": succeeded with nothing written through its session, its completion deferred to
#: the end of its batch (its lease is renewed until then).
RunState = Literal["claimed", "running", "ending", "done"]


@dataclass(eq=False)
class LeasedRun:
    """One job under this worker's lease, from its claim until its outcome is written."""

    job: dict[str, Any]
    token: uuid.UUID
    #: Unclean ends of the job's earlier runs, this claim's count included.
    unclean_ends: int
    #: Whether the job has run records of transaction-mode runs (removed when it ends).
    had_runs: bool
    signal: StopSignal = field(default_factory=StopSignal)
    state: RunState = "claimed"
    started: float = field(default_factory=time.monotonic)
    context: JobContext | None = None
    claimed_at: datetime | None = None
    #: Whether its lease was given back (released or ended to be counted).
    released: bool = False
    #: Whether its handler was started (a lease given back then keeps the run's count).
    ran: bool = False
    #: The job's session while its handler runs.
    session: RunSession | None = None
    #: The handler's serialized result (None: it returned None).
    result: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def job_id(self) -> uuid.UUID:
        return self.job["job_id"]  # type: ignore[no-any-return]

    def start(self) -> None:
        with self._lock:
            self.state = "running"
            self.ran = True
            self.started = time.monotonic()

    def begin_ending(self) -> bool:
        """Take the right to write the run's outcome; False if another path took it (the
        timeout, or a stop that released the lease)."""
        with self._lock:
            if self.state in ("ending", "done"):
                return False
            self.state = "ending"
            return True

    def defer(self) -> None:
        """Succeeded; completed with its batch's other such jobs at the batch's end."""
        with self._lock:
            self.state = "done"


class LeaseRunner(RunnerBase):
    """Claims jobs under leases and runs their handlers with no transaction open.
    Thread-safe; shared by a worker's threads (or tasks), with one heartbeat for all."""

    def _set_up(self) -> None:
        settings = self.settings
        assert settings.lease_seconds is not None
        self._lease = timedelta(seconds=settings.lease_seconds)
        self.heartbeat_interval = settings.heartbeat_interval or settings.lease_seconds / 3
        #: Run records of transaction-mode runs are read (and counted) only where they exist.
        self._with_runs = settings.max_unclean_ends is not None
        self._runs: dict[uuid.UUID, LeasedRun] = {}
        self._runs_lock = threading.Lock()
        self._next_beat = time.monotonic() + self.heartbeat_interval
        self._upkeep_lock = self._new_lock()
        self._closed = threading.Event()
        self._keeper: threading.Thread | None = None
        #: The server's idle-transaction limit, once read (0: none).
        self._idle_timeout: tuple[float] | None = None
        #: Where a timed-out job's outcome is written (and an in-doubt claim given back): a
        #: thread of its own, or the asyncio worker's task (``spawn``).
        self._outcome_threads: list[threading.Thread] = []
        self._spawn = self._spawner or self._spawn_thread

    # --- what the workers call --------------------------------------------------------------

    connections_per_thread = 1
    #: The heartbeat's connection, taken for each renewal.
    shared_connections = 1

    @property
    def upkeep_interval(self) -> float:
        """Seconds between calls of keep_owner() (heartbeats, timeouts)."""
        if self.settings.times_out:
            return min(self.heartbeat_interval, TIMEOUT_CHECK)
        return self.heartbeat_interval

    def keep_owner(self) -> None:
        """Renew the leases when a heartbeat is due, and time out jobs past job_timeout. A
        heartbeat that fails is logged and tried again at the next interval."""
        with self._upkeep_lock:
            if time.monotonic() >= self._next_beat:
                self._next_beat = time.monotonic() + self.heartbeat_interval
                try:
                    self._again_when_lost("heartbeat", self._beat)
                except Exception as exc:
                    log_event(
                        logging.WARNING,
                        "heartbeat-error",
                        worker_id=self.settings.worker_id,
                        error=repr(exc),
                        hint="the leases were not renewed; the next heartbeat tries again "
                        "(a lease expires after lease_seconds without one)",
                    )
            if self.settings.times_out:
                self._time_out()

    def start_keeping_owner(self) -> None:
        """Run the heartbeat from a thread of its own until close()."""
        if self._keeper is not None:
            return
        self._closed.clear()

        def beat_until_closed() -> None:
            while not self._closed.wait(self.upkeep_interval):
                try:
                    self.keep_owner()
                except Exception as exc:
                    log_event(logging.ERROR, "lease-upkeep-error", error=repr(exc))

        self._keeper = threading.Thread(
            target=beat_until_closed, name=f"{self.settings.worker_id}-heartbeat", daemon=True
        )
        self._keeper.start()

    def close(self) -> None:
        """Wait for the timed-out jobs' outcomes, then stop the heartbeat (after the last
        claim): it renews their leases until they are written."""
        with self._runs_lock:
            outcomes, self._outcome_threads = self._outcome_threads, []
        for thread in outcomes:
            if thread is not threading.current_thread():
                thread.join(timeout=max(self._lease.total_seconds(), OUTCOME_WAIT))
        self._closed.set()
        keeper, self._keeper = self._keeper, None
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(timeout=5)

    def open_connections(self) -> LeaseConnections:
        return LeaseConnections(self.engine, self.dialect)

    def process_one(self, connections: Any = None) -> bool:
        """Claim and run at most one claim's jobs; True if a job was claimed."""
        if connections is not None:
            return self._claim_and_run(connections)
        try:
            self.start_keeping_owner()
            with self.open_connections() as opened:
                return self._claim_and_run(opened)
        finally:
            self.close()

    def in_flight(self) -> int:
        """How many runs hold this worker's leases: claimed, running, or waiting for their
        completion to be written (a burst waits for them)."""
        return len(self._running())

    def abandon_in_flight(self) -> int:
        """Release the leases of the handlers still running when a stop gives up on them:
        their jobs are due again at once, without an unclean end, and each handler is asked
        to stop; their late outcomes are fenced off. How many runs were given up."""
        released = [run for run in self._running() if run.begin_ending()]
        if released:
            self._release_abandoned(released)
        return len(released)

    def _release_abandoned(self, released: list[LeasedRun]) -> None:
        """Ask the abandoned runs' handlers to stop and give their leases back."""
        for run in released:
            run.signal.request("stopping")
        # SQLite: a handler whose session is open holds the database's write lock, so its
        # lease is released when it returns (see _end); nothing could be written before.
        locked = [
            run
            for run in released
            if self.dialect.claim_takes_write_lock
            and run.session is not None
            and run.session.opened
        ]
        released = [run for run in released if run not in locked]
        self._forget(*locked)
        if not released:
            return
        try:
            with self._short_transaction() as conn:
                for ran in (False, True):
                    runs = [run for run in released if run.ran == ran]
                    if runs:
                        conn.execute(*self._released(runs, ran=ran))
        except Exception as exc:
            # Its late end tries again.
            log_event(logging.WARNING, "lease-release-error", error=repr(exc))
            return
        finally:
            self._forget(*released)
        for run in released:
            run.released = True
        log_event(
            logging.INFO,
            "leases-released",
            worker_id=self.settings.worker_id,
            jobs=len(released),
            hint="their jobs are due again at once, without an unclean end (a run that had "
            "started is counted in attempts, not as a retry); what their handlers still write "
            "through job.session is discarded",
        )

    # --- what a worker's poller and its threads call (feeder) ---------------------------

    def run_claimed(self, run: LeasedRun, defer: Callable[[LeasedRun], None] | None) -> None:
        """Run a job the poller claimed, unless its lease was found gone meanwhile."""
        if run.signal.reason == "lease-lost":
            self._fenced(run)
            return
        self._run(run, defer)

    def give_back(self, runs: list[LeasedRun]) -> None:
        """Give claimed leases back unrun and uncharged (a stop came before they started)."""
        if runs:
            self._release(runs)

    def complete(self, runs: list[LeasedRun]) -> bool:
        """Archive deferred successes together (see _complete_together); True if they
        could not be and their leases were given back (the jobs are due again now)."""
        return self._complete_together(runs)

    def next_due_on(self, connections: LeaseConnections) -> datetime | None:
        """When the queue's next job is due, a leased one's expiry included (None: none),
        read on the poller's connection (given back after on SQLite); after a claim that
        read the queues' ends and took nothing, from what it read, unless a queue has
        several priorities."""
        ends, connections.ends = connections.ends, None
        if ends is not None:
            earliest, unseen = ends.next_due()
            if not unseen:
                return earliest
        try:
            return self.next_due(connections.conn)
        finally:
            if self.dialect.claim_takes_write_lock:
                connections.release()

    # --- the claim --------------------------------------------------------------------------

    def _claim_and_run(self, connections: LeaseConnections) -> bool:
        if self._stopping():
            return False
        runs = self.claim(connections)
        took = connections.claimed_last
        # A batch completes its jobs that succeeded with nothing written through their
        # sessions together, at its end; each other job completes on its own.
        deferred: list[LeasedRun] | None = [] if len(runs) > 1 else None
        try:
            for index, run in enumerate(runs):
                if self._stopping():
                    self._release(runs[index:])
                    break
                self._run(run, deferred.append if deferred is not None else None)
        finally:
            if deferred:
                self._complete_together(deferred)
        return took

    def claim(self, connections: LeaseConnections, limit: int | None = None) -> list[LeasedRun]:
        """Lease up to ``limit`` due jobs (the batch size), if any; the thread's connection
        is given back when it took some (and always on SQLite). ``claimed_last`` says whether
        it took a job, one it ended at the claim (cancelled, crashed) included.

        After a claim that took nothing, one read of all the queues comes first: the claim
        polls only those that may have a due job, and is not made when none may."""
        queues, connections.ends = self.settings.queues, None
        if self.dialect.claim_takes_write_lock:
            # SQLite: the write lock is taken only for a due job, in the process's turn.
            try:
                if not connections.claimed_last:
                    queues = self._queues_to_poll(connections)
                    if not queues:
                        return []
                conn = connections.conn
                with self._claim_turn.taken(lambda: self._commits(conn), self._sleep):
                    runs = self._claim(connections, limit, queues)
            finally:
                connections.release()
        else:
            try:
                if not connections.claimed_last:
                    queues = self._queues_to_poll(connections)
                    if not queues:
                        return []  # an idle thread keeps its connection
                runs = self._again_when_lost(
                    "claim", lambda: self._claim(connections, limit, queues)
                )
            except BaseException:
                connections.release()
                raise
            if runs:
                # No connection is held while handlers run; an idle thread keeps its own.
                connections.release()
        return runs

    def _again_when_lost(self, what: str, work: Callable[[], T]) -> T:
        """``work`` (one transaction), made again while it loses a race (``lost_race``): a
        deadlock, or on a Galera cluster its certification, or its abort by a transaction of
        another node that wrote the same rows first (``claim``: another node's claim took
        the job; a busy cluster aborts completions and heartbeats too). A lost transaction
        committed nothing, so no job is charged and no outcome is written twice (a
        completion is fenced by its runs' tokens); the ``CONFLICT_TRIES``-th conflict in a
        row is raised as any error of ``work``. Quiet: each loss is a DEBUG event."""
        pause = 0.0
        for tries_left in range(CONFLICT_TRIES - 1, -1, -1):
            try:
                return work()
            except Exception as exc:
                if not tries_left or not lost_race(exc):
                    raise
                log_event(
                    logging.DEBUG,
                    f"{what}-conflict",
                    worker_id=self.settings.worker_id,
                    error=repr(exc),
                    hint="nothing was written; made again",
                )
            if pause:
                self._sleep(pause * random.uniform(0.5, 1.5))
            pause = min(MAX_CONFLICT_PAUSE, max(CONFLICT_PAUSE, pause * 2))
        raise AssertionError("unreachable")

    def _queues_to_poll(self, connections: LeaseConnections) -> tuple[str, ...]:
        """The queues the claim polls (``QueueEnds.to_poll``), their ends kept for the
        poller's pause (``next_due_on``)."""
        connections.ends = self._queue_ends(connections.conn)
        return connections.ends.to_poll(self.now())

    def _claim(
        self, connections: LeaseConnections, jobs: int | None, queues: tuple[str, ...]
    ) -> list[LeasedRun]:
        """Lease the next due jobs of ``queues``, if any, in a transaction that commits at
        once."""
        conn = connections.conn
        now = self.now()
        token = uuid.uuid4()
        limit = self.settings.max_unclean_ends
        ended: list[tuple[dict[str, Any], str, int, Exception | None]] = []
        runs: list[LeasedRun] = []
        batch = jobs or self._batch_size
        owner = self._owner()
        expiry = now + self._lease
        leasing = None
        if self.dialect.deletes_runs_with_job:
            # PostgreSQL: each poll of a queue without limits leases the jobs it locks.
            leasing = functools.partial(
                sql.leasing_poll,
                token=token,
                owner=owner,
                now=now,
                expiry=expiry,
                with_runs=self._with_runs,
                unclean_limit=limit,
            )
        reserved = self._flow.prepare(conn, lambda: now, batch, self.dialect.begin_claim)
        self.dialect.begin_claim(conn)
        try:
            flow = self._flow.begin(conn, reserved)
            due = poll_queues(
                conn, queues, now, batch, with_runs=self._with_runs, flow=flow, leasing=leasing
            )
            unleased: list[LeasedRun] = []
            for job in due:
                if job.pop("leased", False):
                    # Leased by its poll: no cancel request, no run records, below the limit.
                    job.pop("runs", None)
                    expired = job["unclean_ends"] + (job["lease_token"] is not None)
                    runs.append(LeasedRun(job, token, expired, False, claimed_at=now))
                    continue
                records = job.pop("runs", 0)
                past = ledger.past_runs(
                    self.dialect, conn, job["job_id"], records, self.settings.reconnect_grace
                )
                if past.held:
                    continue  # a transaction-mode run of it may still be going
                expired = job["unclean_ends"] + (job["lease_token"] is not None)
                unclean = expired + past.unclean_ends
                runs_so_far = job["attempts"] + past.unclean_ends
                if job["cancel_requested_at"] is not None:
                    ended.append((job, "cancelled", runs_so_far, None))
                elif limit is not None and unclean >= limit:
                    crashed = JobCrashedError(
                        job["job_id"], unclean, past.connection_losses, expired_leases=expired
                    )
                    ended.append((job, "failure", runs_so_far, crashed))
                else:
                    unleased.append(LeasedRun(job, token, unclean, bool(records), claimed_at=now))
            for job, status, attempts, error in ended:
                # The claim holds the row's lock: it removes the job itself.
                conn.execute(*sql.delete_job(job["job_id"]))
                self._archive(conn, job, status, attempts, error, with_runs=True)
            if unleased:
                ids = [r.job_id for r in unleased]
                arrays = self.dialect.id_arrays
                direct.execute(conn, *sql.lease(ids, token, owner, now, expiry, arrays=arrays))
                runs.extend(unleased)
            flow.finish(token)
            try:
                conn.commit()
            except Exception as exc:
                if runs and is_transient(exc):
                    self._spawn(functools.partial(self._give_back_in_doubt, runs))
                raise
        except BaseException:
            rollback_quietly(conn)
            raise
        connections.claimed_last = bool(runs or ended)
        with self._runs_lock:
            self._runs.update((run.job_id, run) for run in runs)
        for job, status, _, error in ended:
            self._ended_at_claim(job, status, error)
        return runs

    def _ended_at_claim(self, job: dict[str, Any], status: str, error: Exception | None) -> None:
        fields = self._fields(job)
        if error is None:
            log_event(logging.INFO, "job-cancelled", **fields, hint="cancelled while leased")
            return
        log_event(logging.ERROR, "job-crashed", **fields, error=repr(error))
        session = LeaseSession(self.engine, self.dialect)
        session.release()
        payload, _ = self._payload(job)
        assert isinstance(error, Exception)
        self._finished(job, "failed", (self._context(job, payload, session), error))

    # --- one job ----------------------------------------------------------------------------

    def _run(self, run: LeasedRun, defer: Callable[[LeasedRun], None] | None = None) -> None:
        job = run.job
        if too_late(job, self.now()):
            self._started_late(job)
            self._release([run])
            return
        payload, decode_error = self._payload(job)
        session = run.session = RunSession(self.engine, self.dialect)
        on_first_use = cast(Session, SessionOnFirstUse(session.made))
        context = run.context = self._context(job, payload, on_first_use, run.signal)
        if run.unclean_ends:
            log_event(
                logging.WARNING,
                "job-interrupted",
                **self._fields(job),
                unclean_ends=run.unclean_ends,
            )
        if logger.isEnabledFor(logging.DEBUG):
            log_event(logging.DEBUG, "handling-job", **self._fields(job))
        run.start()
        try:
            with telemetry.run_span(job, run.claimed_at) as span:
                error = self._handle(run, session, context, decode_error)
                outcome, failure = self._end(run, session, context, error, defer)
                span.ended(outcome or run.signal.reason or "fenced", error)
        finally:
            if run.state != "done":
                self._forget(run)
            session.release()
        if outcome is not None and run.state != "done":
            self._finished(job, outcome, failure, run.started)

    def _handle(
        self,
        run: LeasedRun,
        session: RunSession,
        context: JobContext,
        decode_error: Exception | None,
    ) -> Exception | None:
        """Run the handler; the exception it raised, if any. A run asked to stop before it
        started (a cancel the heartbeat found while it waited in the worker's queue) does not
        call it."""
        if run.signal.reason is not None:
            return None
        try:
            if decode_error is not None:
                raise decode_error
            with session.handling():
                run.result = self._call_handler(context)
            return None
        except Exception as exc:
            return exc
        except asyncio.CancelledError:
            if run.signal.reason is not None:
                return None  # the worker cancelled the handler's task: its reason decides
            self._interrupted(run, session, charged=False)
            raise
        except KeyboardInterrupt:
            self._interrupted(run, session, charged=False)
            raise
        except BaseException:
            # SystemExit or the like ends the worker as a dying process would: the run
            # counts as an unclean end, so a job that always exits cannot loop.
            self._interrupted(run, session, charged=True)
            raise

    def _end(
        self,
        run: LeasedRun,
        session: RunSession,
        context: JobContext,
        error: Exception | None,
        defer: Callable[[LeasedRun], None] | None = None,
    ) -> tuple[Outcome | None, Failure | None]:
        """Write the run's outcome, fenced by its token; the outcome to count, if any (a
        success whose session wrote nothing goes to ``defer`` instead, to be completed with
        others)."""
        if not run.begin_ending():
            # Timed out (the outcome is written) or released by a stop that gave up.
            session.release()
            fields = self._fields(run.job)
            log_event(logging.INFO, "late-handler-discarded", **fields, reason=run.signal.reason)
            if not run.released and run.signal.reason == "stopping":
                # The release waited for this session (SQLite's write lock): now it can go.
                self._give_back(run, charged=False)
            return None, None
        reason = run.signal.reason
        if reason == "lease-lost":
            session.abandon()
            self._fenced(run)
            return None, None
        if reason == "cancelled":
            session.abandon()
            if self._write(run, session, "cancelled", None):
                self._log_cancelled(run)
            return None, None
        if error is None:
            try:
                session.finish()
            except Exception as exc:
                error = exc
        if error is not None and session.lost:
            # Not the handler's failure: its session went with the connection.
            self._lost(run, session, error)
            return None, None
        if isinstance(error, Snooze):
            session.abandon()
            return self._snooze(run, session, error)
        if error is None and defer is not None and not session.opened and not run.had_runs:
            run.defer()
            defer(run)
            return "succeeded", None
        if error is None:
            if not self._write(run, session, "success", None):
                return None, None
            return "succeeded", None
        log_event(
            logging.WARNING,
            "handle-job-exception",
            **self._fields(run.job),
            error=repr(error),
            traceback=describe(error),
        )
        telemetry.job_error(error)
        session.abandon()
        return self._failed(run, session, context, error)

    def _complete_together(self, runs: list[LeasedRun]) -> bool:
        """Archive deferred successes in one transaction: those that still carry their
        run's token (the others' leases were taken: fenced off). A failure is tried once
        more on a fresh connection (the fence keeps a committed first try from archiving
        twice), and while the database is out of reach (a restart, a failover) again every
        ``GIVE_BACK_PAUSE``, for up to a lease (the heartbeat renews the leases meanwhile);
        if it still fails, the leases are given back, or left to expire."""
        deadline = time.monotonic() + self._lease.total_seconds()
        tries = 0
        try:
            while True:
                try:
                    ended = self._again_when_lost("completion", lambda: self._end_together(runs))
                    break
                except Exception as exc:
                    tries += 1
                    if tries > 1 and not (
                        is_transient(exc) and time.monotonic() < deadline and not self._stopping()
                    ):
                        return self._not_completed(runs, exc)
                    if tries == 1:
                        log_event(
                            logging.WARNING,
                            "completion-retry",
                            worker_id=self.settings.worker_id,
                            jobs=len(runs),
                            error=repr(exc),
                        )
                    else:
                        self._sleep(GIVE_BACK_PAUSE)
        finally:
            self._forget(*runs)
        kept, cancelled = ended
        for run in runs:
            if run.job_id in kept:
                self._finished(run.job, "succeeded", None, run.started)
            elif run.job_id in cancelled:
                self._log_cancelled(run)
            else:
                self._fenced(run)
        return False

    def _end_together(self, runs: list[LeasedRun]) -> tuple[set[uuid.UUID], set[uuid.UUID]]:
        """Delete the runs' jobs that still carry their tokens and archive them as
        succeeded (as cancelled where a cancel was requested before), in one transaction;
        the ids it archived as succeeded, and as cancelled."""
        dialect = self.dialect
        if dialect.deletes_runs_with_job:
            return self._complete_in_one(runs)
        (locking, params), delete = sql.end_leases(
            [run.job_id for run in runs],
            self._tokens(runs),
            force_index=dialect.force_index,
            arrays=dialect.id_arrays,
        )
        with self._short_transaction() as conn:
            # A run's token fences its own job only (one flush holds several claims' runs).
            rows = {(row[0], row[1]): row[2] for row in direct.execute(conn, locking, params)}
            held = [run for run in runs if (run.job_id, run.token) in rows]
            cancelled = [run for run in held if rows[run.job_id, run.token] is not None]
            kept = [run for run in held if rows[run.job_id, run.token] is None]
            now = self.now()
            ends: dict[uuid.UUID, str] = {}
            if kept:
                self._archive_kept(conn, kept, now)
                ends.update((run.job_id, "success") for run in kept)
            if cancelled:
                direct.execute(conn, delete, {"ids": sorted(run.job_id for run in cancelled)})
                archived = [
                    sql.archive(
                        run.job,
                        status="cancelled",
                        attempts=run.job["attempts"] + 1,
                        finished_at=now,
                        error=None,
                        upsert=dialect.archive_upsert,
                    )
                    for run in cancelled
                ]
                conn.execute(archived[0][0], [values for _, values in archived])
                ends.update((run.job_id, "cancelled") for run in cancelled)
            if ends:
                workflows.settle(conn, ends, dialect, now)
        return {run.job_id for run in kept}, {run.job_id for run in cancelled}

    def _complete_in_one(self, runs: list[LeasedRun]) -> tuple[set[uuid.UUID], set[uuid.UUID]]:
        """``_end_together`` on PostgreSQL: one statement deletes the jobs whose rows still
        carry their runs' tokens and archives them (``sql.complete_leases``), and what waits
        for their ends is settled in its transaction."""
        now = self.now()
        statement = sql.complete_leases(
            [(run.job_id, run.token, run.result) for run in runs],
            now,
            upsert=self.dialect.archive_upsert,
        )
        with self._short_transaction() as conn:
            rows = list(direct.execute(conn, *statement))
            ends: dict[uuid.UUID, str] = {row[0]: row[1] for row in rows}
            # Each row counts the rows waiting for any of the group's ends.
            if rows and rows[0][2]:
                workflows.settle(conn, ends, self.dialect, now)
        cancelled = {job_id for job_id, status in ends.items() if status == "cancelled"}
        return set(ends) - cancelled, cancelled

    def _archive_kept(self, conn: Connection, kept: list[LeasedRun], now: datetime) -> None:
        """Archive the succeeded runs' jobs from their queue rows (which the completion
        locked) and remove them, with their results."""
        dialect = self.dialect
        statements = sql.archive_leased_succeeded(
            sorted(run.job_id for run in kept),
            now,
            upsert=dialect.archive_upsert,
            force_index=dialect.force_index,
        )
        for statement in statements:
            direct.execute(conn, *statement)
        stored = {run.job_id: run.result for run in kept if run.result is not None}
        if stored:
            direct.execute(conn, *sql.set_results(stored))

    def _not_completed(self, runs: list[LeasedRun], exc: Exception) -> bool:
        """Deferred successes could not be completed: give their leases back (the jobs run
        again, their runs not counted; True), or, if that fails too, leave them to expire."""
        log_event(
            logging.ERROR,
            "outcome-recording-error",
            worker_id=self.settings.worker_id,
            jobs=len(runs),
            error=repr(exc),
            hint="nothing was recorded; the jobs run again",
        )
        try:
            self._execute(self._released(runs, ran=True))
            return True
        except Exception as error:
            log_event(
                logging.WARNING,
                "lease-release-error",
                worker_id=self.settings.worker_id,
                error=repr(error),
                hint="the jobs run again once their leases expire",
            )
            return False

    def _failed(
        self,
        run: LeasedRun,
        session: RunSession | None,
        context: JobContext,
        error: Exception,
    ) -> tuple[Outcome | None, Failure | None]:
        """Retry the job per the retry strategy, or archive it as failed."""
        job = run.job
        retry_at, left = self._retry_at(job, context, error)
        if retry_at is None:
            if not self._write(run, session, "failure", error):
                return None, None
            return "failed", (context, error)
        statement = sql.retry_lease(run.job_id, run.token, retry_at)
        if not self._write_fenced(run, session, lambda conn: conn.execute(*statement).rowcount):
            return None, None
        log_event(
            logging.INFO,
            "retrying",
            **self._fields(job),
            retry_at=retry_at.isoformat(),
            retries_left=left,
        )
        return "retried", None

    def _snooze(
        self, run: LeasedRun, session: RunSession, snooze: Snooze
    ) -> tuple[Outcome | None, Failure | None]:
        """Give the lease back with the job due in the snooze's seconds, fenced as a retry
        is (the handler's writes discarded): the claim's count of the run undone, one more
        snooze. The worker's summary counts it as retried."""

        def write(until: datetime) -> bool:
            statement = sql.snooze_lease(run.job_id, run.token, until)
            return self._write_fenced(run, session, lambda conn: conn.execute(*statement).rowcount)

        return ("retried", None) if self._snoozed(run.job, snooze, write) else (None, None)

    def _write(
        self, run: LeasedRun, session: RunSession | None, status: str, error: Exception | None
    ) -> bool:
        """Remove the job where it still carries the run's token and archive it, in the
        session's transaction (with the handler's writes); False if it was fenced off, or
        cancelled instead (see _write_fenced)."""
        return self._write_fenced(run, session, self._remove_and_archive(run, status, error))

    def _remove_and_archive(
        self, run: LeasedRun, status: str, error: Exception | None
    ) -> Callable[[Connection], int]:
        """The write of a run's end with ``status``: the job removed where it still carries
        the run's token (and, but for a cancel, has no cancel request), and archived."""
        attempts = run.job["attempts"] + 1
        cancelling = status == "cancelled"
        stored = run.result if status == "success" else None

        def remove_and_archive(conn: Connection) -> int:
            if self.dialect.deletes_runs_with_job and not run.had_runs:
                # PostgreSQL: the fenced delete and the archive are one statement.
                statement = sql.archive_lease(
                    run.job_id,
                    run.token,
                    status=status,
                    attempts=attempts,
                    finished_at=self.now(),
                    error=describe(error) if error is not None else None,
                    upsert=self.dialect.archive_upsert,
                    result=stored,
                )
                result = conn.execute(*statement)
                archived = int(result.rowcount)
                # Its row tells whether any row waits for this end.
                if archived and result.scalar():
                    workflows.settle(conn, {run.job_id: status}, self.dialect, self.now())
                return archived
            statement = sql.end_lease(run.job_id, run.token, cancelling=cancelling)
            removed = conn.execute(*statement).rowcount
            if removed:
                self._archive(
                    conn, run.job, status, attempts, error, with_runs=run.had_runs, result=stored
                )
            return int(removed)

        return remove_and_archive

    def _write_fenced(
        self,
        run: LeasedRun,
        session: RunSession | None,
        write: Callable[[Connection], int],
    ) -> bool:
        """Run ``write`` (which returns the rows it found by the run's token, with no cancel
        request) and commit. If it found none, roll back: the run was fenced off, or a cancel
        was requested, which wins over any other outcome: the job is archived as cancelled
        (what the handler wrote is discarded). A failure to write leaves the lease to
        expire, or gives it back."""
        own = session if session is not None else RunSession(self.engine, self.dialect)
        try:
            conn = own.outcome_connection()
            if write(conn):
                conn.commit()
                return True
            held = conn.execute(*sql.cancel_requested(run.job_id, run.token)).first()
            rollback_quietly(conn)
            if held is None or held[0] is None:
                self._fenced(run)
                return False
            # A cancel committed before this outcome: the job ends cancelled.
            conn = own.outcome_connection()
            if self._remove_and_archive(run, "cancelled", None)(conn):
                conn.commit()
                self._log_cancelled(run)
            else:
                rollback_quietly(conn)
                self._fenced(run)
            return False
        except Exception as exc:
            self._not_written(run, own, exc)
            return False
        finally:
            if session is None:
                own.release()

    def _log_cancelled(self, run: LeasedRun) -> None:
        hint = "cancelled while running" if run.ran else "cancelled before it started"
        log_event(logging.INFO, "job-cancelled", **self._fields(run.job), hint=hint)

    def _not_written(self, run: LeasedRun, session: RunSession, exc: Exception) -> None:
        """The outcome could not be written. A lost connection: the job runs again (see
        _lost). Anything else: end the lease now with its token, so that the next claim runs
        the job again and counts the run as an unclean end."""
        if session.lost or is_transient(exc):
            self._lost(run, session, exc)
            return
        log_event(
            logging.ERROR,
            "outcome-recording-error",
            **self._fields(run.job),
            error=repr(exc),
            hint="nothing was recorded; the job runs again, and the run counts as an "
            "unclean end (max_unclean_ends)",
        )
        with contextlib.suppress(Exception):
            self._execute(sql.expire_lease(run.job_id, run.token, self.now()))

    def _lost(self, run: LeasedRun, session: RunSession, exc: Exception) -> None:
        """The job's session was lost before its outcome was written: nothing of the run
        was committed, and the job runs again. Counted as an unclean end only when the
        server ended the session for sitting idle in its transaction (a limit the job hits
        each time it runs, which would loop), not for a restart, a failover or a kill."""
        idle_for = time.monotonic() - session.last_used if session.opened else 0.0
        idle_limit = self._idle_limit()
        # The server's limit, as the error names it or as its setting says (psycopg2 and
        # MariaDB report only a closed connection).
        charged = idle_limit_hit(exc, idle_for, idle_limit)
        if charged:
            hint = (
                f"the job's session sat idle in its transaction for {idle_for:.1f} s, past the "
                "server's idle-transaction limit (PostgreSQL's "
                "idle_in_transaction_session_timeout, MariaDB's idle_transaction_timeout), so "
                "the server ended it; the run counts as an unclean end (max_unclean_ends). "
                "Use job.session at the end of the job, or raise the limit"
            )
        elif lost_race(exc):
            hint = (
                "the job's transaction lost a race with another one (a deadlock; on a Galera "
                "cluster, a write of another node to the same rows or unique keys): nothing of "
                "the run was committed, and the job runs again, uncharged"
            )
        else:
            hint = connection_loss_hint(exc)
        fields = self._fields(run.job)
        level = logging.WARNING if lost_race(exc) and not charged else logging.ERROR
        log_event(level, "job-connection-lost", **fields, error=repr(exc), hint=hint)
        session.release()
        self._give_back(run, charged=charged)

    def _idle_limit(self) -> float | None:
        """The server's idle-transaction limit for the worker's sessions, read once."""
        if self._idle_timeout is None:
            try:
                with self.dialect.claim_connection(self.engine) as conn:
                    self._idle_timeout = (idle_transaction_limit(conn) or 0.0,)
            except Exception:
                return None
        return self._idle_timeout[0] or None

    def _give_back_statement(self, run: LeasedRun, *, charged: bool) -> sql.Statement:
        """What makes a run's job due again now: a release (no unclean end; a run that
        started stays counted in attempts), or an expiry that keeps the token (``charged``:
        the next claim counts one)."""
        if charged:
            return sql.expire_lease(run.job_id, run.token, self.now())
        return self._released([run], ran=run.ran)

    def _give_back(self, run: LeasedRun, *, charged: bool) -> None:
        """Make the job due again at once: released (no unclean end), or ``charged`` (its
        token kept, so the next claim counts one). While the database is out of reach it
        tries again, for up to a lease; the heartbeat renews the lease meanwhile."""
        try:
            self._execute_patiently(self._give_back_statement(run, charged=charged))
            run.released = True
        except Exception as exc:
            log_event(
                logging.WARNING,
                "lease-release-error",
                **self._fields(run.job),
                error=repr(exc),
                hint="the job runs again once its lease expires",
            )

    def _give_back_in_doubt(self, runs: list[LeasedRun]) -> None:
        """A claim's commit failed with its connection, yet may have reached the server
        (or the standby promoted in its place, a failover): give back, uncharged, the
        leases it may have taken, by its token, so that they need not expire and count as
        unclean ends."""
        try:
            released = self._execute_patiently(self._released(runs, ran=False)).rowcount
        except Exception as exc:
            log_event(
                logging.WARNING,
                "lease-release-error",
                worker_id=self.settings.worker_id,
                error=repr(exc),
                hint="the jobs of a claim whose commit failed run again once their leases expire",
            )
            return
        if released:
            log_event(
                logging.INFO,
                "leases-released",
                worker_id=self.settings.worker_id,
                jobs=released,
                hint="a claim whose commit failed with its connection had taken them all the "
                "same; they are due again at once, without an unclean end",
            )

    def _execute_patiently(self, statement: sql.Statement) -> Any:
        """``_execute``, tried again every ``GIVE_BACK_PAUSE`` while the database is out of
        reach, for up to a lease (the heartbeat renews the worker's leases meanwhile) or until
        a stop; the last error is raised."""
        deadline = time.monotonic() + self._lease.total_seconds()
        while True:
            try:
                return self._execute(statement)
            except Exception:
                if time.monotonic() >= deadline or self._stopping():
                    raise
                self._sleep(GIVE_BACK_PAUSE)

    def _fenced(self, run: LeasedRun) -> None:
        log_event(
            logging.WARNING,
            "lease-lost",
            **self._fields(run.job),
            hint="the job's lease expired and another run took it (this worker froze or "
            "could not reach the database for longer than lease_seconds), or it was "
            "released: nothing this run wrote was committed",
        )

    def _interrupted(self, run: LeasedRun, session: RunSession, *, charged: bool) -> None:
        """The handler was interrupted by the process ending: give the lease back unrun
        (Ctrl-C, a cancelled task), or end it now to be counted (SystemExit)."""
        session.abandon()
        if not run.begin_ending():
            return
        with contextlib.suppress(Exception):
            self._execute(self._give_back_statement(run, charged=charged))

    def _release(self, runs: list[LeasedRun]) -> None:
        """Give claimed leases back unrun (a stop came before their handlers started)."""
        for run in runs:
            run.begin_ending()
        try:
            self._execute(self._released(runs, ran=False))
        except Exception as exc:
            log_event(logging.WARNING, "lease-release-error", error=repr(exc))
        finally:
            self._forget(*runs)

    def _archive(
        self,
        conn: Connection,
        job: dict[str, Any],
        status: str,
        attempts: int,
        error: Exception | None,
        *,
        with_runs: bool,
        result: str | None = None,
    ) -> None:
        conn.execute(
            *sql.archive(
                job,
                status=status,
                attempts=attempts,
                finished_at=self.now(),
                error=describe(error) if error is not None else None,
                upsert=self.dialect.archive_upsert,
                result=result,
            )
        )
        if with_runs:
            conn.execute(*sql.end_runs(job["job_id"]))
        workflows.settle(conn, {job["job_id"]: status}, self.dialect, self.now())

    # --- the heartbeat and the timeouts -----------------------------------------------------

    def _running(self) -> list[LeasedRun]:
        with self._runs_lock:
            return list(self._runs.values())

    def _forget(self, *runs: LeasedRun) -> None:
        with self._runs_lock:
            for run in runs:
                if self._runs.get(run.job_id) is run:
                    del self._runs[run.job_id]

    @staticmethod
    def _tokens(runs: list[LeasedRun]) -> list[uuid.UUID]:
        return sorted({run.token for run in runs})

    @classmethod
    def _released(cls, runs: list[LeasedRun], *, ran: bool) -> sql.Statement:
        """The release of the runs' leases (see sql.release_leases: ``ran`` keeps their
        count)."""
        return sql.release_leases([run.job_id for run in runs], cls._tokens(runs), ran=ran)

    @contextlib.contextmanager
    def _short_transaction(self) -> Iterator[Connection]:
        """A transaction of its own on a connection of the pool, committed if the block
        ends without an error, else rolled back."""
        with self.dialect.claim_connection(self.engine) as conn:
            self.dialect.begin_claim(conn)
            try:
                yield conn
                conn.commit()
            except BaseException:
                rollback_quietly(conn)
                raise

    def _execute(self, statement: sql.Statement) -> Any:
        """One statement in a short transaction of its own."""
        with self._short_transaction() as conn:
            return conn.execute(*statement)

    def _beat(self) -> None:
        """Renew every lease of the worker in one statement; tell the handlers of leases
        found gone (another run took them) or with a cancel request to stop. A run whose
        outcome is being written is renewed too, until its completion locks the job's row
        (a final flush that waits for a lock must not let the lease expire); the lock skips
        that row from then on."""
        runs = self._running()
        if not runs:
            return
        ids = [run.job_id for run in runs]
        tokens = self._tokens(runs)
        now = self.now()
        with self._short_transaction() as conn:
            free = list(conn.execute(*sql.lock_leases(ids, tokens)).scalars())
            if free:
                conn.execute(*sql.renew_leases(free, tokens, now, now + self._lease))
            rows = conn.execute(*sql.leases_held(ids, tokens)).all()
        held: dict[uuid.UUID, datetime | None] = {row[0]: row[1] for row in rows}
        for run in runs:
            if run.state in ("ending", "done"):
                continue  # its outcome is being written: the write finds what happened
            if run.job_id not in held:
                if run.signal.request("lease-lost"):
                    self._forget(run)
            elif held[run.job_id] is not None:
                run.signal.request("cancelled")

    def _time_out(self) -> None:
        """Find the jobs running longer than their timeout (their task's, else job_timeout):
        their handlers are asked to stop (what they write from then on is discarded), and
        each is failed now, off the heartbeat (see _end_timed_out), which goes on renewing
        its lease meanwhile."""
        now = time.monotonic()
        for run in self._running():
            timeout = self.settings.timeout_for(run.job["job_type"])
            if run.state != "running" or timeout is None or now - run.started < timeout:
                continue
            if not run.begin_ending():
                continue
            log_event(logging.WARNING, "job-timed-out", **self._fields(run.job), seconds=timeout)
            # The outcome's writer first, then the handler's stop: a caller that returns once
            # the handler does (process_next_job) finds the writer to wait for in close().
            self._spawn(functools.partial(self._end_timed_out, run, timeout))
            run.signal.request("timed-out")

    def _end_timed_out(self, run: LeasedRun, timeout: float) -> None:
        """Fail a timed-out job (retry it per the retry strategy, or archive it as failed,
        or as cancelled if a cancel came first) and call the failed-job handler: never on
        the heartbeat, which these writes and callbacks could hold up."""
        context = run.context
        assert context is not None
        try:
            outcome, failure = self._failed(
                run, None, context, JobTimeoutError(run.job_id, timeout)
            )
        except Exception as exc:
            log_event(
                logging.ERROR, "outcome-recording-error", **self._fields(run.job), error=repr(exc)
            )
            return
        finally:
            self._forget(run)
        if outcome is not None:
            self._finished(run.job, outcome, failure)

    def _spawn_thread(self, work: Callable[[], None]) -> None:
        """Run ``work`` in a thread of its own (close() waits for it)."""
        thread = threading.Thread(
            target=work, name=f"{self.settings.worker_id}-timeout", daemon=True
        )
        with self._runs_lock:
            self._outcome_threads = [t for t in self._outcome_threads if t.is_alive()]
            thread.start()  # before close() can see it, and join it
            self._outcome_threads.append(thread)


#: The range of ``lease_seconds``: at least a second (its heartbeat renews it within), at
#: most a week (how long a dead worker's job may wait before it runs again).
MIN_LEASE_SECONDS = 1.0
MAX_LEASE_SECONDS = 7 * 24 * 3600.0
#: The shortest ``heartbeat_interval`` (each heartbeat is a transaction on the database).
MIN_HEARTBEAT_INTERVAL = 0.05
#: The longest ``job_timeout``: a week, as the longest lease.
MAX_JOB_TIMEOUT = MAX_LEASE_SECONDS


def check_lease_settings(
    lease_seconds: object, heartbeat_interval: object, job_timeout: object
) -> None:
    """Refuse lease settings that cannot work (not a number, NaN, infinite, out of range),
    naming the option and the range to give instead."""
    week = f"{MAX_LEASE_SECONDS:g}"
    _check_seconds(
        "lease_seconds",
        lease_seconds,
        MIN_LEASE_SECONDS <= _number(lease_seconds) <= MAX_LEASE_SECONDS,
        f"from {MIN_LEASE_SECONDS:g} to {week} (a week): the heartbeat renews a lease "
        "several times within it, and a dead worker's job waits that long to run again",
    )
    _check_seconds(
        "heartbeat_interval",
        heartbeat_interval,
        MIN_HEARTBEAT_INTERVAL <= _number(heartbeat_interval) <= MAX_LEASE_SECONDS,
        f"from {MIN_HEARTBEAT_INTERVAL:g}, and shorter than lease_seconds (leave it out for "
        "lease_seconds / 3)",
    )
    _check_seconds(
        "job_timeout",
        job_timeout,
        0 < _number(job_timeout) <= MAX_JOB_TIMEOUT,
        f"> 0, up to {week} (a week; leave it out for no timeout)",
    )
    if lease_seconds is None:
        others = (("heartbeat_interval", heartbeat_interval), ("job_timeout", job_timeout))
        for name, value in others:
            if value is not None:
                raise _settings_error(
                    f"{name} needs lease mode: give lease_seconds too (a job's lease, say "
                    "60), so that jobs run with no transaction open and can be timed out"
                )
        return
    assert isinstance(lease_seconds, int | float)
    if isinstance(heartbeat_interval, int | float) and not heartbeat_interval < lease_seconds:
        raise _settings_error(
            f"heartbeat_interval ({heartbeat_interval}) must be shorter than lease_seconds "
            f"({lease_seconds}), or every lease expires before it is renewed: leave it out "
            "(lease_seconds / 3) or make it smaller"
        )


def check_task_timeouts(lease_seconds: object, task_timeouts: dict[str, float]) -> None:
    """Refuse tasks' timeouts (``JobHandlers.task(timeout=...)``) without lease mode."""
    if lease_seconds is None and task_timeouts:
        job_type, timeout = next(iter(task_timeouts.items()))
        raise _settings_error(
            f"task {job_type!r} has timeout={timeout:g}, which needs lease mode: give the "
            "worker lease_seconds too (a job's lease, say 60), so that jobs run with no "
            "transaction open and can be timed out"
        )


def _number(value: object) -> float:
    """A setting as a number to compare (NaN, which no range holds, for anything else)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return float("nan")
    return value


def _check_seconds(name: str, value: object, in_range: bool, wanted: str) -> None:
    """Refuse a setting given (not None) out of its range."""
    if value is not None and not in_range:
        raise _settings_error(f"{name} is {value!r}; give a number of seconds {wanted}")


def _settings_error(message: str) -> ConfigurationError:
    return ConfigurationError(message)


def new_runner(
    engine: Engine,
    settings: RunSettings,
    on_outcome: Callable[[Outcome], None] | None = None,
    stopping: Callable[[], bool] | None = None,
    **units: Any,
) -> JobRunner | LeaseRunner:
    """The runner of the settings' mode: lease mode with ``lease_seconds``, else transaction
    mode."""
    kind = LeaseRunner if settings.lease_seconds is not None else JobRunner
    return kind(engine, settings, on_outcome, stopping, **units)
