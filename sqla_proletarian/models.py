"""The Job and ArchivedJob declarative models, on the library's own registry and MetaData."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from sqlalchemy import (
    DDL,
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    Uuid,
    event,
    text,
)
from sqlalchemy.engine import Connection
from sqlalchemy.engine import Dialect as SADialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.schema import SchemaItem

from sqla_proletarian.errors import InvalidJobError
from sqla_proletarian.serialization import Serializer
from sqla_proletarian.types import UTCDateTime, exact_collation, name_type, payload_type
from sqla_proletarian.values import (
    DEFAULT_PRIORITY,
    DEFAULT_QUEUE,
    Clock,
    JobIdStrategy,
    build_job_values,
)

__all__ = [
    "DEFAULT_QUEUE",
    "ArchivedJob",
    "Base",
    "Dependency",
    "Job",
    "JobHistory",
    "JobRun",
    "PausedQueue",
    "PeriodicSchedule",
    "Progress",
    "QueueLimit",
    "Slot",
    "Start",
    "include_object",
    "metadata",
]

JOB_TABLE = "proletarian_job"
ARCHIVED_JOB_TABLE = "proletarian_archived_job"
JOB_RUN_TABLE = "proletarian_job_run"
PERIODIC_TABLE = "proletarian_periodic"
PAUSED_QUEUE_TABLE = "proletarian_paused_queue"
JOB_HISTORY_TABLE = "proletarian_job_history"
QUEUE_LIMIT_TABLE = "proletarian_queue_limit"
SLOT_TABLE = "proletarian_slot"
START_TABLE = "proletarian_start"
DEPENDENCY_TABLE = "proletarian_dependency"
PROGRESS_TABLE = "proletarian_progress"
#: A waiting job's ``process_at``: no poll reaches it; ``due_at`` keeps its own due time.
WAITING_AT = datetime(9999, 1, 1, tzinfo=UTC)
#: ``proletarian_dependency.kind`` of a ``wait_for_result`` caller's row.
WAIT_KIND = "wait"
#: The index on ``(queue, unique_key)``: unique on PostgreSQL and SQLite (their ON CONFLICT
#: names its columns), where it lets one queued job hold a ``unique_key`` in its queue; on
#: MySQL and MariaDB it only finds a key's holder, and ``UNIQUE_SLOT_INDEX`` holds the keys.
UNIQUE_KEY_INDEX = "ix_proletarian_job_unique_key"
#: MySQL and MariaDB: the unique index on the generated column ``UNIQUE_SLOT`` that lets one
#: queued job hold a ``unique_key`` in its queue (the name in a duplicate-key error).
UNIQUE_SLOT_INDEX = "ix_proletarian_job_unique_slot"
#: MySQL and MariaDB: the job table's VIRTUAL column that is NULL for a job without a
#: ``unique_key``, and its queue and key, spelled unambiguously, for a job with one.
UNIQUE_SLOT = "unique_slot"

# Why ``run_order``: a job's priority (higher runs first) is stored negated, so that the poll
# reads the index (queue, run_order, process_at, seq) in ascending order on every server, as
# it reads due times. A descending key part would do on PostgreSQL, SQLite, MySQL 8 and
# MariaDB 10.8+, but MariaDB before 10.8 ignores DESC (the poll would sort, and lock every
# due row it sorts), and MySQL's and SQLite's reflection drops it (autogenerate would see a
# difference). ``Job.priority`` and ``ArchivedJob.priority`` read it back.

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: The library's MetaData: point Alembic autogenerate at it, or create the tables with it.
metadata = MetaData(naming_convention=NAMING_CONVENTION)

Status = Literal["success", "failure", "cancelled"]

_MYSQL_TABLE_ARGS = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}


def _is_mysql(dialect: SADialect) -> bool:
    return dialect.name in ("mysql", "mariadb")


def _not_mysql(*args: Any, dialect: SADialect, **kw: Any) -> bool:
    """``ddl_if``: built on servers other than MySQL and MariaDB."""
    return not _is_mysql(dialect)


class Base(DeclarativeBase):
    """The library's own declarative base; users never subclass it."""

    metadata = metadata


