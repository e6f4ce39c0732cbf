"""Looking at the queues without getting in the workers' way: counts per queue, failures.

Every query here is a plain read (no ``FOR UPDATE``, no lock a worker could wait for):
pages walk an index (the job table's poll index ``(queue, run_order, process_at, seq)``, the
archive's ``finished_at`` index, and the crash ledger, which holds one row per claimed job);
the per-queue counts and the live leases are one pass over the job table, since no index
names leases. Counts are grouped in the database; no table is loaded into Python.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine

from sqla_proletarian import ledger
from sqla_proletarian import statements as sql
from sqla_proletarian.dialects import Dialect, dialect_of
from sqla_proletarian.errors import ConfigurationError, ProletarianError
from sqla_proletarian.limits import QueueLimits, read_limits
from sqla_proletarian.statements import progress as graph
from sqla_proletarian.values import Clock, check_name, utc_now

__all__ = [
    "DEFAULT_FAILED_LIMIT",
    "DEFAULT_PAGE_SIZE",
    "JOB_STATES",
    "EarlierOutcome",
    "FailedJob",
    "FinishedMinute",
    "JobDetail",
    "JobInfo",
    "JobPage",
    "QueueStatus",
    "failed_jobs",
    "finished_per_minute",
    "get_job",
    "list_jobs",
    "queue_status",
]

#: How many failures ``failed_jobs`` returns unless told otherwise.
DEFAULT_FAILED_LIMIT = 100
#: The most ``failed_jobs`` returns at once.
MAX_FAILED_LIMIT = 100_000
#: The window of ``succeeded_last_hour`` and ``failed_last_hour``.
RECENT = timedelta(hours=1)


@dataclass(frozen=True)
class QueueStatus:
    """One queue at one moment.

    ``ready``: due now and not claimed, jobs whose lease expired included (their worker
    died or froze; the next poll takes them again); ``scheduled``: due later (retries
    waiting included); ``running``: claimed right now by a live worker, in a transaction
    or under a live lease; ``oldest_ready_age_s``: seconds since the oldest ready job
    became due (None when none is ready); ``succeeded_last_hour`` and
    ``failed_last_hour``: archived in the last hour; ``paused``: workers do not claim from
    it (``sp.pause_queue``); ``by_priority``: the queued jobs (ready, scheduled and running)
    per priority, highest first; ``expired_leases``: the ready jobs whose lease expired;
    ``unhandled_job_types``: job types queued here whose last job archived in the last hour
    failed because the worker's handlers did not know the type (``UnknownJobTypeError``),
    with none of them succeeding since: what the archive can tell of the last worker's
    handlers (a type no worker ran in the last hour is not flagged); ``limits``: the
    queue's limits (``sp.set_queue_limits``), None when it has none; ``waiting``: of a
    queue with limits, its ready jobs, each waiting for room under the limits (or for a
    free worker), never failed for it; None for a queue without limits;
    ``waiting_on_dependencies``: its jobs waiting for their dependencies to end (state
    ``waiting``, enqueued with ``depends_on``), counted in none of the other counts but
    ``by_priority``.
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
    expired_leases: int = 0
    unhandled_job_types: tuple[str, ...] = ()
    limits: QueueLimits | None = None
    waiting: int | None = None
    waiting_on_dependencies: int = 0


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


@dataclass
class _QueueCounts:
    """One queue's counts, summed over its priorities: unleased jobs due and due later,
    leased jobs under a live and an expired lease."""

    due: int = 0
    scheduled: int = 0
    leased: int = 0
    expired: int = 0
    oldest_due: datetime | None = None
    oldest_expired: datetime | None = None

    def add(self, row: Any) -> None:
        self.due += int(row.due)
        self.scheduled += int(row.scheduled)
        self.leased += int(row.leased)
        self.expired += int(row.expired)
        self.oldest_due = _earlier(self.oldest_due, row.oldest_due)
        self.oldest_expired = _earlier(self.oldest_expired, row.oldest_expired)


def _earlier(one: datetime | None, other: datetime | None) -> datetime | None:
    if one is None or other is None:
        return other if one is None else one
    return min(one, other)


