"""The dashboard's reads (inspection.list_jobs, get_job, finished_per_minute)."""

from __future__ import annotations

import uuid
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    Select,
    String,
    bindparam,
    case,
    exists,
    func,
    literal,
    select,
)

from sqla_proletarian.statements.base import _IDS, ARCHIVE, JOB, RUN, Statement
from sqla_proletarian.statements.housekeeping import _BY_FINISHED_AT
from sqla_proletarian.statements.inspection import _DUE
from sqla_proletarian.statements.leased import _LISTED_QUEUED, _UNLEASED
from sqla_proletarian.statements.progress import WAITING

#: A list's columns of a queued job: what ``_LISTED_QUEUED`` has, and whether (how many
#: dependencies) it waits for.
_LISTED = (*_LISTED_QUEUED, JOB.c.waiting_on)

_AFTER_AT = bindparam("after_at", type_=JOB.c.process_at.type)


@cache
def _queued_jobs(
    due: bool, after: str | None, by_type: bool, free: bool, waiting: bool
) -> Select[Any]:
    # Due later and leased is running under a live lease, not scheduled; a job waiting
    # for its dependencies is due at WAITING_AT, not scheduled either.
    conditions: list[Any] = [JOB.c.queue == bindparam("queue")]
    if waiting:
        conditions.append(WAITING)
    else:
        conditions.append(_DUE if due else ~_DUE)
    if not due and not waiting:
        conditions.extend((_UNLEASED, ~WAITING))
    order = bindparam("after_order", type_=JOB.c.run_order.type)
    if after == "within":
        # One priority from the cursor on: an equality on it, then a range of the index's
        # next column (the rest of the key filters the few rows of the cursor's time).
        conditions.append(JOB.c.run_order == order)
        conditions.append(JOB.c.process_at >= _AFTER_AT)
        conditions.append((JOB.c.process_at > _AFTER_AT) | (JOB.c.seq > bindparam("after_seq")))
    elif after == "beyond":
        conditions.append(JOB.c.run_order > order)
    if by_type:
        conditions.append(JOB.c.job_type == bindparam("job_type"))
    if free:
        conditions.append(
            ~exists()
            .where(
                RUN.c.job_id == JOB.c.job_id,
                RUN.c.owner.in_(bindparam("live", expanding=True)),
            )
            .correlate(JOB)
        )
    return (
        select(*_LISTED)
        .where(*conditions)
        .order_by(JOB.c.run_order, JOB.c.process_at, JOB.c.seq)
        .limit(bindparam("limit", type_=BigInteger))
    )


def queued_jobs(
    queue: str,
    now: datetime,
    limit: int,
    *,
    due: bool,
    after: tuple[int, datetime, int] | None = None,
    beyond: int | None = None,
    job_type: str | None = None,
    live_owners: list[str] | None = None,
    waiting: bool = False,
) -> Statement:
    """One queue's jobs due at ``now`` (``due``, expired leases included), later (live
    leases and waiting jobs left out) or ``waiting`` for their dependencies, in poll order,
    through the poll index: all of them, those of the
    cursor's priority after the key ``after`` (``run_order``, ``process_at``, ``seq``), or
    those of the priorities after ``beyond`` (a ``run_order``); ``live_owners`` leaves out
    the jobs whose run records they own."""
    params: dict[str, Any] = {"queue": queue, "now": now, "limit": limit}
    mode = None
    if after is not None:
        params["after_order"], params["after_at"], params["after_seq"] = after
        mode = "within"
    elif beyond is not None:
        params["after_order"] = beyond
        mode = "beyond"
    if job_type is not None:
        params["job_type"] = job_type
    if live_owners:
        params["live"] = live_owners
    return _queued_jobs(due, mode, job_type is not None, bool(live_owners), waiting), params


_FIRST_QUEUE = select(JOB.c.queue).order_by(JOB.c.queue).limit(1)
_NEXT_QUEUE = (
    select(JOB.c.queue).where(JOB.c.queue > bindparam("queue")).order_by(JOB.c.queue).limit(1)
)


def next_queue(after: str | None) -> Statement:
    """The first queue name that has jobs, after ``after`` (a probe of the poll index)."""
    if after is None:
        return _FIRST_QUEUE, {}
    return _NEXT_QUEUE, {"queue": after}


_HELD_JOBS = (
    select(RUN.c.job_id).where(RUN.c.owner.in_(bindparam("live", expanding=True))).distinct()
)


def held_jobs(live_owners: list[str]) -> Statement:
    """The ids of the jobs whose run records live workers own: the running jobs."""
    return _HELD_JOBS, {"live": live_owners}


