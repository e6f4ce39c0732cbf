"""What both ways of running a job share: its settings, the handler's context and call, the
retry decision, and the outcome's count and failed-job handler.

A job runs in one of two modes, each a runner of its own: the transaction mode
(``execution.JobRunner``: the handler runs inside the transaction that claimed the job) and the
lease mode (``leases.LeaseRunner``: the claim commits a lease at once, and the handler runs
with no transaction open). Both are used by the threaded and the asyncio worker alike.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from sqla_proletarian import direct, ledger, results, turns
from sqla_proletarian import statements as sql
from sqla_proletarian.dialects import PriorityScan, dialect_of
from sqla_proletarian.errors import (
    PayloadDeserializationError,
    ProletarianError,
    Snooze,
    UnknownJobTypeError,
)
from sqla_proletarian.flow import COUNTED, FlowControl
from sqla_proletarian.handlers import (
    JobContext,
    JobHandlers,
    StopSignal,
    running_job,
    worker_reads,
)
from sqla_proletarian.logs import finished_logger, log_event, log_to
from sqla_proletarian.progress import DEFAULT_PROGRESS_INTERVAL, ProgressWriter
from sqla_proletarian.retry import RetryStrategy, as_retry_strategy
from sqla_proletarian.serialization import Serializer
from sqla_proletarian.statements.workflows import HAD_DEPENDENCIES
from sqla_proletarian.values import Clock, check_aware
from sqla_proletarian.workflows import Sweeper

Outcome = Literal["succeeded", "retried", "failed"]
RetryStrategyFn = Callable[[JobContext, Exception], RetryStrategy | None]
FailedJobHandler = Callable[[JobContext, Exception], object]
Failure = tuple[JobContext, Exception]
T = TypeVar("T")

#: Longest error text kept in the archive, in UTF-8 bytes (MariaDB's TEXT holds 65,535).
MAX_ERROR_BYTES = 16_384
#: Longest first line of the error text (the summary a list shows), in characters.
MAX_SUMMARY = 200

#: The stop signal of the handler being called (the asyncio worker cancels a default-mode
#: handler's task by it, as an advanced one's by ``job.cancel_requested``).
RUNNING_SIGNAL: ContextVar[threading.Event | None] = ContextVar("running_signal", default=None)


@dataclass(frozen=True)
class RunSettings:
    """What a runner needs to know, taken from the worker options."""

    #: The queues served, in claim order: a queue's jobs are claimed when those before it
    #: have no due job (or fewer than the batch).
    queues: tuple[str, ...]
    handler: Callable[..., Any]
    handler_mode: Literal["default", "advanced"]
    retry_strategy: RetryStrategyFn | None
    failed_job_handler: FailedJobHandler | None
    serializer: Serializer
    clock: Clock
    worker_id: str
    max_unclean_ends: int | None
    #: Jobs claimed in one transaction (SQLite: always 1).
    batch_size: int = 1
    #: Seconds a run record's owner must stay gone before its run counts (``ledger``).
    reconnect_grace: float = ledger.OWNER_GRACE
    #: Lease mode: seconds a claim's lease lasts unless renewed (None: transaction mode).
    lease_seconds: float | None = None
    #: Lease mode: seconds between a worker's renewals of its leases.
    heartbeat_interval: float | None = None
    #: Lease mode: seconds a job may run before it fails with JobTimeoutError.
    job_timeout: float | None = None
    #: The retry strategies of job types whose tasks have their own (``JobHandlers.task``).
    task_retries: dict[str, RetryStrategyFn] = field(default_factory=dict)
    #: Lease mode: the timeouts of job types whose tasks have their own.
    task_timeouts: dict[str, float] = field(default_factory=dict)
    #: Seconds between two writes of a running job's progress (``job.set_progress``).
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL
    #: The longest result stored, in bytes of its serialized text (None: no limit).
    max_result_bytes: int | None = results.DEFAULT_MAX_RESULT_BYTES

    @classmethod
    def task_settings(cls, handler: Callable[..., Any]) -> dict[str, Any]:
        """The ``task_retries`` and ``task_timeouts`` of a JobHandlers' tasks (none for a
        handler of another kind)."""
        tasks = handler.tasks() if isinstance(handler, JobHandlers) else []
        return {
            "task_retries": {
                t.job_type: _retry_function(t.retry) for t in tasks if t.retry is not None
            },
            "task_timeouts": {t.job_type: t.timeout for t in tasks if t.timeout is not None},
        }

    def retry_strategy_for(self, job_type: str) -> RetryStrategyFn | None:
        """The retry strategy of a job type: its task's, else the worker's."""
        return self.task_retries.get(job_type, self.retry_strategy)

    def timeout_for(self, job_type: str) -> float | None:
        """Lease mode: the timeout of a job type's runs: its task's, else ``job_timeout``."""
        return self.task_timeouts.get(job_type, self.job_timeout)

    @property
    def times_out(self) -> bool:
        """Whether some job type's runs have a timeout (the heartbeat then looks for them)."""
        return self.job_timeout is not None or bool(self.task_timeouts)

    @property
    def queue_names(self) -> str:
        """The queues as logs name them: comma-separated, in claim order."""
        return ",".join(self.queues)


