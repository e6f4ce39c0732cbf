"""Looking at the queues without getting in the workers' way: counts per queue, failures.

Every query here is a plain read (no ``FOR UPDATE``, no lock a worker could wait for) that
walks an index: the job table's poll index ``(queue, process_at, seq)``, the archive's
``finished_at`` index, and the crash ledger, which holds one row per claimed job. Counts are
grouped in the database; no table is loaded into Python.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Connection, Engine

from sqla_proletarian import ledger
from sqla_proletarian import statements as sql
from sqla_proletarian.dialects import Dialect, dialect_of
from sqla_proletarian.errors import ConfigurationError
from sqla_proletarian.values import Clock, check_name, utc_now

__all__ = ["DEFAULT_FAILED_LIMIT", "FailedJob", "QueueStatus", "failed_jobs", "queue_status"]

#: How many failures ``failed_jobs`` returns unless told otherwise.
DEFAULT_FAILED_LIMIT = 100
#: The most ``failed_jobs`` returns at once.
MAX_FAILED_LIMIT = 100_000
#: The window of ``succeeded_last_hour`` and ``failed_last_hour``.
RECENT = timedelta(hours=1)


@dataclass(frozen=True)
class QueueStatus:
    """One queue at one moment.

    ``ready``: due now and not claimed; ``scheduled``: due later (retries waiting included);
    ``running``: claimed right now by a live worker; ``oldest_ready_age_s``: seconds since
    the oldest ready job became due (None when none is ready); ``succeeded_last_hour`` and
    ``failed_last_hour``: archived in the last hour; ``paused``: workers do not claim from
    it (``sp.pause_queue``); ``by_priority``: the queued jobs (ready, scheduled and running)
    per priority, highest first.
    """

    queue: str
    ready: int
    scheduled: int
    running: int
    oldest_ready_age_s: float | None
    succeeded_last_hour: int
    failed_last_hour: int
    paused: bool = False
    by_priority: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class FailedJob:
    """An archived failure: the job as it was enqueued, its runs, and the error that ended
    it (type, message and where it was raised). ``payload`` is the stored text."""

    job_id: uuid.UUID
    queue: str
    job_type: str
    payload: str
    attempts: int
    enqueued_at: datetime
    process_at: datetime
    finished_at: datetime
    error: str | None


def queue_status(bind: Engine | Connection, *, clock: Clock = utc_now) -> list[QueueStatus]:
    """Every queue that has jobs, archived some in the last hour, or is paused, sorted by
    name.

    ``running`` counts the jobs whose run record (``proletarian_job_run``) belongs to a live
    owner, checked without taking any lock: on PostgreSQL by reading ``pg_locks`` for the
    owner's advisory lock, on MySQL/MariaDB with ``IS_USED_LOCK``, on SQLite by the owner's
    process id on this machine. A batch's jobs count from its claim on, those not started
    yet included. A worker with crash accounting off (``max_unclean_ends=None``) writes no
    run records, so the jobs it runs are counted as ready, not running; records of dead
    workers count as nothing (their jobs are ready again). ``ready`` is what is due minus
    what is running, and the oldest ready job is the oldest due one no live worker holds.
    """
    now = clock()
    with _reading(bind, "queue_status") as conn:
        dialect = dialect_of(conn)
        counts = {row.queue: row for row in conn.execute(*sql.queue_counts(now))}
        finished = {row.queue: row for row in conn.execute(*sql.finished_counts(now - RECENT))}
        paused = set(conn.execute(*sql.paused_names()).scalars())
        by_priority: dict[str, dict[int, int]] = {}
        for row in conn.execute(*sql.priority_counts()):
            by_priority.setdefault(row.queue, {})[-int(row.run_order)] = int(row.jobs)
        claimed = conn.execute(*sql.claimed_runs()).all()
        live = _live_owners(dialect, conn, {row.owner for row in claimed})
        running: dict[str, int] = {}
        for row in claimed:
            if row.owner in live:
                running[row.queue] = running.get(row.queue, 0) + int(row.jobs)
        statuses = []
        for queue in sorted(set(counts) | set(finished) | paused):
            due = int(counts[queue].due) if queue in counts else 0
            busy = running.get(queue, 0)
            oldest: datetime | None = counts[queue].oldest_due if queue in counts else None
            if oldest is not None and busy:
                oldest = conn.execute(*sql.oldest_unclaimed(queue, now, sorted(live))).scalar()
            ready = max(0, due - busy)
            age = max(0.0, (now - oldest).total_seconds()) if oldest and ready else None
            statuses.append(
                QueueStatus(
                    queue=queue,
                    ready=ready,
                    scheduled=int(counts[queue].scheduled) if queue in counts else 0,
                    running=busy,
                    oldest_ready_age_s=age,
                    succeeded_last_hour=int(finished[queue].succeeded) if queue in finished else 0,
                    failed_last_hour=int(finished[queue].failed) if queue in finished else 0,
                    paused=queue in paused,
                    by_priority=dict(sorted(by_priority.get(queue, {}).items(), reverse=True)),
                )
            )
    return statuses


def failed_jobs(
    bind: Engine | Connection,
    *,
    queue: str | None = None,
    job_type: str | None = None,
    limit: int = DEFAULT_FAILED_LIMIT,
) -> list[FailedJob]:
    """The archived failures, newest first, optionally of one queue and one job type."""
    if queue is not None:
        check_name("queue", queue)
    if job_type is not None:
        check_name("job_type", job_type)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_FAILED_LIMIT:
        raise ConfigurationError(
            f"limit={limit!r}: give a whole number of failures from 1 to {MAX_FAILED_LIMIT} "
            f"(default {DEFAULT_FAILED_LIMIT})"
        )
    with _reading(bind, "failed_jobs") as conn:
        rows = conn.execute(*sql.failed_jobs(limit, queue=queue, job_type=job_type)).all()
    return [
        FailedJob(
            job_id=row.job_id,
            queue=row.queue,
            job_type=row.job_type,
            payload=row.payload,
            attempts=row.attempts,
            enqueued_at=row.enqueued_at,
            process_at=row.process_at,
            finished_at=row.finished_at,
            error=row.error,
        )
        for row in rows
    ]


@contextmanager
def _reading(bind: Engine | Connection, caller: str) -> Iterator[Connection]:
    """A connection to read with: the caller's own, or one of the engine's, closed after."""
    if isinstance(bind, Connection):
        yield bind
    elif isinstance(bind, Engine):
        with bind.connect() as conn:
            yield conn
    else:
        raise ConfigurationError(
            f"{caller}() needs a sqlalchemy Engine or Connection, not {type(bind).__name__}"
        )


def _live_owners(dialect: Dialect, conn: Connection, owners: set[str | None]) -> set[str]:
    """The owners of run records whose worker is alive, found without taking their locks."""
    named = sorted(owner for owner in owners if owner)
    kind = dialect.owner_lock
    if not named or kind == "none":
        return set()
    if kind == "advisory":
        held = {(int(c), int(o)) for c, o in conn.execute(*sql.advisory_locks_held())}
        return {owner for owner in named if _advisory_tag(owner) in held}
    if kind == "named":
        holders = conn.execute(*sql.used_locks(named)).one()
        return {owner for owner, holder in zip(named, holders, strict=True) if holder is not None}
    return {owner for owner in named if not ledger.owner_gone(kind, owner, conn)}


def _advisory_tag(owner: str) -> tuple[int, int] | None:
    try:
        return sql.advisory_lock_tag(owner)
    except ValueError:  # not an owner token this library wrote
        return None