@cache
def _jobs_by_id(by_queue: bool, by_type: bool) -> Select[Any]:
    conditions: list[Any] = [JOB.c.job_id.in_(_IDS)]
    if by_queue:
        conditions.append(JOB.c.queue == bindparam("queue"))
    if by_type:
        conditions.append(JOB.c.job_type == bindparam("job_type"))
    return select(*_LISTED).where(*conditions)


def jobs_by_id(
    job_ids: list[uuid.UUID], *, queue: str | None = None, job_type: str | None = None
) -> Statement:
    """Queued jobs by id (their unique index), optionally of one queue and job type."""
    params: dict[str, Any] = {"ids": job_ids}
    if queue is not None:
        params["queue"] = queue
    if job_type is not None:
        params["job_type"] = job_type
    return _jobs_by_id(queue is not None, job_type is not None), params


_ARCHIVE_AFTER_AT = bindparam("after_at", type_=ARCHIVE.c.finished_at.type)


@cache
def _archived_jobs(by_queue: bool, by_type: bool, after: bool) -> Select[Any]:
    conditions: list[Any] = [ARCHIVE.c.status == bindparam("status", type_=String(16))]
    if by_queue:
        conditions.append(ARCHIVE.c.queue == bindparam("queue"))
    if by_type:
        conditions.append(ARCHIVE.c.job_type == bindparam("job_type"))
    if after:
        conditions.append(ARCHIVE.c.finished_at <= _ARCHIVE_AFTER_AT)
        conditions.append(
            (ARCHIVE.c.finished_at < _ARCHIVE_AFTER_AT)
            | (ARCHIVE.c.job_id < bindparam("after_id", type_=ARCHIVE.c.job_id.type))
        )
    return (
        select(*(c for c in ARCHIVE.c if c.name != "payload"))
        .with_hint(ARCHIVE, _BY_FINISHED_AT, "mysql")
        .with_hint(ARCHIVE, _BY_FINISHED_AT, "mariadb")
        .where(*conditions)
        .order_by(ARCHIVE.c.finished_at.desc(), ARCHIVE.c.job_id.desc())
        .limit(bindparam("limit", type_=BigInteger))
    )


def archived_jobs(
    status: str,
    limit: int,
    *,
    queue: str | None = None,
    job_type: str | None = None,
    after: tuple[datetime, uuid.UUID] | None = None,
) -> Statement:
    """Archived jobs of one status, newest first from the key ``after`` (``finished_at``,
    ``job_id``) on, read backwards through the ``finished_at`` index; no payloads."""
    params: dict[str, Any] = {"status": status, "limit": limit}
    if queue is not None:
        params["queue"] = queue
    if job_type is not None:
        params["job_type"] = job_type
    if after is not None:
        params["after_at"], params["after_id"] = after
    return _archived_jobs(queue is not None, job_type is not None, after is not None), params


_QUEUED_JOB = select(*_LISTED, JOB.c.payload).where(JOB.c.job_id == bindparam("job_id"))
_ARCHIVED_JOB = select(ARCHIVE).where(ARCHIVE.c.job_id == bindparam("job_id"))


def queued_job(job_id: uuid.UUID) -> Statement:
    """One queued job by id, with its payload."""
    return _QUEUED_JOB, {"job_id": job_id}


def archived_job(job_id: uuid.UUID) -> Statement:
    """One archived job by id, with its payload and error."""
    return _ARCHIVED_JOB, {"job_id": job_id}


@cache
def _finished_by_minute(minutes: int) -> Select[Any]:
    bounds = [
        (ARCHIVE.c.finished_at < bindparam(f"end_{index}", type_=ARCHIVE.c.finished_at.type), index)
        for index in range(minutes - 1)
    ]
    minute = case(*bounds, else_=minutes - 1) if bounds else literal(0, Integer())
    finished = (
        select(ARCHIVE.c.queue, ARCHIVE.c.status, minute.label("minute"))
        .where(
            ARCHIVE.c.finished_at >= bindparam("since", type_=ARCHIVE.c.finished_at.type),
            ARCHIVE.c.status.in_([literal("success", String(16)), literal("failure", String(16))]),
        )
        .subquery("finished")
    )
    return select(
        finished.c.queue, finished.c.status, finished.c.minute, func.count().label("jobs")
    ).group_by(finished.c.queue, finished.c.status, finished.c.minute)


def finished_by_minute(since: datetime, ends: list[datetime]) -> Statement:
    """Archived successes and failures per queue and minute from ``since`` on (a range of
    the ``finished_at`` index); minute ``i`` ends at ``ends[i]``, the last one is open."""
    params: dict[str, Any] = {"since": since}
    params.update({f"end_{index}": end for index, end in enumerate(ends[:-1])})
    return _finished_by_minute(len(ends)), params