def _retry_function(retry: RetryStrategy | RetryStrategyFn) -> RetryStrategyFn:
    """A task's ``retry`` as the worker's ``retry_strategy`` option is: a function."""
    if isinstance(retry, RetryStrategy):
        return lambda job, exc: retry
    return retry


def attempt_of(job: dict[str, Any]) -> int:
    """The run's attempt as handlers and retry strategies count it (1 on the first run): the
    runs that ended with an outcome, plus this one. ``attempts`` also counts the lease-mode
    runs that ended uncleanly (each claim counts its run), which are ``unclean_ends``, with
    one more for an expired lease found on the job now, and the runs given back uncharged
    (``uncharged_runs``: a lost connection, a stop that gave up)."""
    expired = job.get("unclean_ends", 0) + (job.get("lease_token") is not None)
    return int(job["attempts"]) - int(expired) - int(job.get("uncharged_runs", 0)) + 1


def describe(exc: BaseException) -> str:
    """The archive's error text: the exception's type and message on the first line (what a
    list shows), then its formatted traceback with chained causes, cut to MAX_ERROR_BYTES."""
    summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    if text != summary:  # it was raised, or has a cause: the traceback follows the summary
        first = summary.splitlines()[0]
        if len(first) > MAX_SUMMARY:
            first = first[:MAX_SUMMARY] + " [...]"
        text = f"{first}\n{text}"
    return cut_middle(text, MAX_ERROR_BYTES)


def cut_middle(text: str, limit: int) -> str:
    """``text`` if its UTF-8 form fits in ``limit`` bytes; otherwise its head and its tail
    (whole lines where they can be) around a line that says how much was cut."""
    data = text.encode()
    if len(data) <= limit:
        return text
    half = (limit - _MARKER_BYTES) // 2
    head, tail = data[:half], data[len(data) - half :]
    # Whole lines, unless the nearest line end would drop more than half of a part.
    end = head.rfind(b"\n")
    if end >= half // 2:
        head = head[: end + 1]
    start = tail.find(b"\n")
    if 0 <= start < half // 2:
        tail = tail[start + 1 :]
    cut = data[len(head) : len(data) - len(tail)]
    marker = f"[... {len(cut):,} bytes ({cut.count(10):,} lines) cut here ...]\n"
    # errors="ignore": a part that starts or ends inside a character drops its bytes.
    parts = (head.decode(errors="ignore"), tail.decode(errors="ignore"))
    return parts[0] + ("" if parts[0].endswith("\n") else "\n") + marker + parts[1]


#: Room kept for ``cut_middle``'s marker line and a line end added to the head.
_MARKER_BYTES = 80

