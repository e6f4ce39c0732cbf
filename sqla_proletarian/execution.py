"""Running one claimed job: claim, run the handler, record the outcome, all in one transaction."""

from __future__ import annotations

import inspect
import logging
import os
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from sqla_proletarian import statements as sql
from sqla_proletarian.enqueue import Clock, check_aware
from sqla_proletarian.errors import (
    JobCrashedError,
    PayloadDeserializationError,
    ProletarianError,
)
from sqla_proletarian.handlers import JobContext, JobSession
from sqla_proletarian.logs import log_event
from sqla_proletarian.retry import RetryStrategy, as_retry_strategy
from sqla_proletarian.serialization import Serializer

Outcome = Literal["succeeded", "retried", "failed"]
RetryStrategyFn = Callable[[JobContext, Exception], RetryStrategy | None]
FailedJobHandler = Callable[[JobContext, Exception], object]

#: Longest error text kept in the archive.
MAX_ERROR_TEXT = 4000


@dataclass(frozen=True)
class RunSettings:
    """What a JobRunner needs to know, taken from the worker options."""

    queue: str
    handler: Callable[..., Any]
    handler_mode: Literal["default", "advanced"]
    retry_strategy: RetryStrategyFn | None
    failed_job_handler: FailedJobHandler | None
    serializer: Serializer
    clock: Clock
    worker_id: str
    max_unclean_ends: int | None


@dataclass
class WorkerConnections:
    """A thread's claim connection and run-ledger connection, released together."""

    conn: Connection
    ledger: Connection | None
    _stack: ExitStack
    #: The server's idle-transaction limit where its errors do not name it (for log hints).
    idle_timeout: float | None = None

    def close(self) -> None:
        try:
            self._stack.close()
        except Exception as exc:
            log_event(logging.DEBUG, "connection-close-error", error=repr(exc))

    def __enter__(self) -> WorkerConnections:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass
class _Run:
    run_id: uuid.UUID | None
    unclean_ends: int
    started: float = field(default_factory=time.monotonic)


