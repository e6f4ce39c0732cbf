"""How sqla_proletarian.errors classifies driver errors: every code of its tables, on
exceptions built the way each driver builds them (psycopg 3 ``sqlstate``, psycopg2
``pgcode``, asyncpg ``sqlstate``, PyMySQL and mysqlclient ``args[0]``, MariaDB Connector
``errno``), bare and wrapped by SQLAlchemy; and the errors that carry no code at all.

Drivers that are not installed (asyncpg, mysqlclient, MariaDB Connector) are skipped.
"""

from __future__ import annotations

import importlib
import sqlite3
import struct
from collections.abc import Callable
from types import ModuleType
from typing import Any

import psycopg
import psycopg2
import psycopg2.errors
import pymysql
import pytest
from sqlalchemy import exc as sa_exc

from sqla_proletarian.errors import (
    MYSQL_LOCK_CONFLICT_ERRNOS,
    MYSQL_TRANSIENT_ERRNOS,
    PG_LOCK_CONFLICT_SQLSTATES,
    PG_TRANSIENT_CLASSES,
    PG_TRANSIENT_SQLSTATES,
    JobTransactionLostError,
    is_lock_conflict,
    is_transient,
    mysql_errno,
    sqlstate,
)

MESSAGE = "the server's message"

#: A driver's exception for a code, and the driver's DB-API ``Error`` base class.
Built = tuple[BaseException, type[Exception]]


def optional_module(name: str) -> ModuleType:
    """A driver module that may not be installed: the test is skipped when it is not."""
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.skip(f"{name} is not installed, so its exceptions cannot be checked")


# --- PostgreSQL ----------------------------------------------------------------------------

#: Codes of the transient classes (08 connection exception, 53 insufficient resources).
PG_CLASS_CODES = ["08000", "08001", "08003", "08004", "08006", "08P01"]
PG_CLASS_CODES += ["53000", "53100", "53200", "53300", "53400"]
#: Codes after which the same work fails again: unique violation, undefined table, invalid
#: password, unknown database, insufficient privilege.
PG_PERMANENT_CODES = ["23505", "42P01", "28P01", "3D000", "42501"]
PG_CODES = sorted(PG_TRANSIENT_SQLSTATES | PG_LOCK_CONFLICT_SQLSTATES) + PG_CLASS_CODES
PG_CODES += PG_PERMANENT_CODES


def pg_expected(code: str) -> tuple[bool, bool]:
    """(lock conflict, transient), as errors.py's tables say."""
    transient = code in PG_TRANSIENT_SQLSTATES or code[:2] in PG_TRANSIENT_CLASSES
    return code in PG_LOCK_CONFLICT_SQLSTATES, transient


def psycopg_error(code: str) -> Built:
    return psycopg.errors.lookup(code)(MESSAGE), psycopg.Error


def psycopg2_error(code: str) -> Built:
    """psycopg2 sets ``pgcode`` only from the server's reply, or when unpickling."""
    exc = psycopg2.errors.lookup(code)(MESSAGE)
    exc.__setstate__({"pgerror": MESSAGE, "pgcode": code, "cursor": None})
    return exc, psycopg2.Error


def asyncpg_error(code: str) -> Built:
    """asyncpg's own exception, as its protocol builds it from the server's fields."""
    asyncpg = optional_module("asyncpg")
    exc = asyncpg.exceptions.PostgresError.new({"C": code, "M": MESSAGE, "S": "ERROR"})
    return exc, asyncpg.exceptions.PostgresError


def asyncpg_adapted_error(code: str) -> Built:
    """What SQLAlchemy's asyncpg dialect puts in ``.orig``: asyncpg's exception translated to
    its DB-API adapter's class, with the SQLSTATE copied (SQLAlchemy 2.0 and 2.1 alike)."""
    asyncpg = optional_module("asyncpg")
    from sqlalchemy.dialects.postgresql import asyncpg as sa_asyncpg

    dbapi = sa_asyncpg.AsyncAdapt_asyncpg_dbapi(asyncpg)
    raw, _ = asyncpg_error(code)
    translate = dbapi._asyncpg_error_translate
    cls = next(translate[base] for base in type(raw).__mro__ if base in translate)
    adapted = cls(f"{type(raw)}: {raw}", raw)
    if getattr(adapted, "sqlstate", None) is None:  # 2.0 sets it after construction
        adapted.pgcode = adapted.sqlstate = raw.sqlstate
    return adapted, dbapi.Error


PG_DRIVERS: dict[str, Callable[[str], Built]] = {
    "psycopg": psycopg_error,
    "psycopg2": psycopg2_error,
    "asyncpg": asyncpg_error,
    "asyncpg-sqlalchemy": asyncpg_adapted_error,
}

