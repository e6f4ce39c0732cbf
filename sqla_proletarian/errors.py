"""The library's exceptions: one base class, and subclasses that carry what a caller needs."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc


class ProletarianError(Exception):
    """Base class of every error sqla-proletarian raises."""


class InvalidJobError(ProletarianError, ValueError):
    """A job cannot be enqueued as given; nothing was written."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class PayloadSerializationError(InvalidJobError):
    """The payload cannot be serialized; nothing was written."""

    def __init__(self, message: str, payload: Any = None) -> None:
        self.payload = payload
        self.field = "payload"
        # The message names the place in the payload itself ("payload['a'][0] is ...").
        Exception.__init__(self, message)


class PayloadDeserializationError(ProletarianError):
    """A stored payload cannot be decoded by the worker's serializer."""

    def __init__(self, job_id: object, message: str) -> None:
        self.job_id = job_id
        super().__init__(
            f"the payload of job {job_id} cannot be decoded: {message}. "
            "Was it written by hand or by another serializer? Pass the serializer that "
            "wrote it to the worker."
        )


class NotATransactionError(ProletarianError, TypeError):
    """enqueue() was given something that is not a Session or a Connection."""


class InvalidRetryStrategyError(ProletarianError, ValueError):
    """A RetryStrategy, or what a retry strategy function returned, is not valid."""


class InvalidProgressError(ProletarianError, ValueError):
    """``job.set_progress`` was given a fraction that is not a number from 0 to 1, or a
    message that is not a string; nothing was reported."""


class ConfigurationError(ProletarianError, ValueError):
    """A worker option is not valid."""


class UnknownJobTypeError(ProletarianError, LookupError):
    """A JobHandlers table has no handler for a job type and no default handler.

    No retry can succeed until a worker knows the type, so the worker archives the job as
    failed at once, whatever the retry strategy says (``retry-failed`` puts it back once a
    handler is registered). ``known_types`` are the job types the table handles."""

    def __init__(self, job_type: str, known_types: Iterable[str] = ()) -> None:
        self.job_type = job_type
        self.known_types = tuple(sorted(known_types))
        known = ", ".join(repr(name) for name in self.known_types) or "none"
        super().__init__(
            f"no handler is registered for job type {job_type!r} (known job types: "
            f"{known}): register one with @handlers.register({job_type!r}) or add a "
            "catch-all with @handlers.default, then `sqla-proletarian retry-failed` puts the "
            "job back in its queue"
        )


class NoCurrentJobError(ProletarianError, LookupError):
    """``current_job()`` was called while no job runs in this thread or task."""

    def __init__(self) -> None:
        super().__init__(
            "current_job() is only available while a job runs: call it from a handler or a "
            "task (or what they call, in the same thread or task), not at import time or "
            "from a thread of your own"
        )


class JobCrashedError(ProletarianError):
    """A job's runs ended uncleanly too often: its worker died with it running, or the
    database ended the session of its transaction while its handler ran."""

    def __init__(
        self,
        job_id: object,
        unclean_ends: int,
        connection_losses: int = 0,
        *,
        expired_leases: int = 0,
    ) -> None:
        self.job_id = job_id
        self.unclean_ends = unclean_ends
        self.connection_losses = connection_losses
        self.expired_leases = expired_leases
        died = unclean_ends - connection_losses - expired_leases
        causes = []
        if died:
            causes.append(f"{died} ended with the worker process that ran it")
        if expired_leases:
            causes.append(
                f"{expired_leases} ended with the lease expired: the worker died, froze or "
                "could not reach the database for longer than lease_seconds, or lost the "
                "job's session before it could record the outcome"
            )
        if connection_losses:
            causes.append(
                f"{connection_losses} lost the job's database session while the handler ran, "
                "though the worker lived: the server ended that one session, most likely for "
                "an idle-transaction limit (PostgreSQL's idle_in_transaction_session_timeout, "
                "MariaDB's idle_transaction_timeout) shorter than the job. Raise the limit for "
                "the worker's sessions, split the job into shorter ones, or run it in lease "
                "mode (the worker option lease_seconds), where no transaction stays open "
                "while the handler runs"
            )
        super().__init__(
            f"job {job_id} "
            + ("crashed its worker" if died else "lost its database session while running")
            + f": {unclean_ends} runs ended without an outcome "
            f"({'; '.join(causes)}), so it was archived as failed instead of being run "
            "again. A restart of the database server, a failover or killed sessions are not "
            "counted. Fix the cause, then enqueue the job again (retry_failed); raise "
            "max_unclean_ends to allow more such runs."
        )


