"""is_transient: which database errors the worker waits out instead of stopping for."""

from __future__ import annotations

import sqlite3

import psycopg
import pymysql
import pytest
from sqlalchemy import exc as sa_exc

from sqla_proletarian.statements import is_transient


def wrap(orig: BaseException, cls: type[sa_exc.DBAPIError] = sa_exc.OperationalError) -> Exception:
    return cls("SELECT 1", {}, orig)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [
        wrap(pymysql.err.OperationalError(1213, "Deadlock found when trying to get lock")),
        wrap(pymysql.err.OperationalError(1205, "Lock wait timeout exceeded")),
        wrap(pymysql.err.OperationalError(2006, "MySQL server has gone away")),
        wrap(pymysql.err.OperationalError(2013, "Lost connection to MySQL server")),
        wrap(pymysql.err.OperationalError(2003, "Can't connect to MySQL server")),
        wrap(pymysql.err.OperationalError(1927, "Connection was killed")),
        wrap(pymysql.err.InternalError(1053, "Server shutdown in progress"), sa_exc.InternalError),
        wrap(psycopg.errors.DeadlockDetected("deadlock detected")),
        wrap(psycopg.errors.SerializationFailure("could not serialize")),
        wrap(psycopg.errors.LockNotAvailable("could not obtain lock")),
        wrap(psycopg.errors.AdminShutdown("terminating connection")),
        wrap(psycopg.errors.CannotConnectNow("the database system is starting up")),
        wrap(psycopg.errors.ConnectionFailure("connection failure")),
        wrap(psycopg.OperationalError("server closed the connection unexpectedly")),
        wrap(sqlite3.OperationalError("database is locked")),
        wrap(sqlite3.OperationalError("database table is locked")),
        sa_exc.TimeoutError("QueuePool limit of size 5 overflow 10 reached"),
    ],
    ids=lambda e: repr(getattr(e, "orig", e))[:60],
)
def test_errors_a_retry_can_cure_are_transient(error: Exception) -> None:
    assert is_transient(error)


def test_an_invalidated_connection_is_transient_whatever_the_driver_said() -> None:
    error = sa_exc.DBAPIError("SELECT 1", {}, Exception("boom"), connection_invalidated=True)
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        wrap(
            pymysql.err.ProgrammingError(1146, "Table 'x' doesn't exist"), sa_exc.ProgrammingError
        ),
        wrap(pymysql.err.IntegrityError(1062, "Duplicate entry"), sa_exc.IntegrityError),
        wrap(pymysql.err.OperationalError(1045, "Access denied")),
        wrap(psycopg.errors.UndefinedTable("relation does not exist"), sa_exc.ProgrammingError),
        wrap(psycopg.errors.UniqueViolation("duplicate key"), sa_exc.IntegrityError),
        wrap(psycopg.errors.QueryCanceled("canceling statement due to statement timeout")),
        wrap(sqlite3.OperationalError("no such table: proletarian_job")),
        ValueError("not a database error"),
        RuntimeError("database is locked"),
    ],
    ids=lambda e: repr(getattr(e, "orig", e))[:60],
)
def test_other_errors_are_not_transient(error: Exception) -> None:
    assert not is_transient(error)
