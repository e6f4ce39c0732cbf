"""The worker's hot path: its statements executed straight on the driver's cursor.

SQLAlchemy Core builds every statement (``statements``); this module compiles each once per
dialect and then executes it on the DBAPI cursor of the caller's ``Connection``, with its
parameters and result values processed by the same type processors SQLAlchemy would use,
but without the per-execution bookkeeping that costs tens of microseconds a statement.
Errors go through SQLAlchemy's own handling (wrapped, the connection invalidated on a
disconnect, ``handle_error`` events), so callers see the errors ``Connection.execute`` raises.

The statement goes through ``Connection.execute`` as before when anything would notice the
difference: a listener of ``before_cursor_execute``/``after_cursor_execute`` (query logging,
OpenTelemetry's SQLAlchemy instrumentation) other than the worker's own (which it calls),
``echo``, a ``schema_translate_map``, a driver
other than psycopg (3 or 2) and PyMySQL, or a statement SQLAlchemy must prepare itself
(Python-side column defaults).
"""

from __future__ import annotations

import struct
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

from sqlalchemy import ARRAY, Connection, Executable, Uuid
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement

#: The drivers whose cursors the hot path uses directly (dialect name, driver).
DIRECT_DRIVERS = frozenset(
    {
        ("postgresql", "psycopg"),
        ("postgresql", "psycopg2"),
        ("mysql", "pymysql"),
        ("mariadb", "pymysql"),
    }
)


#: Off, every statement goes through ``Connection.execute`` (for comparing the two paths).
enabled = True


class Rows:
    """What a statement returned: its rows as tuples, their column names, and the rowcount.

    Mirrors the parts of SQLAlchemy's ``CursorResult`` the worker uses."""

    __slots__ = ("keys", "rowcount", "rows")

    def __init__(self, keys: Sequence[str], rows: list[tuple[Any, ...]], rowcount: int) -> None:
        self.keys = keys
        self.rows = rows
        self.rowcount = rowcount

    def mappings(self) -> list[dict[str, Any]]:
        """Each row as a dict of column name to value."""
        keys = self.keys
        return [dict(zip(keys, row, strict=True)) for row in self.rows]

    def first_mapping(self) -> dict[str, Any] | None:
        """The first row as a dict, or None."""
        return dict(zip(self.keys, self.rows[0], strict=True)) if self.rows else None

    def scalars(self) -> list[Any]:
        """The first column of each row."""
        return [row[0] for row in self.rows]

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self.rows)


class _Plan:
    """A statement compiled for one dialect, with what executing it directly needs."""

    __slots__ = (
        "compiled",
        "dialect",
        "expands",
        "keys",
        "positions",
        "processors",
        "processors_but_uuid_arrays",
        "result_types",
        "row_processors",
        "statement",
        "text",
        "uuid_arrays",
    )

    def __init__(
        self, statement: Executable, dialect: Dialect, column_keys: tuple[str, ...] | None
    ) -> None:
        self.statement = statement
        self.dialect = dialect
        compiled = cast(ClauseElement, statement).compile(
            dialect=dialect, column_keys=list(column_keys) if column_keys is not None else None
        )
        assert isinstance(compiled, SQLCompiler)
        self.compiled: SQLCompiler | None = compiled
        if compiled.insert_prefetch or compiled.update_prefetch or compiled.escaped_bind_names:
            # SQLAlchemy computes values for these itself: leave them to it.
            self.compiled = None
        #: Whether the SQL text depends on the parameters (expanding IN lists).
        self.expands = bool(compiled.post_compile_params or compiled.literal_execute_params)
        self.text = compiled.string
        #: The parameters that are arrays of UUIDs (psycopg: sent as ``UuidArray``).
        self.uuid_arrays: tuple[str, ...] = ()
        if dialect.driver == "psycopg":
            # Arrays (of job ids) go in psycopg's binary format: its text format quotes each
            # element after a regular-expression test.
            for name, bind in compiled.binds.items():
                if isinstance(bind.type, ARRAY):
                    self.text = self.text.replace(f"%({name})s", f"%({name})b")
                    if isinstance(bind.type.item_type, Uuid):
                        self.uuid_arrays += (name,)
        self.positions = compiled.positiontup
        self.processors = cast(Mapping[str, Any], compiled._bind_processors)
        #: The processors of the parameters but the arrays of UUIDs, which need none when
        #: sent as ``UuidArray``.
        self.processors_but_uuid_arrays = {
            name: process
            for name, process in self.processors.items()
            if name not in self.uuid_arrays
        }
        columns = compiled._result_columns
        self.keys = tuple(column.keyname for column in columns)
        self.result_types = tuple(column.type for column in columns)
        #: The result processors by the cursor's column type codes (stable per driver).
        self.row_processors: dict[tuple[Any, ...], list[tuple[int, Any]] | None] = {}