def queue_status(bind: Engine | Connection, *, clock: Clock = utc_now) -> list[QueueStatus]:
    """Every queue that has jobs, archived some in the last hour, is paused or has limits,
    sorted by name.

    ``running`` counts the jobs whose run record (``proletarian_job_run``) belongs to a live
    owner, checked without taking any lock: on PostgreSQL by reading ``pg_locks`` for the
    owner's advisory lock, on MySQL/MariaDB with ``IS_USED_LOCK``, on SQLite by the owner's
    process id on this machine. A batch's jobs count from its claim on, those not started
    yet included. A worker with crash accounting off (``max_unclean_ends=None``) writes no
    run records, so the jobs it runs are counted as ready, not running; records of dead
    workers count as nothing (their jobs are ready again). A job under a live lease (lease
    mode) counts as running; one whose lease expired as ready, from its own due time.
    ``ready`` is what is due minus what is running, and the oldest ready job is the oldest
    due one no live worker holds.
    """
    now = clock()
    with _reading(bind, "queue_status") as conn:
        dialect = dialect_of(conn)
        counts: dict[str, _QueueCounts] = {}
        by_priority: dict[str, dict[int, int]] = {}
        for row in conn.execute(*sql.queue_counts(now)):
            counts.setdefault(row.queue, _QueueCounts()).add(row)
            jobs = int(row.due) + int(row.scheduled) + int(row.leased) + int(row.expired)
            by_priority.setdefault(row.queue, {})[-int(row.run_order)] = jobs
        finished = {row.queue: row for row in conn.execute(*sql.finished_counts(now - RECENT))}
        waiting = {row.queue: int(row.jobs) for row in conn.execute(*graph.waiting_counts())}
        unhandled = _unhandled_types(conn, now - RECENT)
        paused = set(conn.execute(*sql.paused_names()).scalars())
        limits = read_limits(conn)
        claimed = conn.execute(*sql.claimed_runs()).all()
        live = _live_owners(dialect, conn, {row.owner for row in claimed})
        running: dict[str, int] = {}
        for row in claimed:
            if row.owner in live:
                running[row.queue] = running.get(row.queue, 0) + int(row.jobs)
        statuses = []
        for queue in sorted(set(counts) | set(finished) | paused | set(limits)):
            tally = counts.get(queue, _QueueCounts())
            busy = running.get(queue, 0)
            oldest = tally.oldest_due
            if oldest is not None and busy:
                oldest = conn.execute(*sql.oldest_unclaimed(queue, now, sorted(live))).scalar()
            free = max(0, tally.due - busy)
            oldest = _earlier(oldest if free else None, tally.oldest_expired)
            ready = free + tally.expired
            age = max(0.0, (now - oldest).total_seconds()) if oldest and ready else None
            statuses.append(
                QueueStatus(
                    queue=queue,
                    ready=ready,
                    scheduled=tally.scheduled - waiting.get(queue, 0),
                    running=busy + tally.leased,
                    oldest_ready_age_s=age,
                    succeeded_last_hour=int(finished[queue].succeeded) if queue in finished else 0,
                    failed_last_hour=int(finished[queue].failed) if queue in finished else 0,
                    paused=queue in paused,
                    by_priority=dict(sorted(by_priority.get(queue, {}).items(), reverse=True)),
                    expired_leases=tally.expired,
                    unhandled_job_types=unhandled.get(queue, ()),
                    limits=limits.get(queue),
                    waiting=ready if queue in limits else None,
                    waiting_on_dependencies=waiting.get(queue, 0),
                )
            )
    return statuses


def _unhandled_types(conn: Connection, since: datetime) -> dict[str, tuple[str, ...]]:
    """Per queue, the job types queued there whose last job archived since ``since`` failed
    because no handler knew the type (none succeeded after it)."""
    found: dict[str, list[str]] = {}
    for row in conn.execute(*sql.type_ends(since)):
        if row.unknown_at is None or (
            row.handled_at is not None and row.handled_at > row.unknown_at
        ):
            continue
        if conn.execute(*sql.queued_of_type(row.queue, row.job_type)).first() is not None:
            found.setdefault(row.queue, []).append(row.job_type)
    return {queue: tuple(sorted(types)) for queue, types in found.items()}


def failed_jobs(
    bind: Engine | Connection,
    *,
    queue: str | None = None,
    job_type: str | None = None,
    limit: int = DEFAULT_FAILED_LIMIT,
) -> list[FailedJob]:
    """The archived failures, newest first, optionally of one queue and one job type."""
    _check_filters(queue, job_type, limit, "failures", MAX_FAILED_LIMIT, DEFAULT_FAILED_LIMIT)
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