def describe(exc: BaseException) -> str:
    """The archive's error text: the exception type, message and where it was raised."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f"\n  at {last.filename}:{last.lineno} in {last.name}"
    return text[:MAX_ERROR_TEXT]


class JobRunner:
    """Claims and runs jobs one transaction at a time. Thread-safe; shared by worker threads."""

    def __init__(
        self,
        engine: Engine,
        settings: RunSettings,
        on_outcome: Callable[[Outcome], None] | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.backend = sql.backend_for(engine)
        self._on_outcome = on_outcome
        self._connect_lock = threading.Lock()
        self._claim_lock = threading.Lock()
        self._host = f"{socket.gethostname()}:{os.getpid()}"
        #: Whether runs are recorded (the crash ledger), and on a connection of their own.
        self._tracked = settings.max_unclean_ends is not None
        self._separate_ledger = self._tracked and self.backend.separate_run_connection

    def now(self) -> datetime:
        return check_aware("clock()", self.settings.clock())

    @property
    def connections_per_thread(self) -> int:
        """Connections a claiming thread holds: its claim's, plus the run ledger's."""
        return 2 if self._separate_ledger else 1

    def open_connections(self) -> WorkerConnections:
        """The connections a thread claims with; hold them across jobs, close on errors."""
        stack = ExitStack()
        # Take both connections together, one thread at a time, so that threads sharing a
        # small pool wait for it instead of each holding one and waiting forever.
        with self._connect_lock, stack:
            conn = stack.enter_context(self.backend.worker_connection(self.engine))
            ledger = None
            if self._separate_ledger:
                ledger = stack.enter_context(self.backend.run_ledger_connection(self.engine))
            idle_timeout = self.backend.idle_timeout(conn)
            return WorkerConnections(conn, ledger, stack.pop_all(), idle_timeout)
        raise AssertionError("unreachable")  # pragma: no cover

    def process_one(self, connections: WorkerConnections | None = None) -> bool:
        """Claim and run at most one job; True if a job was claimed."""
        if connections is not None:
            return self._claim_one(connections)
        with self.open_connections() as opened:
            return self._claim_one(opened)

    def _claim_one(self, connections: WorkerConnections) -> bool:
        if not self.backend.claim_takes_write_lock:
            return self._process(connections)
        # SQLite runs one job at a time per file anyway; taking turns inside the process
        # also keeps a thread from claiming a job between another's run record and its
        # re-claim (which would count an unclean end that never happened).
        with self._claim_lock:
            return self._process(connections)

    # --- one claim ------------------------------------------------------------------------

    def _process(self, connections: WorkerConnections) -> bool:
        conn, ledger = connections.conn, connections.ledger
        run: _Run | None = None
        conn.begin()
        try:
            self.backend.begin_claim(conn)
            log_event(
                logging.DEBUG,
                "polling-for-jobs",
                worker_id=self.settings.worker_id,
                queue=self.settings.queue,
            )
            claim = sql.poll(self.settings.queue, self.now(), with_runs=self._tracked)
            row = conn.execute(*claim).mappings().first()
            if row is None:
                conn.commit()
                return False
            job = dict(row)
            run = self._start_run(conn, ledger, job)
            if run is None:
                conn.commit()
                return True
            outcome, failure = self._run(conn, job, run)
            conn.commit()
        except BaseException as exc:
            _rollback_quietly(conn)
            if run is not None:
                self._interrupted(connections, job, run, exc)
            raise
        self._finished(job, outcome, failure)
        return True

    def _interrupted(
        self, connections: WorkerConnections, job: dict[str, Any], run: _Run, exc: BaseException
    ) -> None:
        """A claimed job's transaction ended without its outcome: say why, and whether the
        run counts as an unclean end."""
        ledger = connections.ledger or connections.conn
        if isinstance(exc, KeyboardInterrupt):
            # Interrupted by the operator: the job is left untouched, and its run is not an
            # unclean end. A SystemExit or other BaseException from the handler keeps its
            # record, so a job that always exits its worker cannot loop forever.
            if run.run_id is not None:
                self._forget_run(ledger, run.run_id)
            return
        if not isinstance(exc, Exception):
            return
        if sql.is_lock_conflict(exc) and not connections.conn.invalidated:
            log_event(
                logging.WARNING,
                "job-outcome-rolled-back",
                **self._fields(job),
                error=repr(exc),
                hint="a deadlock or lock wait timeout rolled back the job's transaction "
                "while its outcome was recorded; the job will run again",
            )
            if run.run_id is not None:
                self._forget_run(ledger, run.run_id)
            return
        log_event(
            logging.ERROR,
            "job-connection-lost",
            **self._fields(job),
            error=repr(exc),
            hint=sql.connection_loss_hint(
                exc, time.monotonic() - run.started, connections.idle_timeout
            ),
        )

    def _forget_run(self, conn: Connection, run_id: uuid.UUID) -> None:
        try:
            conn.execute(*sql.end_run(run_id))
            if conn.in_transaction():
                conn.commit()
        except Exception as exc:
            log_event(logging.WARNING, "run-record-cleanup-error", error=repr(exc))

    def _start_run(
        self, conn: Connection, ledger: Connection | None, job: dict[str, Any]
    ) -> _Run | None:
        """Record the run before the handler starts; None if the job was lost meanwhile.

        Every run leaves a record; a failed run's record stays beside the attempt it
        counted, so the records beyond ``attempts`` are the runs that ended uncleanly.
        """
        if not self._tracked:
            return _Run(None, 0)
        unclean_ends = max(0, job.pop("runs") - job["attempts"])
        run_id = uuid.uuid4()
        worker = f"{self.settings.worker_id}@{self._host}/{threading.current_thread().name}"
        record = sql.start_run(run_id, job["job_id"], worker[:255], self.now())
        if ledger is not None:
            ledger.execute(*record)
            return _Run(run_id, unclean_ends)
        # One connection (SQLite): commit the record, then take the job again.
        conn.execute(*record)
        conn.commit()
        conn.begin()
        self.backend.begin_claim(conn)
        again = conn.execute(*sql.reselect(job["job_id"])).mappings().first()
        if again is None:
            conn.execute(*sql.end_run(run_id))
            return None
        job.update(again)
        return _Run(run_id, unclean_ends)

    def _run(
        self, conn: Connection, job: dict[str, Any], run: _Run
    ) -> tuple[Outcome, tuple[JobContext, Exception] | None]:
        """Run the handler and write the outcome into the claim's transaction."""
        fields = self._fields(job)
        session = JobSession(conn)
        try:
            try:
                payload = self.settings.serializer.loads(job["payload"])
                decode_error = None
            except Exception as exc:
                payload = job["payload"]
                decode_error = PayloadDeserializationError(job["job_id"], str(exc))
            context = JobContext(
                job_id=job["job_id"],
                queue=job["queue"],
                job_type=job["job_type"],
                payload=payload,
                attempts=job["attempts"] + 1,
                enqueued_at=job["enqueued_at"],
                process_at=job["process_at"],
                session=session,
            )
            limit = self.settings.max_unclean_ends
            # The archive's attempts count every run, those that ended uncleanly included.
            runs = job["attempts"] + run.unclean_ends + 1
            if limit is not None and run.unclean_ends >= limit:
                crashed = JobCrashedError(job["job_id"], run.unclean_ends)
                log_event(logging.ERROR, "job-crashed", **fields, unclean_ends=run.unclean_ends)
                return self._fail(conn, job, context, crashed, runs - 1)
            if run.unclean_ends:
                log_event(
                    logging.WARNING, "job-interrupted", **fields, unclean_ends=run.unclean_ends
                )
            log_event(logging.DEBUG, "handling-job", **fields)
            try:
                if decode_error is not None:
                    raise decode_error
                self._call_handler(context)
                session.finish()
            except Exception as exc:
                _discard(session)
                if conn.invalidated:
                    # The job's transaction is gone with its connection: nothing can be
                    # recorded; the job runs again, and this run counts as an unclean end.
                    raise
                log_event(logging.WARNING, "handle-job-exception", **fields, error=repr(exc))
                return self._after_exception(conn, job, context, exc, runs)
            self._archive(conn, job, "success", runs, None)
            log_event(logging.DEBUG, "job-finished", **fields)
            return "succeeded", None
        finally:
            _discard(session)

    def _call_handler(self, context: JobContext) -> None:
        if self.settings.handler_mode == "advanced":
            result = self.settings.handler(context)
        else:
            result = self.settings.handler(context.job_type, context.payload)
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()
            raise ProletarianError(
                "the handler returned an awaitable, so its work never ran: handlers must be "
                "plain functions (wrap async code with asyncio.run)"
            )
        if inspect.isgenerator(result):
            result.close()
        if inspect.isgenerator(result) or inspect.isasyncgen(result):
            raise ProletarianError(
                "the handler returned a generator, so its body never ran: handlers must be "
                "plain functions, not generators"
            )

    def _after_exception(
        self, conn: Connection, job: dict[str, Any], context: JobContext, exc: Exception, runs: int
    ) -> tuple[Outcome, tuple[JobContext, Exception] | None]:
        attempt = job["attempts"] + 1
        strategy = self._strategy(job, context, exc)
        left = strategy.retries_left(attempt) if strategy is not None else 0
        fields = self._fields(job)
        if strategy is None or left <= 0:
            log_event(logging.INFO, "not-retrying", **fields)
            return self._fail(conn, job, context, exc, runs)
        retry_at = strategy.retry_at(attempt, self.now())
        conn.execute(*sql.retry(job["job_id"], retry_at))
        log_event(
            logging.INFO, "retrying", **fields, retry_at=retry_at.isoformat(), retries_left=left
        )
        return "retried", None

    def _strategy(
        self, job: dict[str, Any], context: JobContext, exc: Exception
    ) -> RetryStrategy | None:
        if self.settings.retry_strategy is None:
            return None
        try:
            return as_retry_strategy(self.settings.retry_strategy(context, exc))
        except Exception as error:
            log_event(
                logging.ERROR,
                "retry-strategy-error",
                **self._fields(job),
                error=repr(error),
                hint="the retry strategy raised; the job is archived as failed",
            )
            return None

    def _fail(
        self,
        conn: Connection,
        job: dict[str, Any],
        context: JobContext,
        exc: Exception,
        attempts: int,
    ) -> tuple[Outcome, tuple[JobContext, Exception] | None]:
        self._archive(conn, job, "failure", attempts, describe(exc))
        return "failed", (context, exc)

    def _archive(
        self, conn: Connection, job: dict[str, Any], status: str, attempts: int, error: str | None
    ) -> None:
        archived = conn.execute(
            *sql.archive(
                job,
                status=status,
                attempts=attempts,
                finished_at=self.now(),
                error=error,
                dialect=self.backend.name,
            )
        )
        if archived.rowcount == 0:
            log_event(
                logging.WARNING,
                "archive-conflict",
                **self._fields(job),
                status=status,
                hint="the archive already holds a job with this id (enqueued again with the "
                "same job_id); the earlier row is kept and this job leaves the queue",
            )
        if not self._tracked:
            conn.execute(*sql.delete_job(job["job_id"]))
        elif self.backend.deletes_runs_with_job:
            conn.execute(*sql.delete_job_and_runs(job["job_id"]))
        else:
            conn.execute(*sql.delete_job(job["job_id"]))
            conn.execute(*sql.end_runs(job["job_id"]))

    def _finished(
        self,
        job: dict[str, Any],
        outcome: Outcome,
        failure: tuple[JobContext, Exception] | None,
    ) -> None:
        """After the commit: count the outcome and call the failed-job handler."""
        if self._on_outcome is not None:
            self._on_outcome(outcome)
        if failure is None or self.settings.failed_job_handler is None:
            return
        context, exc = failure
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
            "thread_name": threading.current_thread().name,
            "job_id": job["job_id"],
            "job_type": job["job_type"],
            "queue": job["queue"],
            "attempt": job["attempts"] + 1,
        }


def _rollback_quietly(conn: Connection) -> None:
    """Roll back the claim's transaction; a dead connection has nothing left to roll back."""
    try:
        if conn.in_transaction() and not conn.invalidated:
            conn.rollback()
    except Exception as exc:
        log_event(logging.DEBUG, "rollback-error", error=repr(exc))


def _discard(session: Session) -> None:
    """Close a handler's session, rolling back what it did not commit."""
    try:
        session.close()
    except Exception as exc:
        log_event(logging.DEBUG, "session-close-error", error=repr(exc))
