"""What differs between database servers, as data: one entry per dialect in ``DIALECTS``.

Adding a server means adding one entry here (and, where its SQL differs, a branch in the
statement builders of ``statements`` that the entry names). The worker reads these facts;
it never asks for a dialect by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Connection, Engine
from sqlalchemy.pool import SingletonThreadPool, StaticPool

from sqla_proletarian.errors import ConfigurationError

#: How a worker shows that its run records belong to a live process (see ``ledger``):
#: a session-level advisory lock (PostgreSQL), a named lock (MySQL/MariaDB), the process id
#: on this host (SQLite, one machine by nature), or not at all.
OwnerLock = Literal["advisory", "named", "process", "none"]

#: How an archive row for a job id already archived (a job enqueued again with its id)
#: replaces the old one: ON CONFLICT DO UPDATE, ON DUPLICATE KEY UPDATE, or not at all.
ArchiveUpsert = Literal[
    "postgresql_on_conflict", "sqlite_on_conflict", "mysql_on_duplicate_key", "none"
]

#: How an insert that meets a row holding the same unique key (a job's ``unique_key``, a
#: schedule's or a paused queue's name) adds nothing instead of failing: ``ON CONFLICT (key)
#: DO NOTHING``; a plain INSERT whose duplicate-key error names the key and undoes that
#: statement only, never the transaction (MySQL, MariaDB: no INSERT IGNORE, which would turn
#: other errors into warnings); or a plain INSERT in a savepoint.
InsertOrNothing = Literal[
    "postgresql_on_conflict", "sqlite_on_conflict", "mysql_duplicate_key_error", "savepoint"
]

#: How the poll finds the priorities of a queue that have a due job without reading the jobs
#: scheduled for later: a recursive CTE hopping from priority to priority through the poll
#: index, or the same hops as statements of their own, one index entry each (MySQL and
#: MariaDB: their correlated subqueries cannot start an index range, so the CTE's hops would
#: each read from the start, and the GROUP BY they can read as a loose index scan is read so
#: only with fresh statistics: with a new table's, it reads every job of the queue).
PriorityScan = Literal["recursive", "hops"]

#: MariaDB's idle-transaction limits of the session (``Dialect.idle_timeout``).
IDLE_LIMITS = "SELECT @@idle_transaction_timeout, @@idle_write_transaction_timeout"

#: Whether a MySQL or MariaDB server replicates through wsrep, a Galera cluster's node: its
#: ``wsrep_on`` and ``wsrep_provider`` (none on MySQL and on a MariaDB that is no node).
WSREP_SETTINGS = "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('wsrep_on', 'wsrep_provider')"

#: Why transaction mode is refused on a Galera cluster (``Dialect.check_worker_mode``).
GALERA_TRANSACTION_MODE = (
    "this database is a node of a MariaDB Galera cluster (wsrep_on=ON), where transaction "
    "mode cannot keep its promises: row locks and GET_LOCK hold on one node only, so workers "
    "on two nodes can claim the same job, and a claim that loses the cluster's certification "
    "at commit would run its handler twice. Use lease mode (lease_seconds=60, or the CLI's "
    "--lease-seconds), whose claim commits before any handler runs"
)

#: Why rate limits are refused on a Galera cluster (``check_rate_limits``).
GALERA_RATE_LIMITS = (
    "rate limits cannot be kept on a MariaDB Galera cluster (wsrep_on=ON): a window's starts "
    "are counted under a row lock that holds on one node only, so workers on different nodes "
    "would start more jobs than the limit. Use max_running or max_running_per_key (kept "
    "across nodes), or send every worker of the queue to one node"
)


@dataclass(frozen=True)
class Dialect:
    """The facts of one database server that the worker depends on."""

    name: str
    #: Isolation level of the claim's connection, whatever the engine says (None: SQLite,
    #: which serialises writers anyway).
    claim_isolation_level: str | None
    #: Whether a claim first takes the database's write lock (SQLite's BEGIN IMMEDIATE).
    claim_takes_write_lock: bool
    #: Whether run records go through a connection of their own (False: the claim's own).
    separate_ledger: bool
    owner_lock: OwnerLock
    archive_upsert: ArchiveUpsert
    #: Session settings of the run-record connection that make its commits cheap (or its
    #: deletes lock no gaps), and the statements that undo them before it goes back to the pool.
    ledger_setup: tuple[str, ...] = ()
    ledger_reset: tuple[str, ...] = ()
    #: Whether one statement can delete a job and its run records (a DML CTE).
    deletes_runs_with_job: bool = False
    #: An end's settle locks the rows waiting for it and marks them counted in one statement
    #: (PostgreSQL: a locking CTE and an UPDATE ... FROM it).
    settles_in_one: bool = False
    #: Whether many jobs are enqueued with one ``INSERT ... SELECT unnest(...)`` (PostgreSQL
    #: arrays) rather than an executemany (which PyMySQL sends as multi-row INSERTs).
    bulk_insert_unnest: bool = False
    #: Whether a statement on many jobs takes their ids as one array (``= ANY(:ids)``): one
    #: SQL text for any number of ids, which the driver parses once (else ``IN (...)``).
    id_arrays: bool = False
    insert_or_nothing: InsertOrNothing = "savepoint"
    #: Whether a REPEATABLE READ or SERIALIZABLE transaction whose insert meets a key that
    #: was committed after its snapshot fails (PostgreSQL: a serialization failure, which
    #: would abort the caller's transaction) instead of adding nothing.
    snapshot_conflict_fails: bool = False
    #: Whether a transaction can NOTIFY the workers' channel (sent at its commit).
    notifies: bool = False
    #: Whether statements reading many rows by key name the index to read (FORCE INDEX): on
    #: a small table MySQL and MariaDB would rather scan, and InnoDB locks every row that a
    #: locking statement reads, the rows of other claims included (deadlocks).
    force_index: bool = False
    #: How the poll finds the queue's priorities that have a due job (see ``PriorityScan``).
    priority_scan: PriorityScan = "recursive"
    #: Whether a claim's first poll finds the queue's first priority with a due job inside
    #: the statement (evaluated once, then a key of the index range), so a busy claim is one
    #: round trip. Not on MySQL and MariaDB: a priority read by a subquery is no constant to
    #: their range optimizer, so the locking read would scan (and lock) the priority's
    #: scheduled jobs; their claims read the priorities first.
    poll_finds_priority: bool = True

    @contextmanager
    def claim_connection(self, engine: Engine) -> Iterator[Connection]:
        """A connection set up for claiming: its isolation level, or SQLite's manual BEGIN."""
        with engine.connect() as conn:
            if self.claim_isolation_level is not None:
                set_up(conn, isolation_level=self.claim_isolation_level)
            if not self.claim_takes_write_lock:
                yield conn
                return
            driver = conn.connection.driver_connection
            if getattr(driver, "in_transaction", False):
                # Switching pysqlite to manual transactions would commit it.
                raise ConfigurationError(
                    "this SQLite connection is shared with the application (StaticPool or "
                    "SingletonThreadPool) and is inside the application's transaction: "
                    "commit or roll back first, or give the worker an engine of its own"
                )
            previous = getattr(driver, "isolation_level", "")
            driver.isolation_level = None  # type: ignore[union-attr]
            try:
                yield conn
            finally:
                if not conn.invalidated:
                    _end_refused_commit(conn, driver)
                if not conn.invalidated:
                    driver.isolation_level = previous  # type: ignore[union-attr]

    @contextmanager
    def ledger_connection(self, engine: Engine) -> Iterator[Connection]:
        """An autocommit connection for run records: each record commits on its own."""
        with engine.connect() as conn:
            set_up(conn, isolation_level="AUTOCOMMIT")
            for statement in self.ledger_setup:
                conn.exec_driver_sql(statement)
            try:
                yield conn
            finally:
                if not conn.invalidated:
                    for statement in self.ledger_reset:
                        conn.exec_driver_sql(statement)

    def begin_claim(self, conn: Connection) -> None:
        """Open the claim's transaction on ``conn``.

        SQLite takes the write lock at once. An engine with SQLAlchemy's pysqlite SAVEPOINT
        recipe (a ``begin`` event that emits ``BEGIN``) has just opened a deferred
        transaction that has done nothing yet: it is replaced by an immediate one.
        """
        conn.begin()
        if not self.claim_takes_write_lock:
            return
        if getattr(conn.connection.driver_connection, "in_transaction", False):
            conn.exec_driver_sql("ROLLBACK")
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    def idle_timeout(self, conn: Connection) -> float | None:
        """The session's idle-transaction limit in seconds where the server hides it in
        errors (MariaDB closes the connection without saying why); None when there is none.
        """
        if not getattr(conn.dialect, "is_mariadb", False):
            return None
        row = conn.exec_driver_sql(IDLE_LIMITS).one()
        conn.rollback()
        limits = [float(value) for value in row if value]
        return min(limits) if limits else None

    def check_worker_mode(self, conn: Connection, lease_seconds: float | None) -> None:
        """Refuse transaction mode on a node of a Galera cluster (see ``is_galera``)."""
        if lease_seconds is None and self.owner_lock == "named" and is_galera(conn):
            raise ConfigurationError(GALERA_TRANSACTION_MODE)

    def check_worker_engine(self, engine: Engine) -> None:
        """Refuse engines on which worker threads cannot have connections of their own."""
        if self.name != "sqlite":
            return
        if isinstance(engine.pool, SingletonThreadPool):
            raise ConfigurationError(
                "this SQLite engine gives each thread its own in-memory database, so worker "
                "threads would never see the jobs: use a file database "
                "(create_engine('sqlite:///jobs.db')), or a shared in-memory one "
                "('sqlite:///file:jobs?mode=memory&cache=shared&uri=true'), or "
                "process_next_job() in one thread"
            )
        if isinstance(engine.pool, StaticPool):
            raise ConfigurationError(
                "this SQLite engine has a StaticPool, which shares one connection with the "
                "application: the worker's transactions would commit or roll back the "
                "application's own. Give the worker an engine of its own on the same file, "
                "or use a shared in-memory database "
                "('sqlite:///file:jobs?mode=memory&cache=shared&uri=true') without StaticPool"
            )