def _check_filters(
    queue: str | None, job_type: str | None, limit: object, what: str, most: int, default: int
) -> None:
    """The queue and job type a read is narrowed to, and how many rows it may return."""
    if queue is not None:
        check_name("queue", queue)
    if job_type is not None:
        check_name("job_type", job_type)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= most:
        raise ConfigurationError(
            f"limit={limit!r}: give a whole number of {what} from 1 to {most} (default {default})"
        )


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
    return {owner for owner in named if ledger.owner_state(kind, owner, conn) == "alive"}


def _advisory_tag(owner: str) -> tuple[int, int] | None:
    try:
        return sql.advisory_lock_tag(owner)
    except ValueError:  # not an owner token this library wrote
        return None


# --- browsing jobs: keyset pages, one job by id, what finished minute by minute -------------

#: The states a job can be listed by: in the queue (``ready``: due and not running, expired
#: leases included; ``scheduled``: due later; ``waiting``: waiting for its dependencies to
#: end, enqueued with ``depends_on``; ``running``: claimed by a live worker, in a
#: transaction or under a live lease) or in the archive.
JOB_STATES = ("ready", "scheduled", "waiting", "running", "succeeded", "failed", "cancelled")
#: How many jobs ``list_jobs`` returns unless told otherwise, and the most at once.
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
#: The most minutes ``finished_per_minute`` counts back.
MAX_MINUTES = 24 * 60

#: The archive's status of each archived state, and back.
_ARCHIVED_STATES = {"succeeded": "success", "failed": "failure", "cancelled": "cancelled"}
_STATE_OF_STATUS = {status: state for state, status in _ARCHIVED_STATES.items()}


@dataclass(frozen=True)
class JobInfo:
    """A job as a list shows it, without its payload. ``state`` is one of ``JOB_STATES``;
    ``process_at`` is its own due time (also while leased); ``finished_at`` and ``error``
    are set once it is archived.

    A job that has a lease (lease mode) shows its ``owner`` (the worker, as
    ``worker_id@host:pid/thread``), ``lease_expires_at``, ``heartbeat_at`` (its last
    renewal) and ``cancel_requested_at`` (``cancel_job`` asked its worker to stop it); all
    None for other jobs. While its lease is live it is ``running``; once the lease expired
    (its worker died or froze) it is ``ready`` with ``lease_expired`` True, until a worker
    claims it again.

    ``concurrency_key`` is the key its queue's per-key limits count it by (None: none), and
    ``snoozes`` how often its handler raised ``Snooze`` (runs that took no attempt).

    Its graph: ``depends_on``, the ids of the jobs it was enqueued to depend on, and
    ``dependents``, the ids of the jobs depending on it (both empty for most jobs; a waiting
    job's ``process_at`` is its own due time). ``progress`` and ``progress_message``: what
    its handler last reported with ``job.set_progress`` (None before any report).
    """

    job_id: uuid.UUID
    queue: str
    job_type: str
    state: str
    attempts: int
    enqueued_at: datetime
    process_at: datetime
    finished_at: datetime | None
    error: str | None
    owner: str | None = field(default=None, kw_only=True)
    lease_expires_at: datetime | None = field(default=None, kw_only=True)
    heartbeat_at: datetime | None = field(default=None, kw_only=True)
    cancel_requested_at: datetime | None = field(default=None, kw_only=True)
    lease_expired: bool = field(default=False, kw_only=True)
    concurrency_key: str | None = field(default=None, kw_only=True)
    snoozes: int = field(default=0, kw_only=True)
    depends_on: list[uuid.UUID] = field(default_factory=list, kw_only=True)
    dependents: list[uuid.UUID] = field(default_factory=list, kw_only=True)
    progress: float | None = field(default=None, kw_only=True)
    progress_message: str | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class EarlierOutcome:
    """An earlier end of a job that ``retry_failed`` put back in the queue: its archive row's
    ``state`` (``failed``), ``attempts``, ``finished_at`` and ``error`` as they were."""

    state: str
    attempts: int
    finished_at: datetime
    error: str | None


