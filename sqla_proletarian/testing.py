"""Helpers for an application's own tests: run the due jobs now, and see what was enqueued.

``drain`` runs every due job in the calling thread through the worker's own machinery (the
same claim, handler call, retries, archive and failed-job handler as a ``QueueWorker``), so
a test needs no threads and no sleeps. ``enqueued_jobs`` reads the queue back as frozen
values, to assert on what a code path enqueued. The pytest plugin
(``sqla_proletarian.pytest_plugin``) builds fixtures on both.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, Select, select
from sqlalchemy.orm import Session, scoped_session

from sqla_proletarian.errors import (
    ConfigurationError,
    PayloadDeserializationError,
    ProletarianError,
)
from sqla_proletarian.leases import new_runner
from sqla_proletarian.models import Job
from sqla_proletarian.options import WorkerOptions
from sqla_proletarian.running import Outcome
from sqla_proletarian.serialization import DEFAULT_SERIALIZER, Serializer
from sqla_proletarian.statements import DUE_AT

__all__ = ["DEFAULT_MAX_RUNS", "DrainLimitError", "EnqueuedJob", "drain", "enqueued_jobs"]

#: Runs ``drain`` allows before it stops and raises (a job that retries forever, or
#: handlers that keep enqueueing more work): pass ``max_runs=`` for larger drains.
DEFAULT_MAX_RUNS = 1000

JOB = Job.__table__


class DrainLimitError(ProletarianError):
    """``drain`` ran ``max_runs`` jobs and found yet another one due."""

    def __init__(self, max_runs: int) -> None:
        self.max_runs = max_runs
        super().__init__(
            f"drain() ran {max_runs} jobs and more are still due: a retry strategy that "
            "never gives up on a failing job, or handlers that keep enqueueing jobs, would "
            f"never end. Pass max_runs= larger than {max_runs} if that many jobs are expected "
            "(the jobs not run are still queued, unchanged)"
        )


class _LimitReached(KeyboardInterrupt):
    """Raised in place of the handler once ``max_runs`` is reached: like an operator's
    Ctrl-C, it gives the claim back untouched (rolled back, its run record removed)."""


def drain(
    engine: Engine,
    handler: Callable[..., Any],
    *,
    max_runs: int = DEFAULT_MAX_RUNS,
    **worker_options: Any,
) -> int:
    """Run every due job of the queue (or queues) in the calling thread; return how many runs
    ended.

    A job retried with a delay that is already over by the ``clock`` runs again within the
    same call; a retry due later stays queued (move a test clock forward and drain again).
    Jobs the handlers enqueue, once due, run too. Takes the worker options (``queue``
    or ``queues``, ``handler_mode``, ``retry_strategy``, ``failed_job_handler``, ``clock``,
    ``serializer``, ``batch_size``, ``max_unclean_ends``, ...; those about threads, polling
    and signals are checked and ignored) and raises database errors. After ``max_runs``
    runs, a further due job raises ``DrainLimitError`` and stays queued as it was.
    """
    if hasattr(engine, "sync_engine") or (
        isinstance(engine, Engine) and getattr(engine.dialect, "is_async", False)
    ):
        raise ConfigurationError(
            "drain() runs jobs in the calling thread, through a synchronous driver: give it "
            "an Engine from sqlalchemy.create_engine on the same database (e.g. sqlite:// "
            "for sqlite+aiosqlite://, postgresql+psycopg:// for asyncpg) with plain-function "
            "handlers; async handlers run in the asyncio worker"
        )
    if not isinstance(engine, Engine):
        raise ConfigurationError(
            f"drain() needs the sqlalchemy Engine the jobs are in, not {type(engine).__name__}: "
            "like a worker it opens its own connections, so commit the jobs first"
        )
    if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1:
        raise ConfigurationError(f"max_runs is {max_runs!r}; give a whole number >= 1")
    if not callable(handler):
        raise ConfigurationError(f"the handler is {handler!r}; give a function")
    started = 0

    def limited(*args: Any) -> Any:
        nonlocal started
        if started >= max_runs:
            raise _LimitReached
        started += 1
        return handler(*args)

    runs = 0

    def count(outcome: Outcome) -> None:
        nonlocal runs
        runs += 1

    settings = replace(
        WorkerOptions.from_kwargs(worker_options).run_settings(handler), handler=limited
    )
    runner = new_runner(engine, settings, count)
    try:
        runner.start_keeping_owner()
        opened: Any = runner.open_connections()
        with opened as connections:
            while runner.process_one(connections):
                pass
    except _LimitReached:
        raise DrainLimitError(max_runs) from None
    finally:
        runner.progress.wait_written()  # the jobs' last progress reports are stored
        runner.close()
    return runs


@dataclass(frozen=True)
class EnqueuedJob:
    """A job waiting in the queue, as ``enqueued_jobs`` reads it (the payload decoded)."""

    job_id: uuid.UUID
    queue: str
    job_type: str
    payload: Any
    #: Runs so far that ended with an outcome (0 until its first retry).
    attempts: int
    #: When it is due (its own due time, also while a worker holds its lease).
    process_at: datetime


def _queued(queue: str | None, job_type: str | None) -> Select[Any]:
    """The queued jobs, optionally of one queue and one job type, in the order they are due
    (a leased job at its own due time, not its lease's expiry)."""
    due_at = DUE_AT.label("process_at")
    query = select(
        JOB.c.job_id, JOB.c.queue, JOB.c.job_type, JOB.c.payload, JOB.c.attempts, due_at
    ).order_by(DUE_AT, JOB.c.seq)
    if queue is not None:
        query = query.where(JOB.c.queue == queue)
    if job_type is not None:
        query = query.where(JOB.c.job_type == job_type)
    return query


def enqueued_jobs(
    bind: Engine | Connection | Session | scoped_session[Any],
    *,
    queue: str | None = None,
    job_type: str | None = None,
    serializer: Serializer = DEFAULT_SERIALIZER,
) -> list[EnqueuedJob]:
    """The jobs in the queue table, in the order they are due, optionally of one ``queue``
    and one ``job_type``, with their payloads decoded by ``serializer``.

    ``bind`` is an Engine (committed jobs), or a Connection or Session, which also sees its
    own uncommitted jobs: a Session is flushed first, so jobs it has pending are included.
    Jobs that a running worker holds are read too (reading takes no lock).
    """
    query = _queued(queue, job_type)
    if isinstance(bind, scoped_session):
        bind = bind()
    if isinstance(bind, Session):
        bind.flush()
        rows = bind.execute(query).all()
    elif isinstance(bind, Connection):
        rows = bind.execute(query).all()
    elif isinstance(bind, Engine):
        with bind.connect() as conn:
            rows = conn.execute(query).all()
    else:
        raise ConfigurationError(
            f"enqueued_jobs() reads through an Engine, Connection or Session, not "
            f"{type(bind).__name__}"
        )
    return [_decoded(row, serializer) for row in rows]


def _decoded(row: Any, serializer: Serializer) -> EnqueuedJob:
    try:
        payload = serializer.loads(row.payload)
    except Exception as exc:
        raise PayloadDeserializationError(row.job_id, str(exc)) from exc
    return EnqueuedJob(
        job_id=row.job_id,
        queue=row.queue,
        job_type=row.job_type,
        payload=payload,
        attempts=row.attempts,
        process_at=row.process_at,
    )
