"""Periodic jobs: jobs the workers enqueue on a schedule, a cron expression or an interval.

However many worker processes run, on however many machines, each occurrence is enqueued
once. Each schedule has a row in ``proletarian_periodic`` with the last occurrence enqueued;
a worker that finds a newer occurrence due moves the row on with a compare-and-set UPDATE
and enqueues the job in the same transaction. Whoever moves it enqueues; the others' UPDATE
changes no row. The row only ever moves forward, so a worker whose clock is behind enqueues
nothing twice.

After all workers were down, the latest missed occurrence is enqueued once, not one job per
missed occurrence. A schedule seen for the first time starts with its next occurrence. The
job's ``process_at`` is the occurrence's time, so a handler knows which one it runs for.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import KW_ONLY, dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo

from sqlalchemy import Connection

from sqla_proletarian import statements as sql
from sqla_proletarian import wakeups
from sqla_proletarian.dialects import Dialect
from sqla_proletarian.errors import ConfigurationError, InvalidJobError
from sqla_proletarian.logs import log_event
from sqla_proletarian.serialization import Serializer
from sqla_proletarian.types import MAX_NAME_LENGTH
from sqla_proletarian.unique import PRIMARY_KEY, insert_or_nothing
from sqla_proletarian.values import (
    DEFAULT_PRIORITY,
    DEFAULT_QUEUE,
    Clock,
    build_job_values,
    check_aware,
    check_name,
    check_priority,
)

__all__ = ["EPOCH", "PeriodicJob"]

#: Where ``every`` schedules count from: ``every=timedelta(hours=1)`` runs on the hour (UTC).
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

_CRON_FIELDS = 5


@dataclass(frozen=True)
class PeriodicJob:
    """A job that workers given it (``periodic_jobs=[...]``) enqueue on a schedule.

    Exactly one of ``cron`` (a five-field cron expression, in UTC unless ``timezone``, a
    zoneinfo name such as ``"Europe/Oslo"``, is given; needs the ``cron`` extra, croniter)
    and ``every`` (a timedelta; occurrences at whole multiples of it since 1970-01-01 UTC).
    ``name`` identifies the schedule's record; by default it is made of the queue, the job
    type and the schedule, so a changed schedule starts afresh. Give two schedules of the
    same job type, queue and schedule (different payloads) names of their own.
    """

    job_type: str
    _: KW_ONLY
    cron: str | None = None
    every: timedelta | None = None
    payload: Any = None
    queue: str = DEFAULT_QUEUE
    name: str | None = None
    timezone: str | None = None
    priority: int = DEFAULT_PRIORITY

    def __post_init__(self) -> None:
        try:
            check_name("job_type", self.job_type)
            check_name("queue", self.queue)
            check_priority(self.priority)
        except InvalidJobError as exc:
            raise ConfigurationError(f"periodic job {self.job_type!r}: {exc}") from None
        if (self.cron is None) == (self.every is None):
            raise ConfigurationError(
                f"periodic job {self.job_type!r}: give exactly one of cron='...' (a five-field "
                "cron expression) and every=timedelta(...)"
            )
        if self.every is not None:
            self._check_every(self.every)
        else:
            self._check_cron(self.cron)
        if self.name is None:
            object.__setattr__(self, "name", f"{self.queue}:{self.job_type}:{self._schedule()}")
        try:
            check_name("name", self.name)
        except InvalidJobError as exc:
            raise ConfigurationError(
                f"periodic job {self.job_type!r}: {exc}; give a name of at most "
                f"{MAX_NAME_LENGTH} characters"
            ) from None

    def _check_every(self, every: object) -> None:
        if not isinstance(every, timedelta) or every <= timedelta(0):
            raise ConfigurationError(
                f"periodic job {self.job_type!r}: every={every!r}; give a positive "
                "datetime.timedelta, e.g. every=timedelta(minutes=5)"
            )
        if self.timezone is not None:
            raise ConfigurationError(
                f"periodic job {self.job_type!r}: timezone applies to cron schedules only; "
                "every counts from 1970-01-01 UTC"
            )

    def _check_cron(self, cron: object) -> None:
        croniter = _croniter()
        if not isinstance(cron, str) or len(cron.split()) != _CRON_FIELDS:
            raise ConfigurationError(
                f"periodic job {self.job_type!r}: cron={cron!r} is not a five-field cron "
                "expression (minute hour day-of-month month day-of-week), e.g. '0 3 * * *'"
            )
        if not croniter.is_valid(cron):
            raise ConfigurationError(
                f"periodic job {self.job_type!r}: cron={cron!r} is not a valid cron "
                "expression (minute 0-59, hour 0-23, day 1-31, month 1-12, weekday 0-6)"
            )
        self._zone()

    def _schedule(self) -> str:
        if self.every is not None:
            return f"every {self.every.total_seconds():g}s"
        assert self.cron is not None
        zone = f" {self.timezone}" if self.timezone is not None else ""
        return f"cron {' '.join(self.cron.split())}{zone}"

    def _zone(self) -> tzinfo:
        if self.timezone is None:
            return UTC
        try:
            return ZoneInfo(self.timezone)
        except (ValueError, KeyError) as exc:
            raise ConfigurationError(
                f"periodic job {self.job_type!r}: timezone={self.timezone!r} is not a zoneinfo "
                f"name such as 'Europe/Oslo' or 'America/New_York' ({exc!r})"
            ) from None

    def latest(self, now: datetime) -> datetime:
        """The schedule's latest occurrence at or before ``now``, in UTC."""
        if self.every is not None:
            return EPOCH + ((now - EPOCH) // self.every) * self.every
        croniter = _croniter()
        local = now.astimezone(self._zone())
        before: datetime = croniter(self.cron, local).get_prev(datetime)
        after: datetime = croniter(self.cron, before).get_next(datetime)
        return (after if after <= local else before).astimezone(UTC)

    def following(self, occurrence: datetime) -> datetime:
        """The schedule's first occurrence after ``occurrence``, in UTC."""
        if self.every is not None:
            return self.latest(occurrence) + self.every
        croniter = _croniter()
        local = occurrence.astimezone(self._zone())
        after: datetime = croniter(self.cron, local).get_next(datetime)
        return after.astimezone(UTC)


def _croniter() -> Any:
    try:
        from croniter import croniter  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigurationError(
            "cron schedules need croniter: pip install 'sqla-proletarian[cron]' "
            "(or give every=timedelta(...) instead)"
        ) from None
    return croniter


def check_periodic_jobs(jobs: object) -> tuple[PeriodicJob, ...]:
    """The worker option ``periodic_jobs``, checked: PeriodicJobs with distinct names."""
    if isinstance(jobs, PeriodicJob) or not isinstance(jobs, list | tuple):
        raise ConfigurationError(f"periodic_jobs is {jobs!r}; give a list of sp.PeriodicJob(...)")
    names: set[str] = set()
    for job in jobs:
        if not isinstance(job, PeriodicJob):
            raise ConfigurationError(
                f"periodic_jobs holds {job!r}; give sp.PeriodicJob(job_type, cron=... or every=...)"
            )
        assert job.name is not None
        if job.name in names:
            raise ConfigurationError(
                f"two periodic jobs are named {job.name!r}; give each a name of its own "
                "(PeriodicJob(..., name='...'))"
            )
        names.add(job.name)
    return tuple(jobs)


class Scheduler:
    """Enqueues the occurrences of a worker's periodic jobs; the worker's threads call
    ``tick`` from their poll loop, and one of them at a time looks, at most once per
    polling interval. It touches the database only when an occurrence is due (or when it
    has not read a schedule's record yet)."""

    def __init__(
        self,
        dialect: Dialect,
        jobs: tuple[PeriodicJob, ...],
        *,
        serializer: Serializer,
        clock: Clock,
        interval: float,
    ) -> None:
        self.dialect = dialect
        self.jobs = jobs
        self._serializer = serializer
        self._clock = clock
        self._interval = interval
        for job in jobs:
            try:
                serializer.dumps(job.payload)
            except InvalidJobError as exc:
                raise ConfigurationError(f"periodic job {job.name!r}: {exc}") from None
        #: Each schedule's next occurrence after the last one known enqueued; None: unread.
        self._next: dict[str, datetime | None] = {str(job.name): None for job in jobs}
        self._lock = threading.Lock()
        self._next_look = 0.0

    def tick(self, conn: Connection) -> None:
        """Enqueue the occurrences that are due, unless another thread is looking or looked
        less than a polling interval ago. ``conn`` is the thread's claim connection."""
        if time.monotonic() < self._next_look or not self._lock.acquire(blocking=False):
            return
        try:
            self._next_look = time.monotonic() + self._interval
            now = check_aware("clock()", self._clock())
            due = []
            for job in self.jobs:
                following = self._next[str(job.name)]
                if following is None or following <= now:
                    due.append((job, job.latest(now)))
            if due:
                self._enqueue(conn, now, due)
        finally:
            self._lock.release()

    def next_look(self) -> float | None:
        """Seconds until ``tick`` has an occurrence to enqueue (0: now, or a schedule's record
        is still unread); None without schedules. An idle worker sleeps no longer."""
        known = list(self._next.values())
        if not known:
            return None
        if None in known:
            return 0.0
        now = check_aware("clock()", self._clock())
        following = min(when for when in known if when is not None)
        wait = max(0.0, (following - now).total_seconds())
        return max(wait, self._next_look - time.monotonic())

    def _enqueue(
        self, conn: Connection, now: datetime, due: list[tuple[PeriodicJob, datetime]]
    ) -> None:
        """One transaction: read the schedules' records, move on those that are behind, and
        enqueue one job for each moved on."""
        dialect = self.dialect
        known: dict[str, datetime] = {}
        enqueued: list[tuple[PeriodicJob, datetime, Any]] = []
        dialect.begin_claim(conn)
        try:
            names = [str(job.name) for job, _ in due]
            records: dict[str, datetime] = {
                name: last for name, last in conn.execute(*sql.schedules(names))
            }
            for job, occurrence in due:
                name = str(job.name)
                last = records.get(name)
                known[name] = occurrence if last is None else max(last, occurrence)
                if last is None:
                    # Seen for the first time: the schedule starts with its next occurrence.
                    start = sql.start_schedule(name, occurrence, dialect.insert_or_nothing)
                    insert_or_nothing(conn, dialect, start, PRIMARY_KEY)
                elif (
                    last < occurrence
                    and conn.execute(*sql.advance_schedule(name, occurrence)).rowcount == 1
                ):
                    values = self._job_values(job, now, occurrence)
                    conn.execute(*sql.insert_job(values))
                    enqueued.append((job, occurrence, values["job_id"]))
            if enqueued:
                wakeups.enqueued(conn, {job.queue for job, _, _ in enqueued})
            conn.commit()
        except BaseException:
            if conn.in_transaction() and not conn.invalidated:
                conn.rollback()
            raise
        for job, _ in due:
            name = str(job.name)
            self._next[name] = job.following(known[name])
        for job, occurrence, job_id in enqueued:
            log_event(
                logging.INFO,
                "periodic-job-enqueued",
                schedule=job.name,
                job_id=job_id,
                job_type=job.job_type,
                queue=job.queue,
                occurrence=occurrence.isoformat(),
            )

    def _job_values(self, job: PeriodicJob, now: datetime, occurrence: datetime) -> dict[str, Any]:
        values = build_job_values(
            job.job_type,
            job.payload,
            queue=job.queue,
            priority=job.priority,
            serializer=self._serializer,
            clock=lambda: now,
        )
        values["process_at"] = occurrence
        return values
