"""Enqueueing: one job, a job with a unique key, and many jobs in one statement."""

from __future__ import annotations

import re
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from operator import itemgetter
from typing import Any, Literal, cast

from sqlalchemy import (
    Dialect,
    Executable,
    Table,
    bindparam,
    func,
    insert,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement

from sqla_proletarian.dialects import InsertOrNothing
from sqla_proletarian.statements.base import ARCHIVE, JOB, JOB_COLUMNS, Statement

_INSERT_JOB = insert(JOB).inline()

#: The columns an enqueue writes, in order: those a claim reads (``seq`` is the server's).
#: The columns an enqueue writes: a claimed job's, less its lease's and its runs' counts.
_LEASE_STATE = (
    "lease_token",
    "due_at",
    "unclean_ends",
    "cancel_requested_at",
    "uncharged_runs",
    "snoozes",
    "waiting_on",
)
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


#: How an enqueue hands its rows to a driver: one row's compiled INSERT (``execute``); and
#: enqueue_many's: psycopg 3's binary COPY; one ``INSERT ... SELECT unnest(...)`` of one
#: array per column (psycopg2, which adapts lists in C); or the driver's executemany of the
#: compiled INSERT (PyMySQL and mysqlclient send multi-row INSERTs; sqlite3 steps one
#: prepared statement).
DriverForm = Literal["execute", "copy", "unnest", "executemany"]

#: enqueue_many's form for each driver that has a driver-level one (a dialect's name, its
#: driver's): others run the Core statement of ``insert_jobs``.
_MANY_FORMS: dict[tuple[str, str], DriverForm] = {
    ("postgresql", "psycopg"): "copy",
    ("postgresql", "psycopg2"): "unnest",
    ("mysql", "pymysql"): "executemany",
    ("mysql", "mysqldb"): "executemany",
    ("mariadb", "pymysql"): "executemany",
    ("mariadb", "mysqldb"): "executemany",
    ("sqlite", "pysqlite"): "executemany",
}


@dataclass(frozen=True)
class DriverInsert:
    """An enqueue's INSERT as one driver takes it, made once per dialect: the statement
    (compiled from Core; for COPY, psycopg's composition of the table's identifiers) and the
    columns whose values the dialect's types convert before the driver sees them."""

    form: DriverForm
    statement: Any
    columns: tuple[str, ...]
    #: The statement takes positional parameters (a sequence per row, in ``columns`` order).
    positional: bool
    converters: tuple[tuple[str, Callable[[Any], Any]], ...]
    #: COPY's column types, as psycopg names them.
    copy_types: tuple[str, ...] = ()


_MADE: weakref.WeakKeyDictionary[Dialect, dict[bool, DriverInsert | None]] = (
    weakref.WeakKeyDictionary()
)


def driver_insert(dialect: Dialect, *, many: bool) -> DriverInsert | None:
    """The driver-level INSERT of one job (``many=False``) or of enqueue_many's jobs for
    ``dialect``; None where the driver has none (asyncio drivers, others), and the Core
    statement runs instead."""
    made = _MADE.get(dialect)
    if made is None:
        made = _MADE[dialect] = {}
    if many not in made:
        made[many] = _make_driver_insert(dialect, many)
    return made[many]


def _make_driver_insert(dialect: Dialect, many: bool) -> DriverInsert | None:
    form = _MANY_FORMS.get((dialect.name, dialect.driver))
    if form is None or dialect.is_async:
        return None
    if not many:
        form = "execute"
    columns = ENQUEUED_COLUMNS
    impls = {name: JOB.c[name].type.dialect_impl(dialect) for name in columns}
    processors: dict[str, Callable[[Any], Any] | None] = {
        name: impls[name].bind_processor(dialect) for name in columns
    }
    if dialect.name in ("mysql", "mariadb"):
        for name in columns:
            # A TypeDecorator's python_type is its impl's.
            kind = getattr(JOB.c[name].type, "impl_instance", JOB.c[name].type).python_type
            processors[name] = _as_text(kind, processors[name])
    converters = tuple(
        (name, process) for name, process in processors.items() if process is not None
    )
    if form == "copy":
        from psycopg import sql as psycopg_sql

        statement = psycopg_sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
            psycopg_sql.Identifier(JOB.name),
            psycopg_sql.SQL(", ").join(psycopg_sql.Identifier(name) for name in columns),
        )
        compile_type = dialect.type_compiler_instance.process
        types = tuple(re.sub(r"\(.*\)", "", compile_type(impls[n])).lower() for n in columns)
        return DriverInsert(form, statement, columns, True, converters, types)
    core = _insert_unnest(JOB, columns) if form == "unnest" else _INSERT_JOB
    compiled = cast(
        SQLCompiler, cast(ClauseElement, core).compile(dialect=dialect, column_keys=list(columns))
    )
    order = tuple(compiled.positiontup or ()) if dialect.positional else columns
    return DriverInsert(form, compiled.string, order, dialect.positional, converters)


def _fill(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    """NULL in the columns that ``rows`` leave out (``trace_context`` without OpenTelemetry):
    every row of one enqueue has the same keys."""
    missing = [name for name in columns if name not in rows[0]]
    for row in rows if missing else ():
        for name in missing:
            row[name] = None


def _as_text(
    python_type: type, process: Callable[[Any], Any] | None
) -> Callable[[Any], Any] | None:
    """MySQL drivers' own text for a datetime (microseconds always) or a UUID, which PyMySQL
    escapes as a string several times faster than it formats the value; the server reads
    it back as the same DATETIME(6) or UUID."""
    if python_type is datetime:
        convert = process or (lambda value: value)

        def text_of_time(value: Any) -> Any:
            value = convert(value)
            return value if value is None else value.isoformat(" ", "microseconds")

        return text_of_time
    if python_type is uuid.UUID and process is None:
        return lambda value: value if value is None else str(value)
    return process


def row_parameters(insert: DriverInsert, row: dict[str, Any]) -> Any:
    """The driver's parameters for one row: a sequence or a mapping."""
    _fill([row], insert.columns)
    if insert.converters:
        row = dict(row)
        for name, process in insert.converters:
            row[name] = process(row[name])
    if insert.positional:
        return tuple([row[name] for name in insert.columns])
    return row


def many_parameters(insert: DriverInsert, rows: list[dict[str, Any]]) -> Any:
    """The driver's parameters for ``rows``: a sequence or a mapping per row, or (unnest) one
    list per column. A value shared by every row (a time) is converted once."""
    _fill(rows, insert.columns)
    converters = [(name, _last_value_kept(process)) for name, process in insert.converters]
    if insert.form == "unnest":
        arrays = _as_arrays(rows, insert.columns)
        for name, process in converters:
            arrays[name] = [process(value) for value in arrays[name]]
        return arrays
    if not insert.positional:
        if not converters:
            return rows
        copies = []
        for row in rows:
            copy = dict(row)
            for name, process in converters:
                copy[name] = process(copy[name])
            copies.append(copy)
        return copies
    values = itemgetter(*insert.columns)
    if not converters:
        return [values(row) for row in rows]
    at = [(insert.columns.index(name), process) for name, process in converters]
    sequences = []
    for row in rows:
        sequence = list(values(row))
        for index, process in at:
            sequence[index] = process(sequence[index])
        sequences.append(tuple(sequence))
    return sequences


def _last_value_kept(process: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``process`` that gives its last result again for the same object (a batch's rows share
    their enqueue and due times)."""
    last: list[Any] = [object(), None]

    def kept(value: Any) -> Any:
        if value is not last[0]:
            last[0], last[1] = value, process(value)
        return last[1]

    return kept
