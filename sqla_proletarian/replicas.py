"""How far the server the views read from lags behind its primary.

The read-only views (``sqla-proletarian status``, ``jobs``, ``failed`` and the dashboard)
can read from a replica (``--read-url``, ``read_engine=``); ``replica_lag`` says how stale
what they show may be: a PostgreSQL standby's WAL received and not yet replayed, a MySQL or
MariaDB replica's ``Seconds_Behind_Master``, a Galera node's receive queue. A server that
cannot be asked (a revoked function, a missing privilege, no connection) gives a lag
"unknown" with the reason, never an error: the views go on without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy import exc as sa_exc

from sqla_proletarian import statements as sql
from sqla_proletarian.errors import driver_error, mysql_errno
from sqla_proletarian.inspection import _reading
from sqla_proletarian.logs import log_event

__all__ = ["REPLICA_ROLES", "ReplicaLag", "replica_lag"]

#: What ``ReplicaLag.role`` says the server is.
REPLICA_ROLES = ("primary", "standby", "replica", "galera", "unknown")
#: MySQL/MariaDB: the statement is not understood (``SHOW REPLICA STATUS`` on older servers).
_PARSE_ERROR = 1064


@dataclass(frozen=True)
class ReplicaLag:
    """How far a server lags behind its primary.

    ``role``: ``primary`` (not a replica: what it shows is current), ``standby`` (a
    PostgreSQL standby: ``bytes`` of WAL received and not yet replayed, and ``seconds``
    since the last replayed commit while some wait, 0 once all is replayed), ``replica``
    (a MySQL or MariaDB replica: ``seconds`` is its ``Seconds_Behind_Master``), ``galera``
    (a Galera node: ``queued`` write sets received and not yet applied) or ``unknown``.
    ``reason`` says why a figure is missing (the server refused the read, replication is
    stopped...); None when all is known.
    """

    role: str
    bytes: int | None = None
    seconds: float | None = None
    queued: int | None = None
    reason: str | None = None

    def describe(self) -> str:
        """One line for a person: ``replica lag: 1024 bytes, 2.5s (PostgreSQL standby)``,
        ``not a replica``, or ``lag unknown: <reason>``."""
        if self.role == "primary":
            return "not a replica: reading from the primary"
        if self.role == "galera" and self.queued is not None:
            return f"replica lag: {self.queued} write sets to apply (Galera node)"
        if self.role == "standby" and self.bytes is not None and self.seconds is not None:
            return f"replica lag: {self.bytes} bytes, {self.seconds:.1f}s (PostgreSQL standby)"
        if self.role == "replica" and self.seconds is not None:
            return f"replica lag: {self.seconds:.0f}s (Seconds_Behind_Master)"
        return f"lag unknown: {self.reason or 'the server did not say'}"

    def as_dict(self) -> dict[str, Any]:
        """The fields, and ``text``: what ``describe`` says (for JSON)."""
        return {**asdict(self), "text": self.describe()}


def replica_lag(bind: Engine | Connection) -> ReplicaLag:
    """How far the server of ``bind`` lags behind its primary; ``role="unknown"`` with the
    reason when it cannot be read (the views that show it go on without it).

    With a Connection inside a transaction, the reads run in a savepoint, so a refused one
    leaves the transaction usable.
    """
    try:
        with _reading(bind, "replica_lag") as conn:
            reader = _READERS.get(conn.dialect.name)
            if reader is None:  # SQLite: no replicas, nothing to ask
                return ReplicaLag("primary")
            with _contained(conn):
                return reader(conn)
    except sa_exc.SQLAlchemyError as exc:
        reason = _reason(exc)
        log_event(
            logging.INFO,
            "replica-lag-unknown",
            reason=reason,
            hint="the views go on without it; docs/dashboard.md (Reading from a replica) lists "
            "what the read role needs",
        )
        return ReplicaLag("unknown", reason=reason)


@contextmanager
def _contained(conn: Connection) -> Iterator[None]:
    """The caller's transaction stays usable after a refused read: a savepoint inside one,
    else the reads' own transaction, rolled back."""
    if conn.in_transaction():
        with conn.begin_nested():
            yield
        return
    try:
        yield
    finally:
        if not conn.invalidated:
            conn.rollback()


def _postgresql(conn: Connection) -> ReplicaLag:
    if not conn.execute(*sql.in_recovery()).scalar_one():
        return ReplicaLag("primary")
    row = conn.execute(*sql.standby_lag()).one()
    size = None if row.bytes is None else int(row.bytes)
    seconds = None if row.seconds is None else max(0.0, float(row.seconds))
    reason = None
    if size is None:
        reason = "the standby receives no WAL by streaming (pg_last_wal_receive_lsn() is NULL)"
    elif seconds is None:
        reason = "the standby has replayed no commit since it started"
    return ReplicaLag("standby", bytes=size, seconds=seconds, reason=reason)


def _mysql(conn: Connection) -> ReplicaLag:
    wsrep = conn.execute(*sql.wsrep_on()).first()
    if wsrep is not None and str(wsrep[1]).upper() == "ON":
        queued = conn.execute(*sql.wsrep_recv_queue()).first()
        if queued is None:
            return ReplicaLag("galera", reason="the server shows no wsrep_local_recv_queue")
        return ReplicaLag("galera", queued=int(queued[1]))
    try:  # a refused statement leaves a MySQL transaction usable: no savepoint needed
        status = conn.execute(*sql.replica_status()).mappings().first()
    except sa_exc.DBAPIError as exc:
        orig = driver_error(exc)
        if orig is None or mysql_errno(orig) != _PARSE_ERROR:
            raise
        status = conn.execute(*sql.replica_status(older=True)).mappings().first()
    if status is None:
        return ReplicaLag("primary")
    behind = status.get("Seconds_Behind_Master", status.get("Seconds_Behind_Source"))
    if behind is None:
        return ReplicaLag(
            "replica",
            reason="replication is stopped or broken (Seconds_Behind_Master is NULL): see "
            "SHOW REPLICA STATUS on the replica",
        )
    return ReplicaLag("replica", seconds=float(behind))


#: How each server says it is a replica, by SQLAlchemy's dialect name; any other (SQLite)
#: has none.
_READERS: dict[str, Callable[[Connection], ReplicaLag]] = {
    "postgresql": _postgresql,
    "mysql": _mysql,
    "mariadb": _mysql,
}


def _reason(exc: BaseException) -> str:
    """The first line of the driver's own message (a MySQL driver's without its tuple)."""
    orig = driver_error(exc)
    text = str(orig if orig is not None else exc)
    errno = mysql_errno(orig) if orig is not None else None
    args: tuple[Any, ...] = getattr(orig, "args", ())
    if errno is not None and len(args) == 2 and isinstance(args[1], str):
        text = f"{args[1]} (error {errno})"
    lines = text.strip().splitlines()
    return " ".join(lines[0].split()) if lines else type(exc).__name__