class Job(Base):
    """A job waiting in a queue. ``session.add(Job(...))`` enqueues it like ``enqueue()``.

    ``payload`` holds the serialized text; the handler receives the decoded value.
    """

    # ``seq`` (the table's key) orders equal ``process_at`` values by enqueue order. The ORM
    # identifies jobs by ``job_id`` (so ``session.get(Job, job_id)`` works) and leaves ``seq``
    # to the database: a flush of many jobs is one executemany, and one job is one INSERT
    # (with ``RETURNING seq`` on PostgreSQL instead of a ``nextval()`` round trip). Query it
    # as ``Job.__table__.c.seq``.
    __table__ = Table(
        JOB_TABLE,
        metadata,
        Column(
            "seq",
            BigInteger().with_variant(Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        Column("job_id", Uuid(), nullable=False, unique=True),
        Column("queue", name_type(), nullable=False),
        Column("job_type", name_type(), nullable=False),
        Column("payload", payload_type(), nullable=False),
        Column("attempts", Integer(), nullable=False, default=0),
        Column("enqueued_at", UTCDateTime(), nullable=False),
        Column("process_at", UTCDateTime(), nullable=False),
        # W3C trace context of the enqueuing code (JSON), when OpenTelemetry is installed.
        Column("trace_context", Text(), nullable=True),
        # The job's priority negated (see above): the poll reads it in index order.
        Column("run_order", SmallInteger(), nullable=False, server_default=text("0")),
        # Held by one queued (or running) job of the queue at a time; NULL for most jobs.
        Column("unique_key", name_type(), nullable=True),
        # Lease mode (a worker's ``lease_seconds``): while a worker holds the job's lease,
        # ``process_at`` is the lease's expiry (so no poll reads a leased job before it
        # expires) and ``due_at`` keeps the job's own due time. ``lease_token`` is the run's
        # fence: only the run that wrote it can complete the job. ``unclean_ends`` counts
        # leases that expired (runs that ended with their worker), for ``max_unclean_ends``;
        # ``uncharged_runs`` the runs given back with no outcome and no charge (a lost
        # connection, a stop that gave up): ``attempts`` counts them, the retries do not.
        Column("lease_token", Uuid(), nullable=True),
        Column("lease_owner", name_type(), nullable=True),
        Column("heartbeat_at", UTCDateTime(), nullable=True),
        Column("due_at", UTCDateTime(), nullable=True),
        Column("unclean_ends", SmallInteger(), nullable=False, server_default=text("0")),
        Column("cancel_requested_at", UTCDateTime(), nullable=True),
        Column("uncharged_runs", SmallInteger(), nullable=False, server_default=text("0")),
        # What per-key limits count by (``set_queue_limits``); NULL: the queue's limits only.
        Column("concurrency_key", name_type(), nullable=True),
        # How often a handler snoozed the job (``sp.Snooze``): runs that took no attempt.
        Column("snoozes", SmallInteger(), nullable=False, server_default=text("0")),
        # How many of its dependencies (``depends_on``) had not ended at its enqueue: while it
        # is above 0 the job waits, its ``process_at`` is ``WAITING_AT`` and ``due_at`` its
        # own; -1 once the last one's end is counted (its dependency rows say which are).
        Column("waiting_on", Integer(), nullable=False, server_default=text("0")),
        Index("ix_proletarian_job_poll", "queue", "run_order", "process_at", "seq"),
        # MySQL and MariaDB get theirs from ``unique_slot_ddl`` (see there why).
        Index(UNIQUE_KEY_INDEX, "queue", "unique_key", unique=True).ddl_if(callable_=_not_mysql),
        mysql_engine=_MYSQL_TABLE_ARGS["mysql_engine"],
        mysql_charset=_MYSQL_TABLE_ARGS["mysql_charset"],
    )
    # The lease columns are the workers' (read them with Core: ``Job.__table__.c``): mapped,
    # a server default among them would make each flush fetch it back row by row.
    __mapper_args__ = {  # noqa: RUF012
        "primary_key": ["job_id"],
        "exclude_properties": [
            "seq",
            "lease_token",
            "lease_owner",
            "heartbeat_at",
            "due_at",
            "unclean_ends",
            "cancel_requested_at",
            "uncharged_runs",
            "snoozes",
            "waiting_on",
        ],
    }

    job_id: Mapped[uuid.UUID]
    queue: Mapped[str]
    job_type: Mapped[str]
    payload: Mapped[str]
    attempts: Mapped[int]
    enqueued_at: Mapped[datetime]
    process_at: Mapped[datetime]
    trace_context: Mapped[str | None]
    run_order: Mapped[int]
    unique_key: Mapped[str | None]
    concurrency_key: Mapped[str | None]

    def __init__(
        self,
        *,
        job_type: str,
        payload: Any = None,
        queue: str = DEFAULT_QUEUE,
        process_at: datetime | None = None,
        process_in: timedelta | float | None = None,
        priority: int = DEFAULT_PRIORITY,
        job_id: uuid.UUID | None = None,
        serializer: Serializer | None = None,
        job_id_strategy: JobIdStrategy | None = None,
        clock: Clock | None = None,
        unique_key: None = None,
        concurrency_key: str | None = None,
    ) -> None:
        """Validate and fill a job exactly as ``enqueue()`` does; a bad job fails here.

        ``job_id``, ``serializer``, ``job_id_strategy``, ``clock`` and ``concurrency_key``
        as for ``enqueue()``.
        A ``unique_key`` is refused: a flush could not hand back the id of the job holding
        the key, so such jobs go through ``sp.enqueue(session, ..., unique_key=...)``.
        """
        if unique_key is not None:
            raise InvalidJobError(
                "unique_key",
                "a Job added to a Session cannot return the id of the job that already holds "
                "its key; enqueue it with sp.enqueue(session, job_type, payload, "
                "unique_key=...), which inserts at once and returns that id",
            )
        values = build_job_values(
            job_type,
            payload,
            queue=queue,
            process_at=process_at,
            process_in=process_in,
            priority=priority,
            job_id=job_id,
            serializer=serializer,
            job_id_strategy=job_id_strategy,
            clock=clock,
            concurrency_key=concurrency_key,
        )
        super().__init__(**values)

    @property
    def priority(self) -> int:
        """Higher runs first (stored negated as ``run_order``)."""
        return -self.run_order

    def __repr__(self) -> str:
        return f"<Job {self.job_id} {self.job_type!r} queue={self.queue!r}>"


#: PostgreSQL: a statement-level trigger NOTIFYs the queues that got jobs on the channel the
#: workers LISTEN on (``sqla_proletarian.wakeups``). The migrations hold a frozen copy.
ENQUEUE_NOTIFY_DDL = (
    "CREATE OR REPLACE FUNCTION proletarian_job_notify() RETURNS trigger LANGUAGE plpgsql AS $$\n"
    "BEGIN\n"
    "  PERFORM pg_notify('sqla_proletarian', queue) FROM (SELECT DISTINCT queue FROM new_jobs) q;\n"
    "  RETURN NULL;\n"
    "END $$",
    f"CREATE TRIGGER proletarian_job_notify AFTER INSERT ON {JOB_TABLE} "
    "REFERENCING NEW TABLE AS new_jobs FOR EACH STATEMENT "
    "EXECUTE FUNCTION proletarian_job_notify()",
)
ENQUEUE_NOTIFY_DROP = (
    f"DROP TRIGGER IF EXISTS proletarian_job_notify ON {JOB_TABLE}",
    "DROP FUNCTION IF EXISTS proletarian_job_notify()",
)


def _enqueue_notifications_ddl() -> None:
    """``metadata.create_all`` makes the same PostgreSQL enqueue trigger as the migrations."""
    table = Job.__table__
    for statement in ENQUEUE_NOTIFY_DDL:
        ddl = DDL(statement)  # type: ignore[no-untyped-call]
        event.listen(table, "after_create", ddl.execute_if(dialect="postgresql"))
    for statement in ENQUEUE_NOTIFY_DROP:
        ddl = DDL(statement)  # type: ignore[no-untyped-call]
        event.listen(table, "before_drop", ddl.execute_if(dialect="postgresql"))


_enqueue_notifications_ddl()


def unique_slot_ddl(dialect: SADialect) -> str:
    """MySQL and MariaDB: the job table's ``unique_slot`` column, its unique index and the
    lookup index on ``(queue, unique_key)``, in one ALTER TABLE (the migrations hold a frozen
    copy, ``sqlap_0011``).

    Why not a unique index on ``(queue, unique_key)`` there: a Galera cluster certifies each
    write by the keys of its row's unique indexes, a NULL part included, so two nodes writing
    any two jobs of one queue at once conflicted at commit (error 1213). A unique index on one
    column that is NULL for most jobs gives them no key to conflict on. The slot spells the
    queue's length first, so no queue and key can spell another's; 515 utf8mb4 characters
    (2,060 bytes) stay within InnoDB's 3,072-byte index keys.
    """
    return (
        f"ALTER TABLE {JOB_TABLE} "
        f"ADD COLUMN {UNIQUE_SLOT} VARCHAR(515) CHARACTER SET utf8mb4 "
        f"COLLATE {exact_collation(dialect)} "
        "AS (IF(unique_key IS NULL, NULL, "
        "CONCAT(CHAR_LENGTH(queue), ':', queue, ':', unique_key))) VIRTUAL, "
        f"ADD UNIQUE INDEX {UNIQUE_SLOT_INDEX} ({UNIQUE_SLOT}), "
        f"ADD INDEX {UNIQUE_KEY_INDEX} (queue, unique_key)"
    )


def _add_unique_slot(target: Table, connection: Connection, **kw: Any) -> None:
    """``metadata.create_all`` gives MySQL and MariaDB the same unique slot as the migrations;
    ``unique_slot`` stays out of the models, so that the ORM never reads or writes it."""
    if _is_mysql(connection.dialect):
        connection.exec_driver_sql(unique_slot_ddl(connection.dialect))


event.listen(Job.__table__, "after_create", _add_unique_slot)


def compared_on(
    dialect: SADialect,
) -> Callable[[SchemaItem, str | None, str, bool, Any], bool]:
    """An Alembic ``include_object`` filter for comparing the library's tables with
    :data:`metadata` on ``dialect``: on MySQL and MariaDB it leaves out what
    :func:`unique_slot_ddl` builds there (and the unique index :data:`metadata` builds on the
    other servers only), which autogenerate cannot tell apart."""
    skipped = {UNIQUE_SLOT, UNIQUE_SLOT_INDEX, UNIQUE_KEY_INDEX} if _is_mysql(dialect) else set()

    def include(
        obj: SchemaItem, name: str | None, type_: str, reflected: bool, compare_to: Any
    ) -> bool:
        table = getattr(obj, "table", None)
        return not (name in skipped and getattr(table, "name", None) == JOB_TABLE)

    return include


class ArchivedJob(Base):
    """A finished job: ``status`` is ``"success"``, ``"failure"`` or ``"cancelled"`` (taken out
    of the queue by ``cancel_job`` before it ran again); ``attempts`` counts runs."""

    __tablename__ = ARCHIVED_JOB_TABLE
    __table_args__ = (
        Index("ix_proletarian_archived_job_finished_at", "finished_at"),
        _MYSQL_TABLE_ARGS,
    )

    job_id: Mapped[uuid.UUID] = mapped_column(Uuid(), primary_key=True)
    queue: Mapped[str] = mapped_column(name_type())
    job_type: Mapped[str] = mapped_column(name_type())
    payload: Mapped[str] = mapped_column(payload_type())
    attempts: Mapped[int] = mapped_column(Integer())
    enqueued_at: Mapped[datetime] = mapped_column(UTCDateTime())
    process_at: Mapped[datetime] = mapped_column(UTCDateTime())
    status: Mapped[str] = mapped_column(String(16))
    finished_at: Mapped[datetime] = mapped_column(UTCDateTime())
    error: Mapped[str | None] = mapped_column(Text(), nullable=True)
    #: The job's priority negated, as in the queue (a job put back from here keeps it).
    run_order: Mapped[int] = mapped_column(SmallInteger(), server_default=text("0"))
    #: The job's ``unique_key`` while it was queued (``retry_failed`` puts it back).
    unique_key: Mapped[str | None] = mapped_column(name_type(), nullable=True)
    #: The job's ``concurrency_key`` (``retry_failed`` puts it back with it).
    concurrency_key: Mapped[str | None] = mapped_column(name_type(), nullable=True)
    #: How often its handler snoozed it (``sp.Snooze``).
    snoozes: Mapped[int] = mapped_column(SmallInteger(), server_default=text("0"))
    #: What its handler returned, serialized (NULL: it returned None, or it did not succeed).
    result: Mapped[str | None] = mapped_column(payload_type(), nullable=True)

    @property
    def priority(self) -> int:
        """The job's priority (stored negated as ``run_order``)."""
        return -self.run_order

    def __repr__(self) -> str:
        return f"<ArchivedJob {self.job_id} {self.job_type!r} {self.status}>"


class JobHistory(Base):
    """An earlier end of a job put back in the queue by ``retry_failed``: its archive row's
    outcome as it was, kept so that ``get_job`` and the dashboard still show it once the job
    is queued (or archived) again. The archive keeps one row per job id, its last end;
    ``prune_archive`` deletes a job's history with its archive row."""

    __tablename__ = JOB_HISTORY_TABLE
    __table_args__ = (_MYSQL_TABLE_ARGS,)

    #: The order the ends were kept in.
    seq: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True
    )
    job_id: Mapped[uuid.UUID] = mapped_column(Uuid(), index=True)
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer())
    finished_at: Mapped[datetime] = mapped_column(UTCDateTime())
    error: Mapped[str | None] = mapped_column(Text(), nullable=True)

    def __repr__(self) -> str:
        return f"<JobHistory {self.job_id} {self.status} attempts={self.attempts}>"