class JobTimeoutError(ProletarianError):
    """A job ran longer than the worker's ``job_timeout``: it was failed (and retried per the
    retry strategy) while its handler was asked to stop (``job.cancel_requested``)."""

    def __init__(self, job_id: object, seconds: float) -> None:
        self.job_id = job_id
        self.seconds = seconds
        super().__init__(
            f"job {job_id} timed out: it ran longer than job_timeout ({seconds:g} s), so it "
            "was failed and its handler asked to stop (job.cancel_requested); whatever it "
            "writes through job.session from then on is discarded. Raise job_timeout, or "
            "make the job shorter"
        )


#: The longest snooze, in seconds: a week.
MAX_SNOOZE_SECONDS = 7 * 24 * 3600.0


class Snooze(ProletarianError):
    """Raised by a handler to put its job back in the queue, due in ``seconds`` (a number
    or a ``timedelta``), without taking an attempt: a partner's ``Retry-After``, a resource
    not ready yet. The retry strategy and the failed-job handler are not called, what the
    handler wrote through ``job.session`` is rolled back, and the job's ``snoozes`` goes up
    by one. ``seconds`` must be finite, from 0 to a week (``MAX_SNOOZE_SECONDS``)."""

    def __init__(self, seconds: float | timedelta) -> None:
        self.seconds = _snooze_seconds(seconds)
        super().__init__(
            f"snoozed for {self.seconds:g} s: the job runs again then, without taking an "
            "attempt (raise Snooze only from a handler)"
        )

    @property
    def delay(self) -> timedelta:
        """How long the job waits before it is due again."""
        return timedelta(seconds=self.seconds)


def _snooze_seconds(seconds: object) -> float:
    """A snooze's seconds as a float, or a ConfigurationError that says what to give."""
    value = seconds.total_seconds() if isinstance(seconds, timedelta) else seconds
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number) and 0 <= number <= MAX_SNOOZE_SECONDS:
            return number
    raise ConfigurationError(
        f"Snooze({seconds!r}): give the seconds until the job runs again, a finite number "
        f"or a timedelta from 0 to {MAX_SNOOZE_SECONDS:g} (a week)"
    )


class ResultSerializationError(ProletarianError):
    """A handler's return value cannot be stored as its job's result: the job fails as if
    the handler had raised this (retried per the retry strategy; in transaction mode what
    the handler wrote rolls back)."""

    def __init__(self, job_id: object, message: str) -> None:
        self.job_id = job_id
        super().__init__(
            f"the return value of job {job_id}'s handler cannot be stored as its result: "
            f"{message}. Return what the worker's serializer can write (JSON by default), or "
            "None to store nothing"
        )