_PLANS: dict[tuple[int, int, tuple[str, ...] | None], _Plan] = {}
_PLANS_LOCK = threading.Lock()


def _plan(statement: Executable, dialect: Dialect, params: dict[str, Any]) -> _Plan:
    # An INSERT or UPDATE names the columns it is given, as SQLAlchemy compiles it.
    column_keys = tuple(params) if getattr(statement, "is_dml", False) else None
    key = (id(statement), id(dialect), column_keys)
    plan = _PLANS.get(key)
    if plan is None or plan.statement is not statement or plan.dialect is not dialect:
        plan = _Plan(statement, dialect, column_keys)
        with _PLANS_LOCK:
            _PLANS[key] = plan
    return plan


def goes_direct(conn: Connection) -> bool:
    """Whether ``conn``'s statements can skip ``Connection.execute`` (see the module's
    docstring for when they cannot)."""
    dialect = conn.dialect
    if not enabled or (dialect.name, dialect.driver) not in DIRECT_DRIVERS:
        return False
    dispatch = conn.dispatch
    if dispatch.after_cursor_execute:
        return False
    if any(
        not getattr(listener, "worker_own", False) for listener in dispatch.before_cursor_execute
    ):
        return False
    if conn._echo:
        return False
    return not conn.get_execution_options().get("schema_translate_map")


def execute(conn: Connection, statement: Executable, params: Any) -> Rows:
    """Execute one of the worker's statements on ``conn`` with its parameters (a dict; a list
    of them is an executemany, left to SQLAlchemy); its rows and rowcount."""
    if not isinstance(params, dict) or not goes_direct(conn):
        return _through_sqlalchemy(conn, statement, params)
    plan = _plan(statement, conn.dialect, params)
    compiled = plan.compiled
    if compiled is None:
        return _through_sqlalchemy(conn, statement, params)
    processors: Mapping[str, Any]
    if plan.expands:
        state = compiled.construct_expanded_state(params)
        # SQLAlchemy 2.0 gives the expanded parameters' processors only: the others are the
        # plan's.
        text, values, processors, positions = (
            state.statement,
            state.parameters,
            {**plan.processors, **state.processors},
            state.positiontup,
        )
    else:
        text, processors, positions = plan.text, plan.processors_but_uuid_arrays, plan.positions
        values = compiled.construct_params(params)
    processed: Any
    if positions is not None:
        processed = tuple(
            processors[name](values[name]) if name in processors else values[name]
            for name in positions
        )
    else:
        processed = {
            name: processors[name](value) if name in processors else value
            for name, value in values.items()
        }
        for name in plan.uuid_arrays:
            value = values[name]
            if type(value) in (list, tuple) and all(type(item) is uuid.UUID for item in value):
                processed[name] = UuidArray(value)
            elif not plan.expands and name in plan.processors:  # skipped above
                processed[name] = plan.processors[name](value)
    if not conn.in_transaction():
        conn.begin()
    for listener in conn.dispatch.before_cursor_execute:
        listener(conn, None, text, processed, None, False)
    pooled = conn.connection
    cursor = None
    try:
        cursor = _cursor(pooled)
        cursor.execute(text, processed)
        rows: list[tuple[Any, ...]] = []
        codes = _type_codes(cursor)
        if codes is not None:
            rows = _processed_rows(plan, codes, cursor.fetchall())
        rowcount = cursor.rowcount
    except Exception as exc:
        # SQLAlchemy closes the cursor it is given: the next statement opens a new one.
        pooled.info.pop(_CURSOR, None)
        conn._handle_dbapi_exception(exc, text, processed, cursor, None)
    return Rows(plan.keys or [d[0] for d in cursor.description or ()], rows, rowcount)


#: Where a pooled DBAPI connection keeps the cursor the hot path reuses (its ``info``, which
#: the pool clears when the connection is replaced).
_CURSOR = "sqla_proletarian.cursor"