class JobRun(Base):
    """A claim's run record: committed before a handler starts, it names the job running.

    It is removed with the outcome, or by its live worker when the run is given up. A record
    whose ``owner`` (a lock of the worker's database session, or its process on SQLite) is
    gone marks an unclean end of the job it names: how a job that crashes its worker is
    stopped from looping. See ``sqla_proletarian.ledger``.
    """

    __tablename__ = JOB_RUN_TABLE
    __table_args__ = (_MYSQL_TABLE_ARGS,)

    run_id: Mapped[uuid.UUID] = mapped_column(Uuid(), primary_key=True)
    job_id: Mapped[uuid.UUID] = mapped_column(Uuid(), index=True)
    worker_id: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    #: One of a batch's records: its job ran in a claim of several, so a crash then is
    #: not charged to it; it runs alone next (see ``sqla_proletarian.ledger``).
    batched: Mapped[bool | None] = mapped_column(Boolean(), nullable=True)


class PeriodicSchedule(Base):
    """How far a periodic job's schedule has been enqueued: the worker that moves
    ``last_occurrence`` on (a compare-and-set update) enqueues that occurrence, in the same
    transaction, so each occurrence is enqueued once however many workers run."""

    __tablename__ = PERIODIC_TABLE
    __table_args__ = (_MYSQL_TABLE_ARGS,)

    name: Mapped[str] = mapped_column(name_type(), primary_key=True)
    last_occurrence: Mapped[datetime] = mapped_column(UTCDateTime())