# --- MySQL and MariaDB ---------------------------------------------------------------------

#: Error numbers after which the same work fails again: duplicate entry, no such table,
#: access denied, unknown database.
MYSQL_PERMANENT_ERRNOS = [1062, 1146, 1045, 1049]
MYSQL_ERRNOS = sorted(MYSQL_TRANSIENT_ERRNOS | MYSQL_LOCK_CONFLICT_ERRNOS)
MYSQL_ERRNOS += MYSQL_PERMANENT_ERRNOS
#: The SQLSTATE the server sends with some of them ("HY000" otherwise); some look like
#: PostgreSQL's transient ones and must not be read as such.
MYSQL_SQLSTATES = {1213: "40001", 1792: "25006", 1040: "08004", 1053: "08S01", 1047: "08S01"}
MYSQL_SQLSTATES |= {1158: "08S01", 1159: "08S01", 1160: "08S01", 1161: "08S01"}
MYSQL_SQLSTATES |= {1969: "70100", 1317: "70100", 1927: "70100", 1203: "42000", 1226: "42000"}
MYSQL_SQLSTATES |= {1062: "23000", 1146: "42S02", 1045: "28000", 1049: "42000"}
#: The class each driver raises for the numbers that are not an OperationalError.
MYSQL_CLASSES = {1062: "IntegrityError", 1146: "ProgrammingError"}


def mysql_expected(errno: int) -> tuple[bool, bool]:
    return errno in MYSQL_LOCK_CONFLICT_ERRNOS, errno in MYSQL_TRANSIENT_ERRNOS


def pymysql_error(errno: int) -> Built:
    """Client errors (2000 and up) PyMySQL raises itself; the server's it decodes from the
    error packet."""
    if errno >= 2000:
        return pymysql.err.OperationalError(errno, MESSAGE), pymysql.err.Error
    state = MYSQL_SQLSTATES.get(errno, "HY000")
    packet = b"\xff" + struct.pack("<H", errno) + b"#" + state.encode() + MESSAGE.encode()
    with pytest.raises(pymysql.err.Error) as info:
        pymysql.err.raise_mysql_exception(packet)
    return info.value, pymysql.err.Error


def mysqlclient_error(errno: int) -> Built:
    """mysqlclient's C code raises ``cls(errno, message)``."""
    MySQLdb = optional_module("MySQLdb")
    cls = getattr(MySQLdb, MYSQL_CLASSES.get(errno, "OperationalError"))
    return cls(errno, MESSAGE), MySQLdb.Error


def mariadb_error(errno: int) -> Built:
    """MariaDB Connector/Python sets ``errno`` and ``sqlstate`` on the exception."""
    mariadb = optional_module("mariadb")
    exc = getattr(mariadb, MYSQL_CLASSES.get(errno, "OperationalError"))(MESSAGE)
    exc.errno = errno
    exc.sqlstate = MYSQL_SQLSTATES.get(errno, "HY000")
    return exc, mariadb.Error


MYSQL_DRIVERS: dict[str, Callable[[int], Built]] = {
    "pymysql": pymysql_error,
    "mysqlclient": mysqlclient_error,
    "mariadb": mariadb_error,
}

# --- the checks ----------------------------------------------------------------------------


def forms(orig: BaseException, dbapi_error: type[Exception]) -> dict[str, BaseException]:
    """The driver's exception bare (it escapes some calls unwrapped) and as SQLAlchemy
    wraps it."""
    instance = sa_exc.DBAPIError.instance("SELECT 1", {}, orig, dbapi_error)
    assert isinstance(instance, sa_exc.DBAPIError), instance
    return {
        "bare": orig,
        "OperationalError": sa_exc.OperationalError("SELECT 1", {}, orig),
        f"DBAPIError.instance -> {type(instance).__name__}": instance,
    }


def misclassified(built: Built, expected: tuple[bool, bool], bare: bool = True) -> list[str]:
    """How the classification of each form of one driver exception differs from
    ``expected`` (lock conflict, transient)."""
    wrong = []
    for form, error in forms(*built).items():
        if form == "bare" and not bare:
            continue
        found = (is_lock_conflict(error), is_transient(error))
        if found != expected:
            wrong.append(f"{built[0]!r} {form}: (lock conflict, transient) {found}, not {expected}")
    return wrong