#: Longest text naming a run's worker that run records and leases keep (their columns hold
#: 255 characters).
MAX_OWNER_CHARS = 255
#: What stands for the characters a too-long owner text lost.
_OWNER_CUT = "..."


def owner_text(worker_id: str, host: str, unit: str) -> str:
    """Who runs a claim's jobs, as run records and leases name it: ``worker_id@host/unit``,
    cut in its middle to ``MAX_OWNER_CHARS`` when longer (a long ``worker_id``), so that its
    start and its end (the thread or task, and a process's ``#N``) are kept."""
    text = f"{worker_id}@{host}/{unit}"
    if len(text) <= MAX_OWNER_CHARS:
        return text
    head = (MAX_OWNER_CHARS - len(_OWNER_CUT)) // 2
    tail = MAX_OWNER_CHARS - len(_OWNER_CUT) - head
    return text[:head] + _OWNER_CUT + text[len(text) - tail :]


class RunnerBase:
    """The parts of a runner that do not depend on how the job is held.

    ``stopping`` says whether the worker is stopping: once it does, no handler starts. The
    asyncio worker runs a runner in greenlets of one thread: it gives locks and a sleep that
    let the event loop run while a task waits (``new_lock``, ``sleep``), names its tasks
    (``unit_name``), and runs work off the heartbeat in a task of its own (``spawn``).
    """

    def __init__(
        self,
        engine: Engine,
        settings: RunSettings,
        on_outcome: Callable[[Outcome], None] | None = None,
        stopping: Callable[[], bool] | None = None,
        *,
        new_lock: Callable[[], AbstractContextManager[Any]] = threading.Lock,
        unit_name: Callable[[], str] = lambda: threading.current_thread().name,
        sleep: Callable[[float], object] = time.sleep,
        spawn: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.dialect = dialect_of(engine)
        self._on_outcome = on_outcome
        self._stopping = stopping or (lambda: False)
        self._new_lock = new_lock
        self._unit_name = unit_name
        self._sleep = sleep
        self._spawner = spawn
        #: SQLite: the claims of every runner of the process on the database file take turns.
        self._claim_turn = turns.turn_for(engine.url, new_lock)
        self._host = f"{socket.gethostname()}:{os.getpid()}"
        # SQLite: one job per claim (its write lock is held from the claim's first read).
        self._batch_size = 1 if self.dialect.claim_takes_write_lock else settings.batch_size
        #: The queues' limits, kept by every claim (``flow``).
        self._flow = FlowControl(engine, settings.queues, leases=settings.lease_seconds is not None)
        #: Writes the handlers' ``set_progress`` reports (SQLite in transaction mode: once
        #: the handler has returned, its transaction holding the write lock until then).
        self.progress = ProgressWriter(
            engine,
            settings.progress_interval,
            settings.clock,
            after_end_only=self.dialect.claim_takes_write_lock and settings.lease_seconds is None,
            spawn=spawn,
        )
        #: Settles the ends that no settle counted (see ``sqla_proletarian.workflows``).
        self._sweeper = Sweeper(self.dialect)
        self._set_up()

    #: Called in the claiming thread when a claim got jobs, before their handlers run (the
    #: threaded worker's idle threads then poll too: more jobs may be due).
    on_claim: Callable[[], None] | None = None

    def _set_up(self) -> None:
        """The mode's own state (a subclass's)."""

    def sweep(self, conn: Connection) -> None:
        """Now and then, on the thread's claim connection outside a claim: count the ends
        of jobs whose dependents were enqueued as they ended."""
        self._sweeper.tick(conn, self.now)

    def now(self) -> datetime:
        return check_aware("clock()", self.settings.clock())

    def _owner(self) -> str:
        """The calling thread's (or task's) name in run records and leases."""
        return owner_text(self.settings.worker_id, self._host, self._unit_name())

    def _queue_ends(self, conn: Connection) -> QueueEnds:
        """The ends of the queues' ranges of the poll index, one statement for all of them,
        read in a transaction of its own (SQLite: without taking the write lock): a claim
        after one that took nothing polls only the queues it names (``QueueEnds.to_poll``),
        and none when it names none, so an idle worker sends one statement a poll however
        many queues it serves."""
        queues = self.settings.queues
        return read_apart(conn, lambda: QueueEnds.read(conn, queues))

    def next_due(self, conn: Connection) -> datetime | None:
        """When the queues' earliest job is due (None: no job, or the queues are paused), read
        on the claim's connection without locking anything: an idle worker sleeps until then."""
        scan, queues = self.dialect.priority_scan, self.settings.queues
        return read_apart(conn, lambda: next_due_in(conn, queues, scan))

    def _commits(self, conn: Connection) -> int:
        """SQLite's count of other connections' commits to the file, as seen from ``conn``."""
        row = read_alone(conn, sql.data_version())
        assert row is not None
        return int(row[0])

    # --- the handler ----------------------------------------------------------------------

    def _payload(self, job: dict[str, Any]) -> tuple[Any, PayloadDeserializationError | None]:
        """The job's decoded payload, or its stored text and why it could not be decoded."""
        try:
            return self.settings.serializer.loads(job["payload"]), None
        except Exception as exc:
            return job["payload"], PayloadDeserializationError(job["job_id"], str(exc))

    def _context(
        self,
        job: dict[str, Any],
        payload: Any,
        session: Session,
        cancel_requested: StopSignal | None = None,
        read_on: Connection | None = None,
    ) -> JobContext:
        """The job's context; its ``dependency_results`` are read on first access, on
        ``read_on`` (the job's own connection) or else on a connection of the engine's."""

        def read_dependencies() -> dict[Any, Any]:
            if job.get("waiting_on", HAD_DEPENDENCIES) == 0:
                return {}  # no dependencies: nothing to read
            serializer, job_id = self.settings.serializer, job["job_id"]
            if read_on is not None:
                with worker_reads(read_on):
                    return results.read_dependency_results(read_on, job_id, serializer)
            with self.engine.connect() as conn:
                return results.read_dependency_results(conn, job_id, serializer)

        return JobContext(
            job_id=job["job_id"],
            queue=job["queue"],
            job_type=job["job_type"],
            payload=payload,
            attempts=attempt_of(job),
            enqueued_at=job["enqueued_at"],
            # A leased job's process_at is its lease's expiry; due_at is its own.
            process_at=job.get("due_at") or job["process_at"],
            session=session,
            cancel_requested=cancel_requested or StopSignal(),
            progress_writer=self.progress,
            _read_dependencies=read_dependencies,
        )

    def _call_handler(self, context: JobContext) -> str | None:
        """Call the handler; its return value as the archive stores it (see ``_stored``)."""
        if self.settings.handler_mode != "advanced":
            return self._call_plain(
                context.job_type,
                context.payload,
                context.cancel_requested,
                lambda: context,
                context.job_id,
            )
        running = RUNNING_SIGNAL.set(context.cancel_requested)
        try:
            with running_job(lambda: context):
                result = self.settings.handler(context)
        finally:
            RUNNING_SIGNAL.reset(running)
            self.progress.ended(context.job_id)
        _check_result(result)
        return self._stored(context.job_id, result)

    def _call_plain(
        self,
        job_type: str,
        payload: Any,
        signal: threading.Event,
        context_of: Callable[[], JobContext],
        job_id: Any = None,
    ) -> str | None:
        """Call a handler of ``(job_type, payload)``; ``current_job()`` makes its context
        with ``context_of``. A context made there has its last progress report written. Its
        return value as the archive stores it (see ``_stored``)."""
        made: list[JobContext] = []

        def made_once() -> JobContext:
            if not made:
                made.append(context_of())
            return made[0]

        running = RUNNING_SIGNAL.set(signal)
        try:
            with running_job(made_once):
                result = self.settings.handler(job_type, payload)
        finally:
            RUNNING_SIGNAL.reset(running)
            if made:
                self.progress.ended(made[0].job_id)
        _check_result(result)
        return self._stored(job_id, result)

    def _stored(self, job_id: Any, value: Any) -> str | None:
        """A handler's return value serialized for the archive (None stores nothing); a
        value that cannot be stored raises, failing the job as the handler's own error."""
        if value is None:
            return None
        limit = self.settings.max_result_bytes
        return results.stored_result(job_id, value, self.settings.serializer, limit)

    def _started_late(self, job: dict[str, Any]) -> None:
        """A rate-limited run given back unrun: its handler would have started too late. The
        starts counted for it go back too, so that a window does not stay used up by runs
        that never started (on a loaded machine, a whole window of a key could be)."""
        self._flow.give_back(job.pop(COUNTED, []))
        log_event(
            logging.INFO,
            "start-too-late",
            **self._fields(job),
            hint="its rate limit counted its start more than flow.RATE_MARGIN before now; "
            "the job goes back to the queue unrun and uncharged (an overloaded worker)",
        )

    # --- the outcome ----------------------------------------------------------------------

    def _retry_at(
        self, job: dict[str, Any], context: JobContext, exc: Exception
    ) -> tuple[datetime | None, int]:
        """When a failed run's job runs again (None: it fails for good), and retries left.
        A job type no handler knows fails for good at once: no retry could succeed, so the
        retry strategy is not asked."""
        attempt = attempt_of(job)
        fields = self._fields(job)
        if isinstance(exc, UnknownJobTypeError):
            log_event(
                logging.INFO,
                "not-retrying",
                **fields,
                hint="no handler knows the job type; a retry could not succeed",
            )
            return None, 0
        strategy = self._strategy(job, context, exc)
        try:
            left = strategy.retries_left(attempt) if strategy is not None else 0
            retry_at = strategy.retry_at(attempt, self.now()) if strategy and left > 0 else None
        except Exception as error:
            # A delay beyond what a date can hold, or a clock that fails: no retry can be
            # scheduled, so the job ends as failed with the reason.
            log_event(
                logging.ERROR,
                "retry-strategy-error",
                **fields,
                error=repr(error),
                hint="the retry could not be scheduled; the job is archived as failed",
            )
            return None, 0
        if retry_at is None:
            log_event(logging.INFO, "not-retrying", **fields)
        return retry_at, left

    def _snoozed(
        self, job: dict[str, Any], snooze: Snooze, write: Callable[[datetime], bool]
    ) -> bool:
        """Put a snoozed job back, due in the snooze's seconds, by ``write`` (given the due
        time; False: the job was not the run's any more, nothing to log), and log it."""
        until = self.now() + snooze.delay
        if not write(until):
            return False
        log_event(
            logging.INFO,
            "job-snoozed",
            **self._fields(job),
            seconds=snooze.seconds,
            process_at=until.isoformat(),
            hint="the handler raised Snooze: the job runs again then, with the same attempt",
        )
        return True

    def _strategy(
        self, job: dict[str, Any], context: JobContext, exc: Exception
    ) -> RetryStrategy | None:
        retry_strategy = self.settings.retry_strategy_for(job["job_type"])
        if retry_strategy is None:
            return None
        try:
            return as_retry_strategy(retry_strategy(context, exc))
        except Exception as error:
            log_event(
                logging.ERROR,
                "retry-strategy-error",
                **self._fields(job),
                error=repr(error),
                hint="the retry strategy raised; the job is archived as failed",
            )
            return None

    def _finished(
        self,
        job: dict[str, Any],
        outcome: Outcome,
        failure: Failure | None,
        started: float | None = None,
    ) -> None:
        """After the commit: count the outcome; log a success (``job-finished``, with the
        seconds since its handler started, ``started`` by ``time.monotonic()``) or a failure
        for good (``job-failed``, with the traceback the archive keeps) and call the
        failed-job handler."""
        if self._on_outcome is not None:
            self._on_outcome(outcome)
        if outcome == "succeeded" and finished_logger.isEnabledFor(logging.INFO):
            seconds = None if started is None else round(time.monotonic() - started, 3)
            log_to(
                finished_logger, logging.INFO, "job-finished", **self._fields(job), seconds=seconds
            )
        if failure is None:
            return
        context, exc = failure
        log_event(
            logging.ERROR,
            "job-failed",
            **self._fields(job),
            error=repr(exc),
            traceback=describe(exc),
            hint="archived as failed: `sqla-proletarian failed` lists it, `retry-failed` "
            "puts it back in the queue",
        )
        if self.settings.failed_job_handler is None:
            return
        try:
            self.settings.failed_job_handler(context, exc)
        except Exception as error:
            log_event(
                logging.ERROR,
                "failed-job-handler-error",
                **self._fields(job),
                error=repr(error),
                hint="the job stays archived as failed",
            )

    def _fields(self, job: dict[str, Any]) -> dict[str, Any]:
        return {
            "worker_id": self.settings.worker_id,
            "thread_name": self._unit_name(),
            "job_id": job["job_id"],
            "job_type": job["job_type"],
            "queue": job["queue"],
            "attempt": attempt_of(job),
        }


def read_alone(conn: Connection, statement: sql.Statement) -> Any:
    """The first row of one read on the claim's connection, in a transaction of its own."""
    rows = read_rows(conn, [statement])
    return rows[0] if rows else None


def read_rows(conn: Connection, statements: Iterable[sql.Statement]) -> list[Any]:
    """The rows of some reads on the claim's connection, in one transaction of their own."""
    return read_apart(
        conn, lambda: [row for statement in statements for row in conn.execute(*statement)]
    )


def read_apart(conn: Connection, read: Callable[[], T]) -> T:
    """What ``read`` returned, its reads made on the claim's connection in one transaction of
    their own."""
    try:
        result = read()
        conn.rollback()
    except BaseException:
        rollback_quietly(conn)
        raise
    return result


def priority_entries(conn: Connection, queue: str) -> Iterator[tuple[int, datetime]]:
    """Each priority of a queue (``run_order``) with its earliest ``process_at``, highest
    first, read as the caller goes on: one statement and one entry of the poll index each
    (``Dialect.priority_scan`` "hops"); none when the queue is paused."""
    rows = direct.execute(conn, *sql.first_entry(queue)).rows
    while rows:
        run_order, earliest = rows[0]
        yield run_order, earliest
        rows = direct.execute(conn, *sql.first_entry(queue, after=run_order)).rows


def due_run_orders(
    conn: Connection, queue: str, now: datetime, scan: PriorityScan
) -> Iterable[int]:
    """The priorities (``run_order``) of a queue that have a job due at ``now``, running or
    not, highest first, unless the queue is paused; hops are read as the caller goes on, so a
    claim that has its batch reads no further. No job scheduled for later is read."""
    if scan == "hops":
        entries = priority_entries(conn, queue)
        return (run_order for run_order, earliest in entries if earliest <= now)
    return sorted(direct.execute(conn, *sql.due_run_orders(queue, now)).scalars())


def next_due_at(conn: Connection, queue: str, scan: PriorityScan) -> datetime | None:
    """When the queue's earliest job is due, running or not (None: no job, or the queue is
    paused); no job but each priority's first is read."""
    if scan == "hops":
        return min((earliest for _, earliest in priority_entries(conn, queue)), default=None)
    return min(direct.execute(conn, *sql.next_due(queue)).scalars(), default=None)


def is_due(conn: Connection, queue: str, now: datetime, scan: PriorityScan) -> bool:
    """Whether a job of the queue is due at ``now``, running or not, unless the queue is
    paused; no job scheduled for later is read."""
    if scan == "hops":
        return any(earliest <= now for _, earliest in priority_entries(conn, queue))
    return bool(direct.execute(conn, *sql.due_job(queue, now)).rows)


def any_due_in(conn: Connection, queues: Sequence[str], now: datetime, scan: PriorityScan) -> bool:
    """Whether a job of any of the queues is due at ``now`` (see is_due)."""
    return any(is_due(conn, queue, now, scan) for queue in queues)


@dataclass(frozen=True)
class QueueEnds:
    """What one read of the poll index (``sql.queue_ends``) tells of a worker's queues: for
    each queue that has a job and is not paused, its highest priority's earliest
    ``process_at`` and whether it has other priorities."""

    #: The queues in claim order, with (earliest, several priorities) where known.
    queues: tuple[tuple[str, tuple[datetime, bool] | None], ...]

    @classmethod
    def read(cls, conn: Connection, queues: tuple[str, ...]) -> QueueEnds:
        """One statement, whatever the number of queues."""
        first: dict[int, tuple[int, datetime]] = {}
        last: dict[int, int] = {}
        for place, is_last, run_order, process_at in direct.execute(
            conn, *sql.queue_ends(queues)
        ).rows:
            if is_last:
                last[place] = run_order
            else:
                first[place] = (run_order, process_at)
        ends: list[tuple[str, tuple[datetime, bool] | None]] = []
        for place, queue in enumerate(queues):
            if place not in first:
                ends.append((queue, None))  # no job, or paused
                continue
            run_order, earliest = first[place]
            ends.append((queue, (earliest, last.get(place, run_order) != run_order)))
        return cls(tuple(ends))

    def to_poll(self, now: datetime) -> tuple[str, ...]:
        """The queues a claim at ``now`` polls, in claim order: those whose highest priority
        has a job due, and those with several priorities, whose others may have one (the poll
        reads them); none of those whose only priority has no job due yet, or no job."""
        return tuple(
            queue for queue, end in self.queues if end is not None and (end[0] <= now or end[1])
        )

    def next_due(self) -> tuple[datetime | None, tuple[str, ...]]:
        """The earliest ``process_at`` of the queues' first priorities (None: none), and the
        queues with several priorities, whose others this read did not see."""
        times = [end[0] for _, end in self.queues if end is not None]
        unseen = tuple(queue for queue, end in self.queues if end is not None and end[1])
        return min(times, default=None), unseen


def next_due_in(conn: Connection, queues: Sequence[str], scan: PriorityScan) -> datetime | None:
    """When the queues' earliest job is due (see next_due_at); None: none. One statement for
    all the queues (``QueueEnds``), then the priorities' first entries of the queues that
    have several."""
    earliest, unseen = QueueEnds.read(conn, tuple(queues)).next_due()
    times = [earliest, *(next_due_at(conn, queue, scan) for queue in unseen)]
    return min((when for when in times if when is not None), default=None)


def rollback_quietly(conn: Connection) -> None:
    """Roll back the claim's transaction; a dead connection has nothing left to roll back.

    A transaction whose COMMIT failed (a deadlock, a Galera cluster's certification) is no
    longer active, yet ends only with this rollback: the connection could begin no other.
    """
    try:
        if conn.get_transaction() is not None and not conn.invalidated:
            conn.rollback()
    except Exception as exc:
        log_event(logging.DEBUG, "rollback-error", error=repr(exc))


#: Return values that are neither awaitables nor generators, whatever else they are.
_PLAIN_RESULTS = frozenset({str, int, float, bool, dict, list, tuple, bytes})


def _check_result(result: object) -> None:
    """A handler that returned an awaitable or a generator never ran its body: say so."""
    if result is None or type(result) in _PLAIN_RESULTS:
        return
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise ProletarianError(
            "the handler returned an awaitable, so its work never ran: this worker runs "
            "plain functions; run async handlers in the asyncio worker "
            "(create_async_queue_worker, which `sqla-proletarian worker` picks for an "
            "`async def` handler), or wrap async code with asyncio.run"
        )
    if inspect.isgenerator(result):
        result.close()
    if inspect.isgenerator(result) or inspect.isasyncgen(result):
        raise ProletarianError(
            "the handler returned a generator, so its body never ran: handlers must be "
            "plain functions, not generators"
        )