class PausedQueue(Base):
    """A queue whose workers claim nothing until it is resumed (``pause_queue``)."""

    __tablename__ = PAUSED_QUEUE_TABLE
    __table_args__ = (_MYSQL_TABLE_ARGS,)

    queue: Mapped[str] = mapped_column(name_type(), primary_key=True)
    paused_at: Mapped[datetime] = mapped_column(UTCDateTime())


class QueueLimit(Base):
    """A queue's flow control (``set_queue_limits``): every worker reads it at its claims.
    A NULL column is no such limit; a rate limit is ``count`` starts in ``seconds``."""

    __tablename__ = QUEUE_LIMIT_TABLE
    __table_args__ = (_MYSQL_TABLE_ARGS,)

    queue: Mapped[str] = mapped_column(name_type(), primary_key=True)
    max_running: Mapped[int | None] = mapped_column(Integer(), nullable=True)
    max_running_per_key: Mapped[int | None] = mapped_column(Integer(), nullable=True)
    rate_count: Mapped[int | None] = mapped_column(Integer(), nullable=True)
    rate_seconds: Mapped[float | None] = mapped_column(Float(), nullable=True)
    key_rate_count: Mapped[int | None] = mapped_column(Integer(), nullable=True)
    key_rate_seconds: Mapped[float | None] = mapped_column(Float(), nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Slot(Base):
    """One of the places a limited queue's jobs run in: ``slot_key`` ``""`` for the queue's
    ``max_running``, a ``concurrency_key`` for its ``max_running_per_key``; ``n`` from 1.

    A transaction-mode run holds its slot's row lock until its transaction ends; a lease-mode
    run is named by ``job_id`` and ``token``, and holds the slot while the job carries that
    lease token unexpired. See ``sqla_proletarian.flow``."""

    __tablename__ = SLOT_TABLE
    __table_args__ = (_MYSQL_TABLE_ARGS,)

    queue: Mapped[str] = mapped_column(name_type(), primary_key=True)
    slot_key: Mapped[str] = mapped_column(name_type(), primary_key=True)
    n: Mapped[int] = mapped_column(Integer(), primary_key=True, autoincrement=False)
    job_id: Mapped[uuid.UUID | None] = mapped_column(Uuid(), nullable=True)
    token: Mapped[uuid.UUID | None] = mapped_column(Uuid(), nullable=True)


class Start(Base):
    """Job starts counted by a rate limit (or reserved for a claim under way): ``slot_key``
    ``""`` for the queue's ``rate_limit``, a ``concurrency_key`` for ``rate_limit_per_key``.
    Rows older than the queue's window are deleted by the claims."""

    __tablename__ = START_TABLE
    __table_args__ = (
        Index("ix_proletarian_start_window", "queue", "slot_key", "started_at"),
        _MYSQL_TABLE_ARGS,
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid(), primary_key=True)
    queue: Mapped[str] = mapped_column(name_type())
    slot_key: Mapped[str] = mapped_column(name_type())
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    #: How many starts the row counts: a claim's starts share one row.
    starts: Mapped[int] = mapped_column(Integer())


class Dependency(Base):
    """An edge of a job graph: job ``job_id`` runs after job ``depends_on`` has ended.

    ``kind`` is the dependent's ``on_dependency_failure`` (``"cancel"`` or ``"run"``), or
    ``"wait"`` for a ``wait_for_result`` caller waiting on ``depends_on`` (``job_id`` is then
    the wait's own id, not a job's). ``pending``: the end of ``depends_on`` is not yet counted
    (the dependent waits while any of its rows is). Rows stay after they are settled (the
    dashboard draws the graph from them) until ``prune_archive`` removes the dependent. See
    ``sqla_proletarian.workflows``."""

    __tablename__ = DEPENDENCY_TABLE
    __table_args__ = (
        Index("ix_proletarian_dependency_depends_on", "depends_on"),
        Index("ix_proletarian_dependency_pending", "pending", "depends_on"),
        _MYSQL_TABLE_ARGS,
    )

    job_id: Mapped[uuid.UUID] = mapped_column(Uuid(), primary_key=True)
    depends_on: Mapped[uuid.UUID] = mapped_column(Uuid(), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8))
    pending: Mapped[bool] = mapped_column(Boolean())


class Progress(Base):
    """What a running job's handler last reported with ``set_progress``: a fraction from 0
    to 1 and an optional message. Written on a connection of its own, never in the job's
    transaction; ``prune_archive`` removes it with the job's archive row."""

    __tablename__ = PROGRESS_TABLE
    __table_args__ = (_MYSQL_TABLE_ARGS,)

    job_id: Mapped[uuid.UUID] = mapped_column(Uuid(), primary_key=True)
    progress: Mapped[float] = mapped_column(Float())
    message: Mapped[str | None] = mapped_column(Text(), nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


LIBRARY_TABLES = frozenset(metadata.tables)


def include_object(
    obj: SchemaItem, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic ``include_object`` filter that leaves the library's tables to the library.

    Use it in your own ``env.py`` so your autogenerate neither drops nor alters them.
    """
    table_name = name if type_ == "table" else getattr(getattr(obj, "table", None), "name", None)
    return table_name not in LIBRARY_TABLES