def _end_refused_commit(conn: Connection, driver: Any) -> None:
    """Roll back what a refused COMMIT left open on a SQLite connection.

    SQLite refuses a COMMIT while a reader holds its lock ("database is locked") and keeps
    the transaction, with its write lock, open. SQLAlchemy takes a failed commit for an
    ended transaction and returns the connection to the pool without a rollback, where it
    would hold the write lock for good and stop every other writer.
    """
    if not getattr(driver, "in_transaction", False):
        return
    try:
        driver.rollback()
    except Exception:
        conn.invalidate()  # closed, so the pool never hands its lock on


def set_up(conn: Connection, **options: Any) -> None:
    """Set execution options; a connection that fails here (dead in the pool) is discarded.

    Some dialects set the isolation level through a raw cursor, so the driver's error
    arrives unwrapped; ``errors.is_transient`` knows those too.
    """
    try:
        conn.execution_options(**options)
    except Exception:
        conn.invalidate()
        raise


#: One entry per server. MySQL and MariaDB share their facts.
_MYSQL = {
    "claim_isolation_level": "READ COMMITTED",
    "claim_takes_write_lock": False,
    "separate_ledger": True,
    "owner_lock": "named",
    "archive_upsert": "mysql_on_duplicate_key",
    "insert_or_nothing": "mysql_duplicate_key_error",
    "force_index": True,
    # READ COMMITTED, as the claims: at the server's REPEATABLE READ a delete locks the gaps
    # between the records it reads, and other workers' record inserts wait for them.
    # SQLAlchemy puts the session's own level back when the connection returns to the pool.
    "ledger_setup": ("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",),
    "priority_scan": "hops",
    "poll_finds_priority": False,
}
DIALECTS: dict[str, Dialect] = {
    "postgresql": Dialect(
        "postgresql",
        claim_isolation_level="READ COMMITTED",
        claim_takes_write_lock=False,
        separate_ledger=True,
        owner_lock="advisory",
        archive_upsert="postgresql_on_conflict",
        # A run record lost in a server crash only forgets an unclean end: no fsync wait.
        ledger_setup=("SET synchronous_commit TO OFF",),
        ledger_reset=("RESET synchronous_commit",),
        deletes_runs_with_job=True,
        settles_in_one=True,
        bulk_insert_unnest=True,
        id_arrays=True,
        insert_or_nothing="postgresql_on_conflict",
        snapshot_conflict_fails=True,
        notifies=True,
    ),
    "mysql": Dialect("mysql", **_MYSQL),  # type: ignore[arg-type]
    "mariadb": Dialect("mariadb", **_MYSQL),  # type: ignore[arg-type]
    "sqlite": Dialect(
        "sqlite",
        claim_isolation_level=None,
        claim_takes_write_lock=True,
        separate_ledger=False,
        owner_lock="process",
        archive_upsert="sqlite_on_conflict",
        insert_or_nothing="sqlite_on_conflict",
    ),
}

#: Facts assumed for a server this library does not know: the portable subset.
GENERIC = Dialect(
    "generic",
    claim_isolation_level="READ COMMITTED",
    claim_takes_write_lock=False,
    separate_ledger=True,
    owner_lock="none",
    archive_upsert="none",
)


def is_galera(conn: Connection) -> bool:
    """Whether ``conn``'s MySQL or MariaDB server is a node of a Galera cluster: wsrep
    replication on, with a provider (one read, in the connection's transaction)."""
    settings = {name.lower(): str(value) for name, value in conn.exec_driver_sql(WSREP_SETTINGS)}
    return settings.get("wsrep_on", "").upper() in ("ON", "1") and settings.get(
        "wsrep_provider", "none"
    ).lower() not in ("", "none")


def check_rate_limits(conn: Connection) -> None:
    """Refuse rate limits on a node of a Galera cluster (see ``GALERA_RATE_LIMITS``)."""
    if dialect_of(conn).owner_lock == "named" and is_galera(conn):
        raise ConfigurationError(GALERA_RATE_LIMITS)


def dialect_of(engine: Engine | Connection) -> Dialect:
    """The Dialect entry of an engine's (or connection's) server."""
    return DIALECTS.get(engine.dialect.name, GENERIC)