@pytest.mark.parametrize("driver", list(PG_DRIVERS))
def test_each_postgresql_driver_reports_every_sqlstate_as_the_tables_say(driver: str) -> None:
    wrong = []
    for code in PG_CODES:
        built = PG_DRIVERS[driver](code)
        if (sqlstate(built[0]), mysql_errno(built[0])) != (code, None):
            wrong.append(f"{built[0]!r}: sqlstate {sqlstate(built[0])!r}, not {code!r}")
        wrong += misclassified(built, pg_expected(code))
    assert not wrong, "\n".join(wrong)


def test_sqlalchemys_asyncpg_adapter_errors_are_classified_unwrapped_too() -> None:
    adapted, _ = asyncpg_adapted_error("40P01")
    assert (is_lock_conflict(adapted), is_transient(adapted)) == (True, True)


@pytest.mark.parametrize("driver", list(MYSQL_DRIVERS))
def test_each_mysql_driver_reports_every_error_number_as_the_tables_say(driver: str) -> None:
    """Whatever SQLSTATE a MySQL driver carries too, only its error number counts."""
    wrong = []
    for errno in MYSQL_ERRNOS:
        built = MYSQL_DRIVERS[driver](errno)
        if (mysql_errno(built[0]), sqlstate(built[0])) != (errno, None):
            wrong.append(f"{built[0]!r}: errno {mysql_errno(built[0])!r}, not {errno}")
        wrong += misclassified(built, mysql_expected(errno))
    assert not wrong, "\n".join(wrong)


def test_the_permanent_codes_checked_are_in_no_table() -> None:
    assert all(pg_expected(code) == (False, False) for code in PG_PERMANENT_CODES)
    assert not set(MYSQL_PERMANENT_ERRNOS) & MYSQL_TRANSIENT_ERRNOS


def test_every_lock_conflict_is_also_transient() -> None:
    assert PG_LOCK_CONFLICT_SQLSTATES <= PG_TRANSIENT_SQLSTATES
    assert MYSQL_LOCK_CONFLICT_ERRNOS <= MYSQL_TRANSIENT_ERRNOS


# --- errors with no code ---------------------------------------------------------------------


def wrap(orig: BaseException, cls: type[sa_exc.DBAPIError] = sa_exc.OperationalError) -> Exception:
    return cls("SELECT 1", {}, orig)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [
        # A connection the server or the network cut: the drivers give no SQLSTATE.
        wrap(psycopg.OperationalError("server closed the connection unexpectedly")),
        psycopg.OperationalError("consuming input failed: server closed the connection"),
        wrap(psycopg2.OperationalError("server closed the connection unexpectedly")),
        psycopg2.OperationalError("server closed the connection unexpectedly"),
        wrap(sqlite3.OperationalError("database is locked")),
        wrap(sqlite3.OperationalError("database table is locked")),
        sqlite3.OperationalError("database is locked"),
        sa_exc.TimeoutError("QueuePool limit of size 5 overflow 10 reached"),
        sa_exc.PendingRollbackError("This Session's transaction has been rolled back"),
        sa_exc.DBAPIError("SELECT 1", {}, Exception("boom"), connection_invalidated=True),
    ],
    ids=lambda e: repr(getattr(e, "orig", e))[:60],
)
def test_lost_connections_busy_databases_and_full_pools_are_transient(error: Exception) -> None:
    assert is_transient(error)
    assert not is_lock_conflict(error)


@pytest.mark.parametrize(
    "error",
    [
        wrap(sqlite3.OperationalError("no such table: proletarian_job")),
        wrap(psycopg.ProgrammingError("the query has 1 placeholder but 2 parameters were passed")),
        psycopg2.InterfaceError("cursor already closed"),
        ValueError("not a database error"),
        RuntimeError("database is locked"),
        ConnectionError(2013, "Lost connection"),
    ],
    ids=lambda e: repr(getattr(e, "orig", e))[:60],
)
def test_other_errors_are_neither_transient_nor_lock_conflicts(error: Exception) -> None:
    assert not is_transient(error)
    assert not is_lock_conflict(error)


def test_a_code_as_an_unusual_type_is_no_code() -> None:
    """``errno``/``args[0]`` that are not ints (True, strings) carry no error number."""
    cases: list[Any] = [
        pymysql.err.OperationalError(True, MESSAGE),
        pymysql.err.OperationalError("1213", MESSAGE),
    ]
    for orig in cases:
        assert mysql_errno(orig) is None
        assert not is_lock_conflict(wrap(orig))


def test_a_lost_job_transaction_is_transient() -> None:
    """The worker's savepoint could not be released because the connection died with the
    server: the worker backs off and goes on, it does not stop on a polling error."""
    assert is_transient(JobTransactionLostError("the handler's savepoint could not be released"))
