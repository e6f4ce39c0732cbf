"""What the lease-mode tests share: the table their handlers write to, the job's row as the
lease leaves it, and the look at each server for a transaction or a row lock that a worker
holds while its leased handlers run."""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sqla_proletarian as sp

JOB = sp.Job.__table__


class Base(DeclarativeBase):
    pass


class Note(Base):
    """What handlers write through ``job.session``."""

    __tablename__ = "lease_notes"
    id: Mapped[int] = mapped_column(primary_key=True)
    text: Mapped[str] = mapped_column(sa.String(100))


def notes(engine: sa.Engine) -> list[str]:
    """Every note's text, sorted."""
    with Session(engine) as session:
        return sorted(session.scalars(sa.select(Note.text)))


def job_row(engine: sa.Engine, job_id: uuid.UUID) -> Any:
    """The job's row in the queue with its lease columns, or None once it left the queue."""
    with engine.connect() as conn:
        return conn.execute(sa.select(JOB).where(JOB.c.job_id == job_id)).first()


def held_by_others(backend: str, engine: sa.Engine, job_ids: list[uuid.UUID]) -> list[str]:
    """What other sessions of the test's database hold: open transactions, transaction ids
    and locks on the given jobs' rows (an empty list when they hold nothing). On SQLite,
    whether another connection can take the write lock."""
    if backend == "sqlite":
        path = engine.url.database
        assert path is not None
        conn = sqlite3.connect(path, timeout=0.5, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        except sqlite3.OperationalError as exc:
            return [f"BEGIN IMMEDIATE failed: {exc}"]
        finally:
            conn.close()
        return []
    found: list[str] = []
    with engine.connect() as conn:
        if backend == "postgresql":
            for pid, state, xid, query in conn.exec_driver_sql(
                "SELECT pid, state, backend_xid::text, query FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND (state IN ('idle in transaction', 'idle in transaction (aborted)') "
                "OR backend_xid IS NOT NULL)"
            ):
                found.append(f"session {pid} {state} xid={xid}: {query}")
            for pid, mode in conn.exec_driver_sql(
                "SELECT l.pid, l.mode FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE a.datname = current_database() AND l.pid <> pg_backend_pid() "
                "AND l.locktype = 'transactionid'"
            ):
                found.append(f"session {pid} holds a transaction id ({mode})")
        else:
            for thread, state, started in conn.exec_driver_sql(
                "SELECT t.trx_mysql_thread_id, t.trx_state, t.trx_started "
                "FROM information_schema.innodb_trx t JOIN information_schema.processlist p "
                "ON p.id = t.trx_mysql_thread_id WHERE p.db = DATABASE() "
                "AND p.id <> CONNECTION_ID()"
            ):
                found.append(f"connection {thread} has an InnoDB transaction {state} {started}")
        conn.rollback()
        for job_id in job_ids:
            try:
                conn.execute(
                    sa.select(JOB.c.job_id)
                    .where(JOB.c.job_id == job_id)
                    .with_for_update(nowait=True)
                ).all()
            except sa.exc.DBAPIError as exc:
                found.append(f"the row of job {job_id} is locked: {exc.orig!r}")
            finally:
                with contextlib.suppress(sa.exc.DBAPIError):
                    conn.rollback()
    return found


def kill_session(admin: sa.Engine, dbapi_connection: Any) -> None:
    """End a worker connection's server session from another connection (a lost session)."""
    with admin.connect() as conn:
        if admin.dialect.name == "postgresql":
            info = getattr(dbapi_connection, "info", None)
            pid = info.backend_pid if info is not None else dbapi_connection.get_backend_pid()
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        else:
            conn.exec_driver_sql(f"KILL {int(dbapi_connection.thread_id())}")
