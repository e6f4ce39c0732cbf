"""Jobs under a lease, seen from outside (inspection.py, control.cancel_job)."""

from __future__ import annotations

import uuid
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import (
    Select,
    bindparam,
    case,
    func,
    select,
    update,
)

from sqla_proletarian.statements.base import JOB, JOB_COLUMNS, Statement

# While a job is leased its ``process_at`` is the lease's expiry (so no poll reads it before
# the lease expires) and ``due_at`` its own due time: the reads of the queue tell leased
# rows apart before they take ``process_at`` for a due time.
_LEASED = JOB.c.lease_token.is_not(None)
_UNLEASED = JOB.c.lease_token.is_(None)
#: A leased job's own due time.
_LEASED_DUE_AT = func.coalesce(JOB.c.due_at, JOB.c.process_at)
#: A queued job's own due time, leased or not.
DUE_AT = case((_LEASED, _LEASED_DUE_AT), else_=JOB.c.process_at)
_LEASE_NOW = bindparam("now", type_=JOB.c.process_at.type)
_LIVE_LEASE = (_LEASED, JOB.c.process_at > _LEASE_NOW)


@cache
def _leased_jobs(by_queue: bool, by_type: bool) -> Select[Any]:
    conditions: list[Any] = [*_LIVE_LEASE]
    if by_queue:
        conditions.append(JOB.c.queue == bindparam("queue"))
    if by_type:
        conditions.append(JOB.c.job_type == bindparam("job_type"))
    return select(*_LISTED_QUEUED).where(*conditions)


def leased_jobs(
    now: datetime, *, queue: str | None = None, job_type: str | None = None
) -> Statement:
    """The jobs under a lease still live at ``now`` (running in lease mode), optionally of
    one queue and job type; no index names leases, so this reads the job table."""
    params: dict[str, Any] = {"now": now}
    if queue is not None:
        params["queue"] = queue
    if job_type is not None:
        params["job_type"] = job_type
    return _leased_jobs(queue is not None, job_type is not None), params


_REQUEST_CANCEL = (
    update(JOB)
    .where(JOB.c.seq == bindparam("job_seq"), *_LIVE_LEASE)
    .values(cancel_requested_at=func.coalesce(JOB.c.cancel_requested_at, _LEASE_NOW))
)


def request_cancel(seq: int, now: datetime) -> Statement:
    """Ask the worker holding a job's live lease to stop it (by primary key; its heartbeat
    carries the request to the handler); an earlier request's time is kept."""
    return _REQUEST_CANCEL, {"job_seq": seq, "now": now}


_LOCK_TO_CANCEL = (
    select(*JOB_COLUMNS, JOB.c.lease_token, JOB.c.due_at)
    .where(JOB.c.job_id == bindparam("job_id"))
    .with_for_update(skip_locked=True)
)


def lock_to_cancel(job_id: uuid.UUID) -> Statement:
    """Lock a queued job by id to cancel it, with its lease, skipping it if a worker in
    transaction mode is running it."""
    return _LOCK_TO_CANCEL, {"job_id": job_id}


#: The columns a list of queued jobs shows (no payload: a page never loads them all).
_LISTED_QUEUED = (
    JOB.c.seq,
    JOB.c.job_id,
    JOB.c.queue,
    JOB.c.job_type,
    JOB.c.attempts,
    JOB.c.enqueued_at,
    JOB.c.process_at,
    JOB.c.run_order,
    JOB.c.lease_token,
    JOB.c.lease_owner,
    JOB.c.heartbeat_at,
    JOB.c.due_at,
    JOB.c.cancel_requested_at,
    JOB.c.concurrency_key,
    JOB.c.snoozes,
)