@dataclass(frozen=True)
class JobDetail(JobInfo):
    """One job with its payload (the stored text) and its ``history``: its earlier ends,
    oldest first, each put back in the queue by ``retry_failed`` (empty for most jobs)."""

    payload: str
    history: tuple[EarlierOutcome, ...] = field(default=(), kw_only=True)


@dataclass(frozen=True)
class JobPage:
    """A page of ``list_jobs``: its jobs, and the ``after`` of the next page (None on the
    last one)."""

    jobs: tuple[JobInfo, ...]
    next_cursor: str | None


@dataclass(frozen=True)
class FinishedMinute:
    """The jobs of one queue archived in one minute (``minute`` is its start, UTC)."""

    queue: str
    minute: datetime
    succeeded: int
    failed: int


def list_jobs(
    bind: Engine | Connection,
    state: str,
    *,
    queue: str | None = None,
    job_type: str | None = None,
    after: str | None = None,
    limit: int = DEFAULT_PAGE_SIZE,
    clock: Clock = utc_now,
) -> JobPage:
    """A page of the jobs in one state, optionally of one queue and one job type.

    Queued jobs come in the order workers claim them, queue by queue; archived ones newest
    first. ``after`` is the ``next_cursor`` of the page before. Every page is one range of
    an index per queue it spans (the poll index, or the archive's ``finished_at`` index),
    never an OFFSET, so page 1,000 costs what page 1 does. Running and ready are told
    apart as ``queue_status`` does, without taking a lock; the running list adds the jobs
    under a live lease, found by reading the job table (they are few, the table may not
    be), and lists them by their own due time.
    """
    if state not in JOB_STATES:
        raise ConfigurationError(f"state={state!r}: give one of {', '.join(JOB_STATES)}")
    _check_filters(queue, job_type, limit, "jobs", MAX_PAGE_SIZE, DEFAULT_PAGE_SIZE)
    archived = state in _ARCHIVED_STATES
    key = _read_cursor(after, archived)
    with _reading(bind, "list_jobs") as conn:
        if archived:
            statement = sql.archived_jobs(
                _ARCHIVED_STATES[state], limit + 1, queue=queue, job_type=job_type, after=key
            )
            rows = conn.execute(*statement).all()
            jobs = _with_graphs(conn, [_archived_info(row) for row in rows[:limit]])
            more = len(rows) > limit
            last = (jobs[-1].finished_at, jobs[-1].job_id) if more else None
            return JobPage(tuple(jobs), _write_cursor(last) if last else None)
        now = clock()
        live = sorted(_live_owners(dialect_of(conn), conn, _run_owners(conn)))
        if state == "running":
            found = _running_rows(conn, now, live, queue, job_type, key, limit + 1)
        else:
            found = _queued_rows(conn, state, now, live, queue, job_type, key, limit)
        rows = found[:limit]
        queued = _with_graphs(conn, [_queued_info(row, state, now) for row in rows])
    more = len(found) > limit
    last_row = rows[-1] if more else None
    order = _running_key if state == "running" else _queued_key
    cursor = _write_cursor(order(last_row)) if last_row is not None else None
    return JobPage(tuple(queued), cursor)


def get_job(
    bind: Engine | Connection, job_id: uuid.UUID | str, *, clock: Clock = utc_now
) -> JobDetail | None:
    """The job of this id, queued or archived, with its payload and its earlier ends (the
    failures ``retry_failed`` put back); None when there is none."""
    try:
        wanted = job_id if isinstance(job_id, uuid.UUID) else uuid.UUID(job_id)
    except (TypeError, ValueError, AttributeError):
        raise ConfigurationError(f"{job_id!r} is not a job id; give a UUID") from None
    with _reading(bind, "get_job") as conn:
        row = conn.execute(*sql.queued_job(wanted)).one_or_none()
        history = tuple(
            EarlierOutcome(_STATE_OF_STATUS.get(end.status, end.status), *end[1:])
            for end in conn.execute(*sql.history_of(wanted))
        )
        if row is None:
            archived = conn.execute(*sql.archived_job(wanted)).one_or_none()
            if archived is None:
                return None
            [info] = _with_graphs(conn, [_archived_info(archived)])
            return JobDetail(**vars(info), payload=archived.payload, history=history)
        now = clock()
        owners = {run.owner for run in conn.execute(*sql.runs_of(wanted))}
        if row.waiting_on > 0:
            state = "waiting"
        elif row.lease_token is not None:
            state = "running" if row.process_at > now else "ready"
        elif _live_owners(dialect_of(conn), conn, owners):
            state = "running"
        else:
            state = "ready" if row.process_at <= now else "scheduled"
        [info] = _with_graphs(conn, [_queued_info(row, state, now)])
    return JobDetail(**vars(info), payload=row.payload, history=history)