class ResultTooLargeError(ResultSerializationError):
    """A handler's return value, serialized, is longer than the worker's
    ``max_result_bytes``."""

    def __init__(self, job_id: object, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        ProletarianError.__init__(
            self,
            f"the return value of job {job_id}'s handler is {size:,} bytes serialized, more "
            f"than the worker's max_result_bytes ({limit:,}): store large data in a table "
            "or a file of your own and return its key, or raise max_result_bytes (the "
            "worker option, or --max-result-bytes)",
        )
        self.job_id = job_id


class JobNotFoundError(ProletarianError, LookupError):
    """No job of that id is queued or archived (never enqueued, or pruned from the
    archive)."""

    def __init__(self, job_id: object) -> None:
        self.job_id = job_id
        super().__init__(
            f"no job {job_id} is queued or archived: check the id (the one enqueue "
            "returned); an archived job is gone once prune_archive removed it"
        )


class ResultNotReady(ProletarianError):
    """``get_result``: the job has not ended yet (it is queued, waiting for its
    dependencies, or running); ``status`` says which. ``wait_for_result`` waits for it."""

    def __init__(self, job_id: object, status: str) -> None:
        self.job_id = job_id
        self.status = status
        super().__init__(
            f"job {job_id} has no result yet: it is {status}. Ask again once it has ended, "
            "or wait for it with wait_for_result(engine, job_id, timeout=...)"
        )


class JobFailedError(ProletarianError):
    """The job ended without a result: ``status`` is the archive's (``"failure"`` or
    ``"cancelled"``), ``error`` its error text (the traceback of the last run; for a
    cancel, None or why it was cancelled)."""

    def __init__(self, job_id: object, status: str, error: str | None) -> None:
        self.job_id = job_id
        self.status = status
        self.error = error
        ended = "failed" if status == "failure" else status
        summary = (error or "").strip().splitlines()
        reason = f": {summary[0]}" if summary else ""
        super().__init__(
            f"job {job_id} {ended}{reason}; it has no result (`sqla-proletarian failed` "
            "shows its error, retry_failed puts a failed job back in its queue)"
        )


class JobTransactionLostError(ProletarianError):
    """The job's transaction ended before its outcome was recorded (the server rolled it back
    or the connection was lost); nothing was recorded and the job runs again."""


# --- classifying driver errors ------------------------------------------------------------
# One place for every driver: PostgreSQL drivers report a SQLSTATE (psycopg 3 and asyncpg
# as ``sqlstate``, psycopg2 as ``pgcode``); MySQL-family drivers an error number (PyMySQL
# and mysqlclient in ``args[0]``, MariaDB Connector and mysql-connector as ``errno``).

#: Modules of the drivers whose raw exceptions can escape SQLAlchemy's wrapping.
_DRIVER_MODULES = (
    "psycopg",
    "asyncpg",
    "sqlalchemy.dialects.postgresql.asyncpg",  # SQLAlchemy's adapter of asyncpg's errors
    "pymysql",
    "MySQLdb",
    "mariadb",
    "sqlite3",
)
_PG_MODULES = ("psycopg", "asyncpg", "sqlalchemy.dialects.postgresql.asyncpg")
#: What PostgreSQL says when it refuses a login for good.
_PG_REFUSED_LOGIN = (
    "does not exist",
    "password authentication failed",
    "authentication failed",
    "no pg_hba.conf entry",
    "is not permitted to log in",
)
_MYSQL_MODULES = ("pymysql", "MySQLdb", "mariadb", "mysql.connector", "_mysql_connector")

#: PostgreSQL SQLSTATEs after which the same work can succeed later: serialization failure,
#: deadlock, lock not available, statement timeout or cancel, read-only transaction (a
#: standby during failover), shutdowns, idle-in-transaction timeout. Classes 08
#: (connection) and 53 (insufficient resources: too many connections, out of memory) too.
PG_TRANSIENT_SQLSTATES = frozenset(
    {"40001", "40P01", "55P03", "57014", "25006", "57P01", "57P02", "57P03", "25P03"}
)
PG_TRANSIENT_CLASSES = frozenset({"08", "53"})
#: Of those, the ones where the server rolled back and kept the connection.
PG_LOCK_CONFLICT_SQLSTATES = frozenset({"40001", "40P01", "55P03"})

#: MySQL/MariaDB error numbers of the same kind: lock wait timeout, deadlock, too many
#: connections (1040, 1203, 1226), read-only server (1290, 1836, 1792), statement timeouts
#: (3024 MySQL, 1969 MariaDB), query interrupted (1317), server shutdown (1053), node not
#: ready (1047, Galera), connection killed (1927), idle timeout (4031), network errors
#: (1158-1161), and the client's lost or refused connections (2002, 2003, 2006, 2013, 2055).
MYSQL_TRANSIENT_ERRNOS = frozenset(
    {1205, 1213, 1040, 1203, 1226, 1290, 1836, 1792, 3024, 1969, 1317, 1053, 1047, 1927}
    | {4031, 1158, 1159, 1160, 1161, 2002, 2003, 2006, 2013, 2055}
)
MYSQL_LOCK_CONFLICT_ERRNOS = frozenset({1205, 1213})
#: A write refused by a server that takes none: PostgreSQL's read_only_sql_transaction (a
#: standby, default_transaction_read_only), MySQL/MariaDB's read-only transaction or mode
#: (1792, 1836; 1290 names ``--read-only`` in its message, other options too).
PG_READ_ONLY_SQLSTATE = "25006"
MYSQL_READ_ONLY_ERRNOS = frozenset({1792, 1836})
#: MySQL/MariaDB's duplicate-key error; it undoes its statement, not the transaction.
MYSQL_DUPLICATE_KEY_ERRNO = 1062


def driver_error(exc: BaseException) -> BaseException | None:
    """The driver's own exception behind ``exc`` (SQLAlchemy does not wrap every call, and
    an ORM flush may wrap its DBAPIError in a StatementError)."""
    if isinstance(exc, sa_exc.StatementError) and exc.orig is not None:
        return exc.orig if isinstance(exc, sa_exc.DBAPIError) else driver_error(exc.orig)
    if type(exc).__module__.startswith(_DRIVER_MODULES):
        return exc
    return None


def sqlstate(orig: BaseException) -> str | None:
    """A PostgreSQL driver error's SQLSTATE (psycopg 3, asyncpg: ``sqlstate``; psycopg2:
    ``pgcode``); None for other drivers (MySQL's own SQLSTATEs are too coarse to use)."""
    if type(orig).__module__.startswith(_MYSQL_MODULES):
        return None
    for attribute in ("sqlstate", "pgcode"):
        value = getattr(orig, attribute, None)
        if isinstance(value, str) and len(value) == 5:
            return value
    return None


def mysql_errno(orig: BaseException) -> int | None:
    """A MySQL-family driver error's number (``errno``, or ``args[0]``); None otherwise."""
    errno = getattr(orig, "errno", None)
    if isinstance(errno, int) and not isinstance(errno, bool) and errno > 0:
        return errno
    args: tuple[Any, ...] = getattr(orig, "args", ())
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        return args[0]
    return None


def is_lock_conflict(exc: BaseException) -> bool:
    """A deadlock, serialization failure or lock wait timeout: the connection lives."""
    orig = driver_error(exc)
    if orig is None:
        return False
    return (
        sqlstate(orig) in PG_LOCK_CONFLICT_SQLSTATES
        or mysql_errno(orig) in MYSQL_LOCK_CONFLICT_ERRNOS
    )


def is_duplicate_key(exc: BaseException, key: str) -> bool:
    """A MySQL-family duplicate-key error on the unique index ``key`` (``PRIMARY`` for a
    primary key); MySQL 8 names it ``table.key``, MariaDB ``key``."""
    orig = driver_error(exc)
    if orig is None or mysql_errno(orig) != MYSQL_DUPLICATE_KEY_ERRNO:
        return False
    return re.search(rf"for key '(?:[^']*\.)?{re.escape(key)}'", str(orig)) is not None


def is_read_only(exc: BaseException) -> bool:
    """A write refused because the server takes no writes: a standby (a worker pointed at
    it, or at a primary demoted by a failover), or a read-only setting."""
    orig = driver_error(exc)
    if orig is None:
        return False
    if sqlstate(orig) == PG_READ_ONLY_SQLSTATE:
        return True
    errno = mysql_errno(orig)
    return errno in MYSQL_READ_ONLY_ERRNOS or (errno == 1290 and "read-only" in str(orig))


def is_serialization_failure(exc: BaseException) -> bool:
    """PostgreSQL's serialization failure (SQLSTATE 40001)."""
    orig = driver_error(exc)
    return orig is not None and sqlstate(orig) == "40001"


def is_transient(exc: BaseException) -> bool:
    """Whether a database error is worth retrying after a pause (lost connection, deadlock,
    failover, too many connections...)."""
    if isinstance(exc, JobTransactionLostError):
        # The job's transaction is gone (often with its connection): run it again later.
        return True
    if isinstance(exc, sa_exc.TimeoutError | sa_exc.PendingRollbackError):
        # A pool with no free connection; a transaction left broken by an earlier error
        # (the thread's connections are replaced before the next poll).
        return True
    orig = driver_error(exc)
    if orig is not None and _refused_login(orig):
        return False
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    if orig is None:
        return False
    state = sqlstate(orig)
    if state is not None:
        return state in PG_TRANSIENT_SQLSTATES or state[:2] in PG_TRANSIENT_CLASSES
    if mysql_errno(orig) in MYSQL_TRANSIENT_ERRNOS:
        return True
    module = type(orig).__module__
    if module.startswith("sqlite3"):
        message = str(orig).lower()
        return "locked" in message or "busy" in message
    # psycopg and psycopg2 report a broken connection as an OperationalError with no code.
    return type(orig).__name__ == "OperationalError" and module.startswith(_PG_MODULES)


def _refused_login(orig: BaseException) -> bool:
    """PostgreSQL refused the login for good (a wrong database, role or password): its
    drivers give that no SQLSTATE, like a lost connection, so the message tells."""
    if not type(orig).__module__.startswith(_PG_MODULES) or sqlstate(orig) is not None:
        return False
    message = str(orig).lower()
    return any(refusal in message for refusal in _PG_REFUSED_LOGIN)


def idle_limit_hit(exc: BaseException, ran_for: float, idle_timeout: float | None) -> bool:
    """Whether a lost connection was the server ending a session that sat idle in its
    transaction (PostgreSQL names it; MariaDB only drops the connection, after
    ``idle_timeout``)."""
    if idle_timeout and ran_for >= idle_timeout:
        return True
    orig = driver_error(exc)
    state = sqlstate(orig) if orig is not None else None
    message = str(orig if orig is not None else exc).lower()
    return state == "25P03" or any(
        name in message
        for name in ("idle-in-transaction", "idle_in_transaction", "idle_transaction_timeout")
    )


def idle_transaction_limit(conn: Connection) -> float | None:
    """The server's limit in seconds on a session idle in a transaction, for ``conn``'s
    sessions (PostgreSQL's idle_in_transaction_session_timeout; MariaDB's
    idle_transaction_timeout and idle_write_transaction_timeout); None when there is none."""
    name = conn.dialect.name
    try:
        if name == "postgresql":
            row = conn.exec_driver_sql(
                "SELECT setting FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'"
            ).first()
            limits = [float(row[0]) / 1000] if row is not None and row[0] else []
        elif getattr(conn.dialect, "is_mariadb", False):
            values = conn.exec_driver_sql(
                "SELECT @@idle_transaction_timeout, @@idle_write_transaction_timeout"
            ).one()
            limits = [float(value) for value in values if value]
        else:
            return None
    finally:
        conn.rollback()
    limits = [limit for limit in limits if limit > 0]
    return min(limits) if limits else None


def connection_loss_hint(
    exc: BaseException, ran_for: float = 0.0, idle_timeout: float | None = None
) -> str:
    """What to change when a job's transaction was cut off by the server or the network.

    ``idle_timeout`` is the server's idle-transaction limit in seconds, where it has one the
    error does not name (MariaDB just drops the connection).
    """
    if idle_timeout and ran_for >= idle_timeout:
        return (
            f"the job ran {ran_for:.1f} s, longer than the server's idle transaction timeout "
            f"({idle_timeout:g} s: MariaDB's idle_transaction_timeout or "
            "idle_write_transaction_timeout), so the server closed the worker's session; the "
            "job will run again. Raise that timeout for the worker's sessions or make the job "
            "shorter"
        )
    orig = driver_error(exc)
    state = sqlstate(orig) if orig is not None else None
    message = str(orig if orig is not None else exc).lower()
    if state == "25P03" or "idle-in-transaction" in message or "idle_in_transaction" in message:
        return (
            "the job's transaction sat idle longer than PostgreSQL's "
            "idle_in_transaction_session_timeout, so the server ended the worker's session; "
            "the job will run again. Raise the timeout for the worker's role "
            "(ALTER ROLE <worker> SET idle_in_transaction_session_timeout = '<longer>') or "
            "make the job shorter"
        )
    if "idle_transaction_timeout" in message or "idle_write_transaction_timeout" in message:
        return (
            "the job's transaction sat idle longer than MariaDB's idle_transaction_timeout; "
            "the job will run again. Raise it for the worker's sessions or make the job shorter"
        )
    if state == "57014" or "statement timeout" in message:
        return (
            "a statement ran longer than statement_timeout; raise it for the worker's role "
            "or make the statement faster"
        )
    return (
        "the database connection was lost while the job ran (server restart, network, or the "
        "connection was terminated); the job's transaction rolled back and it will run again"
    )


def polling_error_hint(exc: BaseException) -> str | None:
    """A hint for polling errors a user can fix, such as tables that were never created."""
    message = str(getattr(exc, "orig", exc)).lower()
    if any(t in message for t in ("does not exist", "doesn't exist", "no such table")):
        return (
            "the job tables are missing or not visible: install them with the migrations "
            "(README, 'Migrations') or sqla_proletarian.metadata.create_all(engine)"
        )
    if "permission denied" in message or "command denied" in message:
        return "the worker's database role lacks a grant: see docs/privileges.md"
    return None


def transient_hint(exc: BaseException) -> str | None:
    """A hint for transient errors that a setting can cure."""
    if is_read_only(exc):
        return (
            "the worker's database server takes no writes (a standby, or a read-only "
            "setting): point the worker's URL at the primary, or, on PostgreSQL, list every "
            "server with target_session_attrs=read-write so that it finds the primary after a "
            "failover (docs/guide/databases.md, 'Failover to a standby'). The worker retries "
            "and runs jobs once the server takes writes"
        )
    if isinstance(exc, sa_exc.TimeoutError):
        return (
            "no connection was free in the engine's pool: each worker thread holds two "
            "(its claim and its run records; one on SQLite), so give the engine "
            "pool_size + max_overflow >= 2 * worker_threads plus what the app uses"
        )
    orig = driver_error(exc)
    too_many = ("too many connections", "connection limit")
    if orig is not None and (
        mysql_errno(orig) in (1040, 1203, 1226)
        or sqlstate(orig) == "53300"
        or any(text in str(orig).lower() for text in too_many)
    ):
        return "the server refused a connection (too many connections); the worker waits"
    return None
