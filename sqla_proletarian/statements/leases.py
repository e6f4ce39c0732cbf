"""Lease mode: claims that commit a lease, renewals, fenced ends."""

from __future__ import annotations

import uuid
from datetime import datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import (
    Executable,
    Select,
    String,
    Text,
    Uuid,
    bindparam,
    case,
    delete,
    func,
    literal,
    null,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.sql.visitors import replacement_traverse

from sqla_proletarian.dialects import ArchiveUpsert
from sqla_proletarian.statements.base import (
    _JOB_BY_ID,
    ARCHIVE,
    JOB,
    JOB_COLUMNS,
    Statement,
    _any,
    _delete_by,
)
from sqla_proletarian.statements.finish import _EXPIRED_LEASE, _NO_LEASE, _SNOOZED, _upserted
from sqla_proletarian.statements.workflows import waiting_for

_TOKEN = bindparam("token", type_=Uuid())
_LEASE_IDS: BindParameter[Any] = bindparam("ids", expanding=True)
_LEASE_TOKENS: BindParameter[Any] = bindparam("tokens", expanding=True, type_=Uuid())
#: The rows of a worker's leases: its job ids, still carrying one of its tokens.
_HELD = (JOB.c.job_id.in_(_LEASE_IDS), JOB.c.lease_token.in_(_LEASE_TOKENS))


def _ids_in(arrays: bool) -> Any:
    """``job_id IN (:ids)``, or with ``arrays`` ``job_id = ANY(:ids)`` (see Dialect.id_arrays)."""
    return JOB.c.job_id == _any("ids") if arrays else JOB.c.job_id.in_(_LEASE_IDS)


def _held(arrays: bool) -> tuple[Any, Any]:
    """``_HELD``, with ``arrays`` its two lists as arrays."""
    if not arrays:
        return _HELD
    return _ids_in(arrays), JOB.c.lease_token == _any("tokens")


#: What a lease writes, in this order (MySQL assigns left to right): the count reads the old
#: token, due_at the old process_at.
_LEASED: tuple[tuple[Any, Any], ...] = (
    (JOB.c.unclean_ends, JOB.c.unclean_ends + _EXPIRED_LEASE),
    (JOB.c.due_at, func.coalesce(JOB.c.due_at, JOB.c.process_at)),
    (JOB.c.attempts, JOB.c.attempts + 1),
    (JOB.c.lease_token, _TOKEN),
    (JOB.c.lease_owner, bindparam("owner")),
    (JOB.c.heartbeat_at, bindparam("now", type_=JOB.c.process_at.type)),
    (JOB.c.process_at, bindparam("expiry", type_=JOB.c.process_at.type)),
)


@cache
def _lease(arrays: bool) -> Executable:
    return update(JOB).where(_ids_in(arrays)).ordered_values(*_LEASED)


def lease(
    job_ids: list[uuid.UUID],
    token: uuid.UUID,
    owner: str,
    now: datetime,
    expiry: datetime,
    *,
    arrays: bool = False,
) -> Statement:
    """Lease the jobs a claim locked, under one fresh token: count the run (and an expired
    lease as an unclean end), keep their own due time, and make ``process_at`` the expiry
    (``arrays``: the ids as one array, see Dialect.id_arrays)."""
    values = {"ids": job_ids, "token": token, "owner": owner, "now": now, "expiry": expiry}
    return _lease(arrays), values


#: The poll's parameters named as the job table's columns, renamed in a leasing poll: an
#: UPDATE compiled with parameters of its columns' names would set those columns too.
_RENAMED = {"queue": "poll_queue", "run_order": "poll_run_order"}


def _renamed(element: Any, **kw: Any) -> Any:
    if isinstance(element, BindParameter) and element.key in _RENAMED:
        return bindparam(_RENAMED[element.key], type_=element.type)
    return None


@cache
def _leasing_poll(poll: Select[Any], with_runs: bool, unclean_limit: bool) -> Executable:
    renamed = cast(Select[Any], replacement_traverse(cast(Any, poll), {}, _renamed))
    # With the key the poll orders by last, so that the rows come back in its order.
    picked = renamed.add_columns(JOB.c.seq.label("poll_seq")).cte("picked")
    # The jobs the claim runs as they are: no cancel request, no run records (the crash
    # ledger's, read one by one), not crashed too often. The others stay locked, unleased.
    plain: list[Any] = [picked.c.cancel_requested_at.is_(None)]
    if with_runs:
        plain.append(picked.c.runs == 0)
    if unclean_limit:
        expired = case((picked.c.lease_token.is_(None), 0), else_=1)
        plain.append(picked.c.unclean_ends + expired < bindparam("unclean_limit"))
    leased = (
        update(JOB)
        .where(JOB.c.job_id == picked.c.job_id, *plain)
        .ordered_values(*_LEASED)
        .returning(JOB.c.job_id)
        .cte("leased")
    )
    was_leased = picked.c.job_id.in_(select(leased.c.job_id)).label("leased")
    columns = [column for column in picked.c if column.key != "poll_seq"]
    return select(*columns, was_leased).order_by(
        picked.c.run_order, picked.c.process_at, picked.c.poll_seq
    )


def leasing_poll(
    poll: Statement,
    token: uuid.UUID,
    owner: str,
    now: datetime,
    expiry: datetime,
    *,
    with_runs: bool,
    unclean_limit: int | None,
) -> Statement:
    """A claim's poll (``claim.poll``, ``poll_first``; ``now`` its own) that leases the jobs
    it locks in the same statement, as ``lease`` does (PostgreSQL's DML CTE), but those the
    claim looks at first: a cancel requested, run records (``with_runs``), or as many
    unclean ends as ``unclean_limit``. Its rows are the poll's (the jobs as they were before
    the lease), each with ``leased``."""
    statement, params = poll
    values = {_RENAMED.get(name, name): value for name, value in params.items()}
    values.update(token=token, owner=owner, now=now, expiry=expiry)
    if unclean_limit is not None:
        values["unclean_limit"] = unclean_limit
    return _leasing_poll(cast(Select[Any], statement), with_runs, unclean_limit is not None), values


_LOCK_LEASES = select(JOB.c.job_id).where(*_HELD).with_for_update(skip_locked=True)
_RENEW = (
    update(JOB)
    .where(*_HELD)
    .values(
        heartbeat_at=bindparam("now", type_=JOB.c.process_at.type),
        process_at=bindparam("expiry", type_=JOB.c.process_at.type),
    )
)
_STILL_HELD = select(JOB.c.job_id, JOB.c.cancel_requested_at).where(*_HELD)


def lock_leases(job_ids: list[uuid.UUID], tokens: list[uuid.UUID]) -> Statement:
    """Lock the worker's leases it can renew now, skipping rows another transaction holds
    (a cancel request being written, a claim of an expired lease): a heartbeat never waits."""
    return _LOCK_LEASES, {"ids": job_ids, "tokens": tokens}


def renew_leases(
    job_ids: list[uuid.UUID], tokens: list[uuid.UUID], now: datetime, expiry: datetime
) -> Statement:
    """Move the expiry of leases the heartbeat locked on (a lease another run took is left)."""
    return _RENEW, {"ids": job_ids, "tokens": tokens, "now": now, "expiry": expiry}


def leases_held(job_ids: list[uuid.UUID], tokens: list[uuid.UUID]) -> Statement:
    """Which of the worker's leases it still holds, and whether a cancel was requested."""
    return _STILL_HELD, {"ids": job_ids, "tokens": tokens}


#: The fence of a run's outcome: the job still carries the run's token.
_OWN_LEASE = (JOB.c.job_id == bindparam("job_id"), JOB.c.lease_token == _TOKEN)
#: An outcome other than a cancel is written only while no cancel was requested: a
#: committed request wins over what the handler did (see ``cancelled_lease``).
_NOT_CANCELLED = JOB.c.cancel_requested_at.is_(None)
_END_LEASE = delete(JOB).where(*_OWN_LEASE, _NOT_CANCELLED)
_CANCEL_LEASE = delete(JOB).where(*_OWN_LEASE)


def _archive_row(done: Any, *, attempts: Any, status: Any, error: Any, result: Any) -> Any:
    """The archive row of each job a DELETE ... RETURNING (the CTE ``done``) removed, in the
    archive insert's column order, finished at ``now``: what differs between ends given."""
    return select(
        done.c.job_id,
        done.c.queue,
        done.c.job_type,
        done.c.payload,
        attempts,
        done.c.enqueued_at,
        func.coalesce(done.c.due_at, done.c.process_at),
        done.c.run_order,
        done.c.unique_key,
        done.c.concurrency_key,
        done.c.snoozes,
        status,
        bindparam("now", type_=ARCHIVE.c.finished_at.type),
        error,
        result,
    )


@cache
def _archive_lease(upsert: ArchiveUpsert, cancelling: bool) -> Executable:
    fence = _OWN_LEASE if cancelling else (*_OWN_LEASE, _NOT_CANCELLED)
    done = delete(JOB).where(*fence).returning(*JOB_COLUMNS).cte("done")
    rows = _archive_row(
        done,
        attempts=bindparam("attempts", type_=ARCHIVE.c.attempts.type),
        status=bindparam("status", type_=ARCHIVE.c.status.type),
        error=bindparam("error", type_=ARCHIVE.c.error.type),
        result=bindparam("result", type_=ARCHIVE.c.result.type),
    )
    statement = _upserted(upsert, rows).add_cte(done).returning(waiting_for(_OWN_LEASE[0].right))
    return statement.execution_options(preserve_rowcount=True)


def archive_lease(
    job_id: uuid.UUID,
    token: uuid.UUID,
    *,
    status: str,
    attempts: int,
    finished_at: datetime,
    error: str | None,
    upsert: ArchiveUpsert,
    result: str | None = None,
) -> Statement:
    """Remove a leased job where it still carries the run's token and archive it, in one
    statement (PostgreSQL's DML CTE); its rowcount is 0 when the run was fenced off, or when
    a cancel was requested and ``status`` is not ``"cancelled"``. Its row tells how many rows
    wait for the job's end (``waiting``)."""
    return _archive_lease(upsert, status == "cancelled"), {
        "job_id": job_id,
        "token": token,
        "attempts": attempts,
        "status": status,
        "now": finished_at,
        "error": error,
        "result": result,
    }


@cache
def _still_leased(arrays: bool) -> Executable:
    return (
        select(JOB.c.job_id, JOB.c.lease_token, JOB.c.cancel_requested_at)
        .where(*_held(arrays))
        .with_for_update()
        .with_hint(JOB, _JOB_BY_ID, "mysql")
        .with_hint(JOB, _JOB_BY_ID, "mariadb")
    )


def end_leases(
    job_ids: list[uuid.UUID],
    tokens: list[uuid.UUID],
    *,
    force_index: bool = False,
    arrays: bool = False,
) -> tuple[Statement, Any]:
    """Succeeded jobs, ended together: the lock of those that still carry one of the
    tokens, read with the token each carries (the fence: keep a job only if it carries its
    own run's; the job-id index named on MySQL; ``arrays``: the lists as arrays) and its
    cancel request, and the delete of a list of ids (give it the ones cancelled)."""
    return (_still_leased(arrays), {"ids": job_ids, "tokens": tokens}), _delete_by(
        JOB, ("job_id",), "ids", force_index
    )


def end_lease(job_id: uuid.UUID, token: uuid.UUID, *, cancelling: bool = False) -> Statement:
    """Remove a leased job that ended, only if it still carries the run's token (the fence:
    a run whose lease another run took removes nothing) and, unless ``cancelling``, no
    cancel was requested."""
    return (_CANCEL_LEASE if cancelling else _END_LEASE), {"job_id": job_id, "token": token}


#: The queue columns a job's archive row is made of.
_ARCHIVED_FROM = (
    JOB.c.job_id,
    JOB.c.queue,
    JOB.c.job_type,
    JOB.c.payload,
    JOB.c.attempts,
    JOB.c.enqueued_at,
    JOB.c.process_at,
    JOB.c.due_at,
    JOB.c.run_order,
    JOB.c.unique_key,
    JOB.c.concurrency_key,
    JOB.c.snoozes,
)


@cache
def _complete_leases(upsert: ArchiveUpsert, with_results: bool) -> Executable:
    # The runs' (job id, token, result) triples, one row each (unnests of equal lengths zip).
    arrays = [("ids", Uuid()), ("tokens", Uuid())] + ([("results", Text())] if with_results else [])
    ended = select(
        *(
            func.unnest(bindparam(name, type_=postgresql.ARRAY(kind))).label(name)
            for name, kind in arrays
        )
    ).cte("ended")
    result = ended.c.results if with_results else null()
    done = (
        delete(JOB)
        # The ids' array names the job-id index to the planner, whatever it thinks of unnest.
        .where(JOB.c.job_id == _any("ids"), JOB.c.job_id == ended.c.ids)
        .where(JOB.c.lease_token == ended.c.tokens)
        .returning(*_ARCHIVED_FROM, JOB.c.cancel_requested_at, result.label("result"))
        .cte("done")
    )
    cancelled = done.c.cancel_requested_at.is_not(None)
    rows = _archive_row(
        done,
        attempts=done.c.attempts,  # the claim counted the run
        status=case(
            (cancelled, literal("cancelled", String(16))), else_=literal("success", String(16))
        ),
        error=null(),
        result=case((cancelled, null()), else_=done.c.result),
    )
    statement = (
        _upserted(upsert, rows)
        .add_cte(done)
        .returning(ARCHIVE.c.job_id, ARCHIVE.c.status, waiting_for(_any("ids")))
    )
    return statement


def complete_leases(
    runs: list[tuple[uuid.UUID, uuid.UUID, str | None]],
    now: datetime,
    *,
    upsert: ArchiveUpsert,
) -> Statement:
    """Succeeded runs' jobs ended together in one statement (PostgreSQL's DML CTE): each
    ``(job id, token, serialized result)`` removed where the job still carries that run's
    token (the fence: a job whose lease another run took is left as it is) and archived, as
    succeeded with its result, or as cancelled where a cancel was requested before. Its rows
    are the jobs archived (``job_id``, ``status``), each with how many rows wait for the
    ends of the group's jobs (``waiting``)."""
    with_results = any(result is not None for _, _, result in runs)
    params: dict[str, Any] = {
        "ids": [job_id for job_id, _, _ in runs],
        "tokens": [token for _, token, _ in runs],
        "now": now,
    }
    if with_results:
        params["results"] = [result for _, _, result in runs]
    return _complete_leases(upsert, with_results), params


_CANCEL_REQUESTED = select(JOB.c.cancel_requested_at).where(*_OWN_LEASE).with_for_update()


def cancel_requested(job_id: uuid.UUID, token: uuid.UUID) -> Statement:
    """Lock a leased job that still carries the run's token and read its cancel request
    (no row: the run was fenced off)."""
    return _CANCEL_REQUESTED, {"job_id": job_id, "token": token}


_RETRY_LEASE = (
    update(JOB)
    .where(JOB.c.job_id == bindparam("id"), JOB.c.lease_token == _TOKEN, _NOT_CANCELLED)
    .ordered_values(*_NO_LEASE[1:], (JOB.c.process_at, bindparam("retry_at")))
)


def retry_lease(job_id: uuid.UUID, token: uuid.UUID, retry_at: datetime) -> Statement:
    """Schedule a leased job's next run (its claim counted this one), fenced by the token,
    unless a cancel was requested."""
    return _RETRY_LEASE, {"id": job_id, "token": token, "retry_at": retry_at}


_SNOOZE_LEASE = (
    update(JOB)
    .where(JOB.c.job_id == bindparam("id"), JOB.c.lease_token == _TOKEN, _NOT_CANCELLED)
    .ordered_values(
        *_NO_LEASE[1:],
        (JOB.c.attempts, JOB.c.attempts - 1),
        _SNOOZED,
        (JOB.c.process_at, bindparam("until")),
    )
)


def snooze_lease(job_id: uuid.UUID, token: uuid.UUID, until: datetime) -> Statement:
    """Give a snoozed job's lease back, due at ``until``, fenced by the token, unless a
    cancel was requested: the claim's count of the run is undone (it takes no attempt) and
    ``snoozes`` counts it."""
    return _SNOOZE_LEASE, {"id": job_id, "token": token, "until": until}


def _release(count: tuple[Any, Any]) -> Executable:
    return (
        update(JOB)
        .where(*_HELD)
        .ordered_values(
            # process_at first: MySQL would read the due_at cleared after it.
            (JOB.c.process_at, func.coalesce(JOB.c.due_at, JOB.c.process_at)),
            count,
            *_NO_LEASE[1:],
        )
    )


#: Unrun: the claim's count undone. Run: counted, as a run that takes no retry.
_RELEASE_UNRUN = _release((JOB.c.attempts, JOB.c.attempts - 1))
_RELEASE_RUN = _release((JOB.c.uncharged_runs, JOB.c.uncharged_runs + 1))


def release_leases(job_ids: list[uuid.UUID], tokens: list[uuid.UUID], *, ran: bool) -> Statement:
    """Give leases back: due again at their own time at once, with no unclean end (a cancel
    request stays). Unrun (a stop came before the handlers started): their claim's count is
    undone. ``ran`` (a lost connection, a stop that gave up on the handlers): ``attempts``
    keeps the runs, and ``uncharged_runs`` counts them, so that they take no retry."""
    return (_RELEASE_RUN if ran else _RELEASE_UNRUN), {"ids": job_ids, "tokens": tokens}


_EXPIRE = (
    update(JOB)
    .where(JOB.c.job_id == bindparam("id"), JOB.c.lease_token == _TOKEN)
    .values(process_at=bindparam("now", type_=JOB.c.process_at.type))
)


def expire_lease(job_id: uuid.UUID, token: uuid.UUID, now: datetime) -> Statement:
    """End a lease now with its token kept, so that the next claim counts an unclean end
    (a run whose session was lost, or that ended its worker)."""
    return _EXPIRE, {"id": job_id, "token": token, "now": now}
