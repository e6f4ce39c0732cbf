"""Insert-or-nothing: a row whose unique key another row holds already adds nothing.

Unique jobs use it (a job with a ``unique_key`` that a queued or running job of its queue
holds is not added, and the holder's id is returned), and so do periodic schedules and
paused queues. How a server adds nothing is the dialect's ``insert_or_nothing`` form.

Two transactions racing on one key do not both add a row: the second insert waits for the
first transaction and then meets its row (or, if it rolled back, inserts). Snapshots need
care twice. A PostgreSQL REPEATABLE READ or SERIALIZABLE transaction fails (serialization
failure) where its insert meets a key committed after its snapshot: at those levels the
insert runs in a savepoint, so the failure undoes the insert only and means "the key is
held". And a snapshot cannot see that holder (PostgreSQL's, and MySQL's default REPEATABLE
READ): its id is then read as committed now, on a connection of its own.

On MySQL and MariaDB an insert that meets the key share-locks the holder's row until the
caller's transaction ends, and a worker cannot archive the holder meanwhile: the holder is
read first, without a lock, and the insert runs only when none is in sight (a holder
committed after the caller's snapshot, or racing it, still meets the insert).
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections.abc import Callable
from typing import Any, Literal

from sqlalchemy import Connection, Executable, Transaction
from sqlalchemy import exc as sa_exc

from sqla_proletarian import statements as sql
from sqla_proletarian import wakeups
from sqla_proletarian.dialects import Dialect, dialect_of
from sqla_proletarian.errors import ProletarianError, is_duplicate_key, is_serialization_failure
from sqla_proletarian.models import UNIQUE_SLOT_INDEX

#: Inserts tried before giving up when the job holding the key keeps leaving the queue
#: between the insert and the read of its id (each time, the key was free again).
MAX_INSERT_ATTEMPTS = 10

#: The unique index of a primary key, as MySQL names it in its duplicate-key errors.
PRIMARY_KEY = "PRIMARY"

#: Isolation levels whose snapshot outlives a statement.
_SNAPSHOT_LEVELS = frozenset({"REPEATABLE READ", "SERIALIZABLE"})

_LOCK = threading.Lock()
#: Whether each open transaction reads from one snapshot (asked once per transaction).
_SNAPSHOTS: weakref.WeakKeyDictionary[Transaction, bool] = weakref.WeakKeyDictionary()


def enqueue_unique(conn: Connection, values: dict[str, Any]) -> uuid.UUID:
    """Insert a job with a unique key in ``conn``'s transaction, or find the job of its queue
    holding the key; the id of whichever job holds it now."""
    dialect = dialect_of(conn)
    queue, key = values["queue"], values["unique_key"]
    if dialect.insert_or_nothing == "mysql_duplicate_key_error":
        # A duplicate-key error share-locks the holder until the caller's transaction ends
        # (InnoDB): a worker could not archive it. A holder in sight is read without a lock.
        holder: uuid.UUID | None = conn.execute(*sql.key_holder(queue, key)).scalar()
        if holder is not None:
            return holder
    statement = sql.insert_job_or_nothing(values, dialect.insert_or_nothing)
    for _ in range(MAX_INSERT_ATTEMPTS):
        outcome, failure = _insert(conn, dialect, statement, UNIQUE_SLOT_INDEX)
        if outcome == "inserted":
            wakeups.enqueued(conn, {queue})
            job_id: uuid.UUID = values["job_id"]
            return job_id
        holder = _key_holder(conn, dialect, queue, key, seen=outcome == "held")
        if holder is not None:
            return holder
        if failure is not None:
            # No holder after all: the serialization failure had another cause (SERIALIZABLE's
            # read/write dependencies), which only a retry of the whole transaction cures.
            raise failure
    raise ProletarianError(
        f"the job holding unique_key {key!r} in queue {queue!r} left the queue "
        f"{MAX_INSERT_ATTEMPTS} times between an insert and the read of its id; nothing was "
        "added: enqueue again"
    )


#: What an insert-or-nothing did: added its row; met a row holding its key; or met one that
#: the transaction's snapshot cannot see (committed by another transaction after it began).
Outcome = Literal["inserted", "held", "held_unseen"]


def insert_or_nothing(
    conn: Connection,
    dialect: Dialect,
    statement: tuple[Executable, Any],
    key: str,
) -> bool:
    """Run an insert-or-nothing statement of ``dialect``'s form; True if it added its row,
    False if the unique index ``key`` holds the row's key already."""
    outcome, _ = _insert(conn, dialect, statement, key)
    return outcome == "inserted"


def _insert(
    conn: Connection, dialect: Dialect, statement: tuple[Executable, Any], key: str
) -> tuple[Outcome, Exception | None]:
    """What the insert did, and the error that told where the server fails instead."""
    form = dialect.insert_or_nothing
    if form == "mysql_duplicate_key_error":
        try:
            conn.execute(*statement)
        except sa_exc.IntegrityError as exc:
            if is_duplicate_key(exc, key):
                return "held", None
            raise
        return "inserted", None
    if form == "savepoint":
        return _in_savepoint(conn, statement, lambda exc: isinstance(exc, sa_exc.IntegrityError))
    if dialect.snapshot_conflict_fails and _snapshot(conn):
        # The server fails where the holder is not the transaction's own and its snapshot
        # cannot see it: reading it there would fail again (SERIALIZABLE).
        outcome, failure = _in_savepoint(conn, statement, is_serialization_failure)
        return ("held_unseen", failure) if failure is not None else (outcome, None)
    return ("inserted" if conn.execute(*statement).rowcount == 1 else "held"), None


def _in_savepoint(
    conn: Connection, statement: tuple[Executable, Any], held: Callable[[Exception], bool]
) -> tuple[Outcome, Exception | None]:
    """The insert in a savepoint: an error that ``held`` says means "the key is held" undoes
    the insert only (and is returned); so does a conflict that adds no row."""
    savepoint = conn.begin_nested()
    try:
        inserted = conn.execute(*statement).rowcount == 1
    except sa_exc.DBAPIError as exc:
        savepoint.rollback()
        if held(exc):
            return "held", exc
        raise
    except BaseException:
        savepoint.rollback()
        raise
    savepoint.commit()
    return ("inserted" if inserted else "held"), None


def _snapshot(conn: Connection) -> bool:
    """Whether ``conn``'s transaction reads from one snapshot (REPEATABLE READ, SERIALIZABLE):
    the server is asked once per transaction."""
    transaction = conn.get_transaction()
    with _LOCK:
        known = _SNAPSHOTS.get(transaction) if transaction is not None else None
    if known is not None:
        return known
    snapshot = str(conn.get_isolation_level()).upper() in _SNAPSHOT_LEVELS
    transaction = conn.get_transaction()
    if transaction is not None:
        with _LOCK:
            _SNAPSHOTS[transaction] = snapshot
    return snapshot


def _key_holder(
    conn: Connection, dialect: Dialect, queue: str, key: str, *, seen: bool
) -> uuid.UUID | None:
    """The id of the job holding ``key``: as the caller's transaction sees it (unless it
    cannot, ``seen=False``), else (a snapshot older than the holder's commit) as committed
    now; None if it has left."""
    holder: uuid.UUID | None = None
    if seen:
        holder = conn.execute(*sql.key_holder(queue, key)).scalar()
    if holder is not None or dialect.claim_takes_write_lock:
        # SQLite: a writer reads the newest data already.
        return holder
    with dialect.claim_connection(conn.engine) as fresh:
        holder = fresh.execute(*sql.key_holder(queue, key)).scalar()
        fresh.rollback()
    return holder