def finished_per_minute(
    bind: Engine | Connection, *, minutes: int = 60, clock: Clock = utc_now
) -> list[FinishedMinute]:
    """Per queue and minute, the jobs archived as succeeded and as failed over the last
    ``minutes`` minutes (the current one included), sorted by queue and minute; minutes in
    which a queue archived nothing are left out."""
    if isinstance(minutes, bool) or not isinstance(minutes, int) or not 1 <= minutes <= MAX_MINUTES:
        raise ConfigurationError(
            f"minutes={minutes!r}: give a whole number of minutes from 1 to {MAX_MINUTES}"
        )
    now = clock()
    current = now.replace(second=0, microsecond=0)
    starts = [current - timedelta(minutes=minutes - 1 - index) for index in range(minutes)]
    ends = [*starts[1:], now]
    counts: dict[tuple[str, int], list[int]] = {}
    with _reading(bind, "finished_per_minute") as conn:
        for row in conn.execute(*sql.finished_by_minute(starts[0], ends)):
            tally = counts.setdefault((row.queue, int(row.minute)), [0, 0])
            tally[0 if row.status == "success" else 1] += int(row.jobs)
    return [
        FinishedMinute(queue, starts[index], succeeded, failed)
        for (queue, index), (succeeded, failed) in sorted(counts.items())
    ]


def _run_owners(conn: Connection) -> set[str | None]:
    return {row.owner for row in conn.execute(*sql.claimed_runs())}


def _queued_rows(
    conn: Connection,
    state: str,
    now: datetime,
    live: list[str],
    queue: str | None,
    job_type: str | None,
    key: tuple[Any, ...] | None,
    limit: int,
) -> list[Any]:
    """Up to ``limit`` + 1 queued rows from ``key`` on: one queue, or queue after queue,
    each read through the poll index from where the key (or the queue) starts."""
    rows: list[Any] = []
    due = state == "ready"
    current = queue if queue is not None else (key[0] if key else _next_queue(conn, None))
    after = (key[1], key[2], key[3]) if key and key[0] == current else None
    while current is not None and len(rows) <= limit:
        # From a cursor: the rest of its priority, then the priorities after it; each read
        # is one range of the poll index.
        for where in ({"after": after}, {"beyond": after[0]}) if after else ({},):
            if len(rows) > limit:
                break
            statement = sql.queued_jobs(
                current,
                now,
                limit + 1 - len(rows),
                due=due,
                job_type=job_type,
                live_owners=live if due else None,
                waiting=state == "waiting",
                **where,
            )
            rows.extend(conn.execute(*statement).all())
        if queue is not None:
            break
        current, after = _next_queue(conn, current), None
    return rows


def _next_queue(conn: Connection, after: str | None) -> str | None:
    found: str | None = conn.execute(*sql.next_queue(after)).scalar()
    return found


def _running_rows(
    conn: Connection,
    now: datetime,
    live: list[str],
    queue: str | None,
    job_type: str | None,
    key: tuple[Any, ...] | None,
    limit: int,
) -> list[Any]:
    """The running jobs (few: one per claimed job of a live worker, one per live lease)
    from ``key`` on."""
    rows = {
        row.job_id: row
        for row in conn.execute(*sql.leased_jobs(now, queue=queue, job_type=job_type))
    }
    held = [row.job_id for row in conn.execute(*sql.held_jobs(live))] if live else []
    if held:
        for row in conn.execute(*sql.jobs_by_id(held, queue=queue, job_type=job_type)):
            rows.setdefault(row.job_id, row)
    ordered = sorted(rows.values(), key=_running_key)
    if key is not None:
        ordered = [row for row in ordered if _running_key(row) > key]
    return ordered[:limit]


def _queued_key(row: Any) -> tuple[str, int, datetime, int]:
    """Where a queued job stands in its list: queue by queue, in the order workers claim."""
    return (row.queue, int(row.run_order), row.process_at, int(row.seq))


