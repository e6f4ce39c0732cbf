"""Enqueueing: one job, a job with a unique key, and many jobs in one statement."""

from __future__ import annotations

from functools import cache
from typing import Any, cast

from sqlalchemy import (
    Executable,
    Table,
    bindparam,
    func,
    insert,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite

from sqla_proletarian.dialects import InsertOrNothing
from sqla_proletarian.statements.base import ARCHIVE, JOB, JOB_COLUMNS, Statement

_INSERT_JOB = insert(JOB).inline()

#: The columns an enqueue writes, in order: those a claim reads (``seq`` is the server's).
#: The columns an enqueue writes: a claimed job's, less its lease's.
_LEASE_STATE = ("lease_token", "due_at", "unclean_ends", "cancel_requested_at")
ENQUEUED_COLUMNS = tuple(column.name for column in JOB_COLUMNS if column.name not in _LEASE_STATE)
#: The enqueued columns the archive keeps: all but the enqueuer's trace context.
_KEPT_COLUMNS = tuple(name for name in ENQUEUED_COLUMNS if name in ARCHIVE.c)


def insert_job(values: dict[str, Any]) -> Statement:
    """Enqueue one job (the caller's transaction commits it)."""
    return _INSERT_JOB, values


@cache
def _insert_or_nothing(table: Table, key: tuple[str, ...], form: InsertOrNothing) -> Executable:
    module = {"postgresql_on_conflict": postgresql, "sqlite_on_conflict": sqlite}.get(form)
    if module is None:
        return insert(table).inline()
    columns = [table.c[name] for name in key]
    return cast(
        Executable, module.insert(table).inline().on_conflict_do_nothing(index_elements=columns)
    )


def insert_job_or_nothing(values: dict[str, Any], form: InsertOrNothing) -> Statement:
    """Enqueue one job with a unique key, unless a job of its queue holds the key: then
    nothing is added (row count 0) or, where the form is a plain INSERT, the duplicate-key
    error says so."""
    return _insert_or_nothing(JOB, ("queue", "unique_key"), form), values


_KEY_HOLDER = select(JOB.c.job_id).where(
    JOB.c.queue == bindparam("queue"), JOB.c.unique_key == bindparam("unique_key")
)


def key_holder(queue: str, unique_key: str) -> Statement:
    """The id of the queued (or running) job holding a unique key in its queue."""
    return _KEY_HOLDER, {"queue": queue, "unique_key": unique_key}


@cache
def _insert_unnest(table: Table, columns: tuple[str, ...]) -> Executable:
    arrays = [
        func.unnest(bindparam(name, type_=postgresql.ARRAY(table.c[name].type))).label(name)
        for name in columns
    ]
    return insert(table).from_select(list(columns), select(*arrays))


def _as_arrays(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> dict[str, list[Any]]:
    return {name: [row.get(name) for row in rows] for name in columns}


def insert_jobs(rows: list[dict[str, Any]], *, unnest: bool) -> tuple[Executable, Any]:
    """Enqueue many jobs in one statement: ``INSERT ... SELECT unnest(...)`` of one array per
    column (PostgreSQL), or an executemany that the driver sends as multi-row INSERTs."""
    if unnest:
        return _insert_unnest(JOB, ENQUEUED_COLUMNS), _as_arrays(rows, ENQUEUED_COLUMNS)
    return _INSERT_JOB, rows