def _cursor(pooled: Any) -> Any:
    """The cursor the hot path executes on: one per DBAPI connection, kept across statements,
    so that the driver's per-cursor caches (psycopg's dumpers and loaders by type) are built
    once, not once a statement."""
    dbapi_connection = pooled.dbapi_connection
    kept = pooled.info.get(_CURSOR)
    if kept is not None and kept[0] is dbapi_connection:
        return kept[1]
    driver = type(dbapi_connection).__module__.partition(".")[0]
    if _UUID_ARRAY_DUMPER is not None and driver == "psycopg":
        # Before the cursor is made: it copies its connection's adapters.
        dbapi_connection.adapters.register_dumper(UuidArray, _UUID_ARRAY_DUMPER)
    cursor = dbapi_connection.cursor()
    pooled.info[_CURSOR] = (dbapi_connection, cursor)
    return cursor


class UuidArray(list[uuid.UUID]):
    """A list of UUIDs that the hot path's psycopg cursors send as one binary ``uuid[]``,
    built in one go (``uuid_array_binary``), where psycopg's own list dumper goes through a
    dumper call and a ``struct`` pack per element: about a tenth of a batch's client CPU
    per job, since every batch sends its jobs' ids in several arrays."""


#: PostgreSQL's type oid of uuid.
_UUID_OID = 2950
_ARRAY_HEAD = struct.Struct("!iiiii")
_EMPTY_ARRAY = struct.pack("!iii", 0, 0, _UUID_OID)
#: An element's length, 16 bytes, as the binary array format prefixes it.
_UUID_LENGTH = struct.pack("!i", 16)


def uuid_array_binary(ids: Sequence[uuid.UUID]) -> bytes:
    """``ids`` in PostgreSQL's binary array format: one dimension, no nulls, uuid items."""
    if not ids:
        return _EMPTY_ARRAY
    prefix = _UUID_LENGTH
    head = _ARRAY_HEAD.pack(1, 0, _UUID_OID, len(ids), 1)
    return head + b"".join([prefix + item.bytes for item in ids])


def _uuid_array_dumper() -> Any:
    """psycopg 3's dumper of ``UuidArray`` (None without psycopg 3)."""
    try:
        from psycopg import adapt, pq
    except ImportError:
        return None

    class UuidArrayDumper(adapt.Dumper):
        format = pq.Format.BINARY
        oid = 2951  # uuid[]

        def dump(self, obj: Any) -> bytes:
            return uuid_array_binary(obj)

    return UuidArrayDumper


_UUID_ARRAY_DUMPER = _uuid_array_dumper()


def _type_codes(cursor: Any) -> tuple[Any, ...] | None:
    """The type codes of the result's columns (as ``description``'s second items), or None
    when the statement returned no rows. psycopg 3's are read off its result, without the
    ``Column`` objects its ``description`` builds for each column on each access."""
    result = getattr(cursor, "pgresult", None)
    if result is not None:
        if not result.nfields and result.status != _TUPLES_OK:
            return None
        return tuple(map(result.ftype, range(result.nfields)))
    description = cursor.description
    return None if description is None else tuple(entry[1] for entry in description)


#: libpq's status of a result that returned rows (psycopg.pq.ExecStatus.TUPLES_OK).
_TUPLES_OK = 2


def _processed_rows(
    plan: _Plan, codes: tuple[Any, ...], rows: list[tuple[Any, ...]]
) -> list[tuple[Any, ...]]:
    """The rows with each column's result processor applied (as SQLAlchemy's result does)."""
    try:
        processors = plan.row_processors[codes]
    except KeyError:
        processors = plan.row_processors[codes] = _row_processors(plan, codes)
    if processors is None:
        return rows
    processed = []
    for row in rows:
        values = list(row)
        for index, process in processors:
            values[index] = process(values[index])
        processed.append(tuple(values))
    return processed


def _row_processors(plan: _Plan, codes: tuple[Any, ...]) -> list[tuple[int, Any]] | None:
    """The (column index, processor) pairs of a result's columns that have one."""
    types = plan.result_types
    if len(types) != len(codes):
        return None
    found = [
        (index, process)
        for index, (type_, code) in enumerate(zip(types, codes, strict=True))
        if (process := type_._cached_result_processor(plan.dialect, code)) is not None
    ]
    return found or None


def _through_sqlalchemy(conn: Connection, statement: Executable, params: Any) -> Rows:
    result = conn.execute(statement, params)
    if result.returns_rows:
        keys = tuple(result.keys())
        rows = [tuple(row) for row in result]
    else:
        keys, rows = (), []
    return Rows(keys, rows, result.rowcount)