def _running_key(row: Any) -> tuple[str, int, datetime, int]:
    """Where a running job stands in its list: as a queued one, by its own due time (a
    lease's expiry moves at every heartbeat)."""
    return (row.queue, int(row.run_order), _due_time(row), int(row.seq))


def _due_time(row: Any) -> datetime:
    """A queued job's own due time: while leased, ``process_at`` is the lease's expiry, and
    while it waits for its dependencies, ``WAITING_AT``."""
    waiting = row._mapping.get("waiting_on", 0) > 0
    if (waiting or row.lease_token is not None) and row.due_at is not None:
        due: datetime = row.due_at
        return due
    at: datetime = row.process_at
    return at


def _with_graphs(conn: Connection, jobs: list[JobInfo]) -> list[JobInfo]:
    """``jobs`` with their dependencies, dependents and progress (three reads by key for
    the whole list)."""
    ids = [job.job_id for job in jobs]
    if not ids:
        return jobs
    depends_on: dict[uuid.UUID, list[uuid.UUID]] = {}
    for row in conn.execute(*graph.dependencies_of(ids)):
        depends_on.setdefault(row.job_id, []).append(row.depends_on)
    dependents: dict[uuid.UUID, list[uuid.UUID]] = {}
    for row in conn.execute(*graph.dependents_of(ids)):
        dependents.setdefault(row.depends_on, []).append(row.job_id)
    progress = {row.job_id: row for row in conn.execute(*graph.progress_of_many(ids))}
    return [
        replace(
            job,
            depends_on=depends_on.get(job.job_id, []),
            dependents=dependents.get(job.job_id, []),
            progress=progress[job.job_id].progress if job.job_id in progress else None,
            progress_message=progress[job.job_id].message if job.job_id in progress else None,
        )
        for job in jobs
    ]


def _queued_info(row: Any, state: str, now: datetime) -> JobInfo:
    leased = row.lease_token is not None
    return JobInfo(
        job_id=row.job_id,
        queue=row.queue,
        job_type=row.job_type,
        state=state,
        attempts=row.attempts,
        enqueued_at=row.enqueued_at,
        process_at=_due_time(row),
        finished_at=None,
        error=None,
        owner=row.lease_owner if leased else None,
        lease_expires_at=row.process_at if leased else None,
        heartbeat_at=row.heartbeat_at if leased else None,
        cancel_requested_at=row.cancel_requested_at if leased else None,
        lease_expired=leased and row.process_at <= now,
        concurrency_key=row.concurrency_key,
        snoozes=row.snoozes,
    )


def _archived_info(row: Any) -> JobInfo:
    return JobInfo(
        job_id=row.job_id,
        queue=row.queue,
        job_type=row.job_type,
        state=_STATE_OF_STATUS.get(row.status, row.status),
        attempts=row.attempts,
        enqueued_at=row.enqueued_at,
        process_at=row.process_at,
        finished_at=row.finished_at,
        error=row.error,
        concurrency_key=row.concurrency_key,
        snoozes=row.snoozes,
    )


def _write_cursor(key: tuple[Any, ...]) -> str:
    """A page's key as an opaque, URL-safe string."""
    parts = [part.isoformat() if isinstance(part, datetime) else str(part) for part in key]
    text = json.dumps(parts, separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _read_cursor(cursor: str | None, archived: bool) -> tuple[Any, ...] | None:
    """The key of a ``next_cursor``: (finished_at, job_id) of the archive's lists, else
    (queue, run_order, process_at, seq), the running list's time being the job's own due
    time."""
    if cursor is None:
        return None
    try:
        if not isinstance(cursor, str):
            raise TypeError
        parts = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if archived:
            at, job_id = parts
            return (_aware(datetime.fromisoformat(at)), uuid.UUID(job_id))
        queue, order, at, seq = parts
        return (
            check_name("queue", queue),
            int(order),
            _aware(datetime.fromisoformat(at)),
            int(seq),
        )
    except (TypeError, ValueError, binascii.Error, ProletarianError):
        raise ConfigurationError(
            f"after={cursor!r} is not a cursor of this list: pass the next_cursor of a "
            "page of the same state, or None for the first page"
        ) from None


def _aware(value: datetime) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("naive time in a cursor")
    return value
