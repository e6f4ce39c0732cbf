"""The library's schema as Alembic migrations, and helpers for a single-head history.

Two ways in. Keep one head: ``sqla-proletarian alembic-revision PATH`` writes a revision of
your own project that calls the helpers below (:data:`REVISION_HELPERS`), on its head (or call
them from a revision you write yourself). Or add :data:`VERSION_LOCATION` (or
``sqla_proletarian.migrations:versions``) to your ``version_locations`` and run ``alembic
upgrade heads``: the revisions sit on their own branch, labelled :data:`BRANCH_LABEL`.

The DDL below is frozen: each helper is the schema change of one revision and never follows
later edits of the models. A release that changes the schema adds a revision and a helper for
it: ``create_tables`` is ``sqlap_0001``; ``add_run_owners`` and ``add_enqueue_notifications``
are ``sqlap_0002``; ``add_trace_context`` is ``sqlap_0003``; ``add_job_control`` is
``sqlap_0004``; ``add_archived_unique_key`` is ``sqlap_0005``; ``add_leases`` is
``sqlap_0006``; ``add_uncharged_runs`` is ``sqlap_0007``; ``add_job_history`` is
``sqlap_0008``; ``add_flow_control`` is ``sqlap_0009``; ``add_workflows`` is ``sqlap_0010``;
``add_unique_slot`` is ``sqlap_0011``. A single-head project calls each new helper from a new
revision of its own, in that order.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, cast

import sqlalchemy as sa
from alembic import op as alembic_op
from alembic.operations import Operations
from sqlalchemy.dialects import mysql

from sqla_proletarian.models import include_object

__all__ = [
    "BRANCH_LABEL",
    "HEAD_REVISION",
    "INITIAL_REVISION",
    "REVISION_HELPERS",
    "VERSION_LOCATION",
    "add_archived_unique_key",
    "add_enqueue_notifications",
    "add_flow_control",
    "add_job_control",
    "add_job_history",
    "add_leases",
    "add_run_owners",
    "add_trace_context",
    "add_uncharged_runs",
    "add_unique_slot",
    "add_workflows",
    "create_tables",
    "drop_archived_unique_key",
    "drop_enqueue_notifications",
    "drop_flow_control",
    "drop_job_control",
    "drop_job_history",
    "drop_leases",
    "drop_run_owners",
    "drop_tables",
    "drop_trace_context",
    "drop_uncharged_runs",
    "drop_unique_slot",
    "drop_workflows",
    "include_object",
]

#: Absolute path of the folder holding the library's revisions.
VERSION_LOCATION = str(Path(__file__).resolve().parent / "versions")

#: Branch label of the library's revisions: ``alembic upgrade sqla_proletarian@head``.
BRANCH_LABEL = "sqla_proletarian"

#: The revision whose schema :func:`create_tables` builds.
INITIAL_REVISION = "sqlap_0001"

#: The newest revision of the library's branch.
HEAD_REVISION = "sqlap_0011"

#: Each library revision, oldest first, with the helpers that make its schema change (called
#: in this order from ``upgrade()``) and those that undo it (from ``downgrade()``): what
#: ``sqla-proletarian alembic-revision`` writes into a single-head project's own revision.
REVISION_HELPERS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("sqlap_0001", ("create_tables",), ("drop_tables",)),
    (
        "sqlap_0002",
        ("add_run_owners", "add_enqueue_notifications"),
        ("drop_enqueue_notifications", "drop_run_owners"),
    ),
    ("sqlap_0003", ("add_trace_context",), ("drop_trace_context",)),
    ("sqlap_0004", ("add_job_control",), ("drop_job_control",)),
    ("sqlap_0005", ("add_archived_unique_key",), ("drop_archived_unique_key",)),
    ("sqlap_0006", ("add_leases",), ("drop_leases",)),
    ("sqlap_0007", ("add_uncharged_runs",), ("drop_uncharged_runs",)),
    ("sqlap_0008", ("add_job_history",), ("drop_job_history",)),
    ("sqlap_0009", ("add_flow_control",), ("drop_flow_control",)),
    ("sqlap_0010", ("add_workflows",), ("drop_workflows",)),
    ("sqlap_0011", ("add_unique_slot",), ("drop_unique_slot",)),
)

# Table names are spelled out (not imported from the models) so the revision stays as written.
_JOB = "proletarian_job"
_ARCHIVED_JOB = "proletarian_archived_job"
_JOB_RUN = "proletarian_job_run"
_TABLES = (_JOB, _ARCHIVED_JOB, _JOB_RUN)
_PERIODIC = "proletarian_periodic"
_PAUSED_QUEUE = "proletarian_paused_queue"
_JOB_HISTORY = "proletarian_job_history"
_QUEUE_LIMIT = "proletarian_queue_limit"
_SLOT = "proletarian_slot"
_START = "proletarian_start"
_DEPENDENCY = "proletarian_dependency"
_PROGRESS = "proletarian_progress"
_POLL_INDEX = "ix_proletarian_job_poll"
_UNIQUE_KEY_INDEX = "ix_proletarian_job_unique_key"
_UNIQUE_SLOT_INDEX = "ix_proletarian_job_unique_slot"

_NAME_LENGTH = 255
_MYSQL_TABLE_OPTIONS: dict[str, Any] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}


def _sequence() -> sa.types.TypeEngine[int]:
    """The enqueue-order tie-breaker: BIGINT, or INTEGER on SQLite (an alias of the rowid)."""
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _name(dialect: sa.Dialect) -> sa.types.TypeEngine[str]:
    """A queue name or job type, compared exactly (binary NO PAD collation on MySQL)."""
    return sa.String(_NAME_LENGTH).with_variant(
        mysql.VARCHAR(_NAME_LENGTH, charset="utf8mb4", collation=_exact_collation(dialect)),
        "mysql",
        "mariadb",
    )


def _exact_collation(dialect: sa.Dialect) -> str:
    """The binary, NO PAD utf8mb4 collation of a MySQL-family server."""
    return "utf8mb4_nopad_bin" if getattr(dialect, "is_mariadb", False) else "utf8mb4_0900_bin"


def _payload() -> sa.types.TypeEngine[str]:
    """Serialized payload: TEXT, or LONGTEXT on MySQL (whose TEXT stops at 64 KiB)."""
    return sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")


def _timestamp() -> sa.types.TypeEngine[Any]:
    """An instant with microseconds: TIMESTAMPTZ, DATETIME(6) on MySQL, DATETIME on SQLite."""
    return (
        sa.DateTime(timezone=True)
        .with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
        .with_variant(sa.DateTime(), "sqlite")
    )


def _operations(op: Operations | ModuleType | None) -> Operations:
    # ``alembic.op`` is a module that forwards each call to the running migration's Operations.
    return cast(Operations, alembic_op if op is None else op)


def create_tables(op: Operations | ModuleType | None = None) -> None:
    """Create the job, archived-job and job-run tables with their indexes.

    Call it from ``upgrade()`` of your own revision; ``op`` defaults to ``alembic.op``.
    Constraint and index names are final (``op.f``), so your naming convention leaves them be.
    """
    ops = _operations(op)
    dialect = ops.get_context().dialect
    ops.create_table(
        _JOB,
        sa.Column("seq", _sequence(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("queue", _name(dialect), nullable=False),
        sa.Column("job_type", _name(dialect), nullable=False),
        sa.Column("payload", _payload(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("enqueued_at", _timestamp(), nullable=False),
        sa.Column("process_at", _timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=ops.f("pk_proletarian_job")),
        sa.UniqueConstraint("job_id", name=ops.f("uq_proletarian_job_job_id")),
        **_MYSQL_TABLE_OPTIONS,
    )
    # The poll filters on queue and process_at and orders by process_at, seq.
    ops.create_index(ops.f("ix_proletarian_job_poll"), _JOB, ["queue", "process_at", "seq"])

    ops.create_table(
        _ARCHIVED_JOB,
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("queue", _name(dialect), nullable=False),
        sa.Column("job_type", _name(dialect), nullable=False),
        sa.Column("payload", _payload(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("enqueued_at", _timestamp(), nullable=False),
        sa.Column("process_at", _timestamp(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("finished_at", _timestamp(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("job_id", name=ops.f("pk_proletarian_archived_job")),
        **_MYSQL_TABLE_OPTIONS,
    )
    ops.create_index(
        ops.f("ix_proletarian_archived_job_finished_at"), _ARCHIVED_JOB, ["finished_at"]
    )

    ops.create_table(
        _JOB_RUN,
        sa.Column("run_id", sa.Uuid(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("worker_id", sa.String(255), nullable=False),
        sa.Column("started_at", _timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", name=ops.f("pk_proletarian_job_run")),
        **_MYSQL_TABLE_OPTIONS,
    )
    ops.create_index(ops.f("ix_proletarian_job_run_job_id"), _JOB_RUN, ["job_id"])


def drop_tables(op: Operations | ModuleType | None = None) -> None:
    """Drop the library's tables (and their indexes with them), undoing :func:`create_tables`.

    Call it from ``downgrade()`` of your own revision; ``op`` defaults to ``alembic.op``.
    """
    ops = _operations(op)
    for table in reversed(_TABLES):
        ops.drop_table(table)


def add_run_owners(op: Operations | ModuleType | None = None) -> None:
    """Give each run record the owner whose live session vouches for it, and whether it is
    one of a batch's records (``sqlap_0002``).

    Run records written before this revision have no owner and could not be told apart from
    those of dead workers, so they are removed: at worst a crash counted earlier is forgotten.
    Stop the 0.1 workers before upgrading.
    """
    ops = _operations(op)
    ops.execute(sa.table(_JOB_RUN).delete())
    ops.add_column(_JOB_RUN, sa.Column("owner", sa.String(64), nullable=True))
    ops.add_column(_JOB_RUN, sa.Column("batched", sa.Boolean(), nullable=True))


def drop_run_owners(op: Operations | ModuleType | None = None) -> None:
    """Undo :func:`add_run_owners`."""
    ops = _operations(op)
    ops.execute(sa.table(_JOB_RUN).delete())
    ops.drop_column(_JOB_RUN, "batched")
    ops.drop_column(_JOB_RUN, "owner")


#: PostgreSQL: a statement-level trigger NOTIFYs the queues that got jobs, on the channel the
#: workers LISTEN on. The server sends one notification per transaction and queue, at the
#: commit, whoever inserted the rows, and none for a rollback.
NOTIFY_FUNCTION = "proletarian_job_notify"
_CREATE_NOTIFY = (
    f"CREATE OR REPLACE FUNCTION {NOTIFY_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
    "BEGIN\n"
    "  PERFORM pg_notify('sqla_proletarian', queue) FROM (SELECT DISTINCT queue FROM new_jobs) q;\n"
    "  RETURN NULL;\n"
    "END $$",
    f"CREATE TRIGGER {NOTIFY_FUNCTION} AFTER INSERT ON {_JOB} "
    f"REFERENCING NEW TABLE AS new_jobs FOR EACH STATEMENT EXECUTE FUNCTION {NOTIFY_FUNCTION}()",
)
_DROP_NOTIFY = (
    f"DROP TRIGGER IF EXISTS {NOTIFY_FUNCTION} ON {_JOB}",
    f"DROP FUNCTION IF EXISTS {NOTIFY_FUNCTION}()",
)


def add_enqueue_notifications(op: Operations | ModuleType | None = None) -> None:
    """PostgreSQL: the trigger that wakes listening workers when jobs are enqueued
    (``sqlap_0002``); nothing on other servers."""
    ops = _operations(op)
    if ops.get_context().dialect.name == "postgresql":
        for statement in _CREATE_NOTIFY:
            ops.execute(statement)


def drop_enqueue_notifications(op: Operations | ModuleType | None = None) -> None:
    """Undo :func:`add_enqueue_notifications`."""
    ops = _operations(op)
    if ops.get_context().dialect.name == "postgresql":
        for statement in _DROP_NOTIFY:
            ops.execute(statement)


def add_trace_context(op: Operations | ModuleType | None = None) -> None:
    """Give each queued job the trace context of the code that enqueued it (``sqlap_0003``):
    a nullable text column, so queued jobs keep running unchanged."""
    ops = _operations(op)
    ops.add_column(_JOB, sa.Column("trace_context", sa.Text(), nullable=True))


def drop_trace_context(op: Operations | ModuleType | None = None) -> None:
    """Undo :func:`add_trace_context`."""
    ops = _operations(op)
    ops.drop_column(_JOB, "trace_context")


def add_job_control(op: Operations | ModuleType | None = None) -> None:
    """Priorities, unique keys, periodic schedules and paused queues (``sqlap_0004``).

    ``proletarian_job`` gets ``run_order`` (the priority negated; queued jobs get 0) and
    ``unique_key`` (NULL), the poll index becomes ``(queue, run_order, process_at, seq)`` and
    a unique index on ``(queue, unique_key)`` is added; the archive gets ``run_order``; the
    tables
    ``proletarian_periodic`` and ``proletarian_paused_queue`` are created. Queued jobs keep
    running; stop the workers of the earlier version before upgrading (they would poll
    without priorities and pauses).
    """
    ops = _operations(op)
    dialect = ops.get_context().dialect
    for table in (_JOB, _ARCHIVED_JOB):
        ops.add_column(
            table,
            sa.Column("run_order", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        )
    ops.add_column(_JOB, sa.Column("unique_key", _name(dialect), nullable=True))
    ops.drop_index(ops.f(_POLL_INDEX), table_name=_JOB)
    # Higher priorities first, then due time, then enqueue order: all ascending.
    ops.create_index(ops.f(_POLL_INDEX), _JOB, ["queue", "run_order", "process_at", "seq"])
    ops.create_index(ops.f(_UNIQUE_KEY_INDEX), _JOB, ["queue", "unique_key"], unique=True)
    ops.create_table(
        _PERIODIC,
        sa.Column("name", _name(dialect), nullable=False),
        sa.Column("last_occurrence", _timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=ops.f("pk_proletarian_periodic")),
        **_MYSQL_TABLE_OPTIONS,
    )
    ops.create_table(
        _PAUSED_QUEUE,
        sa.Column("queue", _name(dialect), nullable=False),
        sa.Column("paused_at", _timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("queue", name=ops.f("pk_proletarian_paused_queue")),
        **_MYSQL_TABLE_OPTIONS,
    )


def drop_job_control(op: Operations | ModuleType | None = None) -> None:
    """Undo :func:`add_job_control`: queued jobs stay, without their priorities and keys;
    schedules and pauses are forgotten."""
    ops = _operations(op)
    ops.drop_table(_PAUSED_QUEUE)
    ops.drop_table(_PERIODIC)
    ops.drop_index(ops.f(_UNIQUE_KEY_INDEX), table_name=_JOB)
    ops.drop_index(ops.f(_POLL_INDEX), table_name=_JOB)
    ops.create_index(ops.f(_POLL_INDEX), _JOB, ["queue", "process_at", "seq"])
    ops.drop_column(_JOB, "unique_key")
    for table in (_ARCHIVED_JOB, _JOB):
        ops.drop_column(table, "run_order")


def add_archived_unique_key(op: Operations | ModuleType | None = None) -> None:
    """Keep each archived job's ``unique_key`` (``sqlap_0005``): a nullable column, so that
    a failure put back in the queue holds its key again. Jobs archived before have none."""
    ops = _operations(op)
    dialect = ops.get_context().dialect
    ops.add_column(_ARCHIVED_JOB, sa.Column("unique_key", _name(dialect), nullable=True))


def drop_archived_unique_key(op: Operations | ModuleType | None = None) -> None:
    """Undo :func:`add_archived_unique_key`: archived jobs stay, without their keys."""
    ops = _operations(op)
    ops.drop_column(_ARCHIVED_JOB, "unique_key")


#: The lease columns of ``sqlap_0006``, in the order they are added.
_LEASE_COLUMNS = (
    "lease_token",
    "lease_owner",
    "heartbeat_at",
    "due_at",
    "unclean_ends",
    "cancel_requested_at",
)


def add_leases(op: Operations | ModuleType | None = None) -> None:
    """Let jobs run under a lease (``sqlap_0006``): nullable lease columns on the job table,
    and ``unclean_ends`` (0 for the jobs already queued). No index: while leased, a job's
    ``process_at`` is its lease's expiry, so the poll index serves the lease poll too."""
    ops = _operations(op)
    dialect = ops.get_context().dialect
    ops.add_column(_JOB, sa.Column("lease_token", sa.Uuid(), nullable=True))
    ops.add_column(_JOB, sa.Column("lease_owner", _name(dialect), nullable=True))
    ops.add_column(_JOB, sa.Column("heartbeat_at", _timestamp(), nullable=True))
    ops.add_column(_JOB, sa.Column("due_at", _timestamp(), nullable=True))
    ops.add_column(
        _JOB,
        sa.Column("unclean_ends", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
    )
    ops.add_column(_JOB, sa.Column("cancel_requested_at", _timestamp(), nullable=True))


def drop_leases(op: Operations | ModuleType | None = None) -> None:
    """Undo :func:`add_leases`: queued jobs stay; a job leased at the time is due again at
    its own time, with its lease forgotten."""
    ops = _operations(op)
    job = sa.table(_JOB, sa.column("process_at"), sa.column("due_at"))
    ops.execute(job.update().where(job.c.due_at.is_not(None)).values(process_at=job.c.due_at))
    for name in reversed(_LEASE_COLUMNS):
        ops.drop_column(_JOB, name)


def add_uncharged_runs(op: Operations | ModuleType | None = None) -> None:
    """Count a leased job's runs that ended with no outcome and no charge (``sqlap_0007``):
    ``uncharged_runs`` on the job table (0 for the jobs already queued). A run whose
    connection was lost, or that a stop gave up, is counted in ``attempts`` and here, so
    that it takes neither a retry nor an unclean end."""
    ops = _operations(op)
    ops.add_column(
        _JOB,
        sa.Column("uncharged_runs", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
    )


def drop_uncharged_runs(op: Operations | ModuleType | None = None) -> None:
    """Undo :func:`add_uncharged_runs`: queued jobs stay, each ``attempts`` as it is."""
    ops = _operations(op)
    ops.drop_column(_JOB, "uncharged_runs")


def add_job_history(op: Operations | ModuleType | None = None) -> None:
    """Keep the earlier ends of jobs put back in the queue (``sqlap_0008``): a table of
    their archive rows' outcomes, by job id. Nothing else changes; it starts empty."""
    ops = _operations(op)
    ops.create_table(
        _JOB_HISTORY,
        sa.Column("seq", _sequence(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("finished_at", _timestamp(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("seq", name=ops.f("pk_proletarian_job_history")),
        **_MYSQL_TABLE_OPTIONS,
    )
    ops.create_index(ops.f("ix_proletarian_job_history_job_id"), _JOB_HISTORY, ["job_id"])


def drop_job_history(op: Operations | ModuleType | None = None) -> None:
    """Undo :func:`add_job_history`: the earlier ends it kept are gone."""
    ops = _operations(op)
    ops.drop_table(_JOB_HISTORY)


def add_flow_control(op: Operations | ModuleType | None = None) -> None:
    """Flow control and snoozes (``sqlap_0009``): ``concurrency_key`` and ``snoozes`` on the
    job and archive tables (NULL and 0 for the rows there), and three tables, empty at first:
    ``proletarian_queue_limit`` (a queue's limits), ``proletarian_slot`` (the places a
    limited queue's jobs run in) and ``proletarian_start`` (the starts a rate limit counts)."""
    ops = _operations(op)
    dialect = ops.get_context().dialect
    for table in (_JOB, _ARCHIVED_JOB):
        ops.add_column(table, sa.Column("concurrency_key", _name(dialect), nullable=True))
        ops.add_column(
            table,
            sa.Column("snoozes", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        )
    ops.create_table(
        _QUEUE_LIMIT,
        sa.Column("queue", _name(dialect), nullable=False),
        sa.Column("max_running", sa.Integer(), nullable=True),
        sa.Column("max_running_per_key", sa.Integer(), nullable=True),
        sa.Column("rate_count", sa.Integer(), nullable=True),
        sa.Column("rate_seconds", sa.Float(), nullable=True),
        sa.Column("key_rate_count", sa.Integer(), nullable=True),
        sa.Column("key_rate_seconds", sa.Float(), nullable=True),
        sa.Column("updated_at", _timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("queue", name=ops.f("pk_proletarian_queue_limit")),
        **_MYSQL_TABLE_OPTIONS,
    )
    ops.create_table(
        _SLOT,
        sa.Column("queue", _name(dialect), nullable=False),
        sa.Column("slot_key", _name(dialect), nullable=False),
        sa.Column("n", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=True),
        sa.Column("token", sa.Uuid(), nullable=True),
        sa.PrimaryKeyConstraint("queue", "slot_key", "n", name=ops.f("pk_proletarian_slot")),
        **_MYSQL_TABLE_OPTIONS,
    )
    ops.create_table(
        _START,
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("queue", _name(dialect), nullable=False),
        sa.Column("slot_key", _name(dialect), nullable=False),
        sa.Column("started_at", _timestamp(), nullable=False),
        sa.Column("starts", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=ops.f("pk_proletarian_start")),
        **_MYSQL_TABLE_OPTIONS,
    )
    ops.create_index(
        ops.f("ix_proletarian_start_window"), _START, ["queue", "slot_key", "started_at"]
    )


def drop_flow_control(op: Operations | ModuleType | None = None) -> None:
    """Undo :func:`add_flow_control`: queues lose their limits, jobs their concurrency keys
    and snooze counts; queued jobs stay."""
    ops = _operations(op)
    for table in (_START, _SLOT, _QUEUE_LIMIT):
        ops.drop_table(table)
    for table in (_ARCHIVED_JOB, _JOB):
        ops.drop_column(table, "snoozes")
        ops.drop_column(table, "concurrency_key")


def add_workflows(op: Operations | ModuleType | None = None) -> None:
    """Workflows, results and progress (``sqlap_0010``): ``waiting_on`` on the job table (0
    for the rows there: none waits), ``result`` on the archive (NULL), and two tables, empty
    at first: ``proletarian_dependency`` (a job's dependencies, and the waits for a job's
    end) and ``proletarian_progress`` (what a running handler reported)."""
    ops = _operations(op)
    ops.add_column(
        _JOB, sa.Column("waiting_on", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    ops.add_column(_ARCHIVED_JOB, sa.Column("result", _payload(), nullable=True))
    ops.create_table(
        _DEPENDENCY,
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("depends_on", sa.Uuid(), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("pending", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "depends_on", name=ops.f("pk_proletarian_dependency")),
        **_MYSQL_TABLE_OPTIONS,
    )
    ops.create_index(ops.f("ix_proletarian_dependency_depends_on"), _DEPENDENCY, ["depends_on"])
    ops.create_index(
        ops.f("ix_proletarian_dependency_pending"), _DEPENDENCY, ["pending", "depends_on"]
    )
    ops.create_table(
        _PROGRESS,
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("progress", sa.Float(), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("updated_at", _timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name=ops.f("pk_proletarian_progress")),
        **_MYSQL_TABLE_OPTIONS,
    )


def drop_workflows(op: Operations | ModuleType | None = None) -> None:
    """Undo :func:`add_workflows`: dependencies, results and progress are gone; a job that
    waited on others is due at its own time."""
    ops = _operations(op)
    job = sa.table(
        _JOB,
        sa.column("process_at"),
        sa.column("due_at"),
        sa.column("waiting_on"),
        sa.column("lease_token"),
    )
    ops.execute(
        job.update()
        .where(job.c.waiting_on > 0, job.c.lease_token.is_(None), job.c.due_at.is_not(None))
        .values(process_at=job.c.due_at, due_at=None)
    )
    for table in (_PROGRESS, _DEPENDENCY):
        ops.drop_table(table)
    ops.drop_column(_ARCHIVED_JOB, "result")
    ops.drop_column(_JOB, "waiting_on")


def _is_mysql(dialect: sa.Dialect) -> bool:
    return dialect.name in ("mysql", "mariadb")


def add_unique_slot(op: Operations | ModuleType | None = None) -> None:
    """MySQL and MariaDB: hold unique keys in a unique index on one generated column
    (``sqlap_0011``); nothing on PostgreSQL and SQLite.

    The job table gets ``unique_slot``, a VIRTUAL column (NULL for a job without a
    ``unique_key``, its queue and key for a job with one) with the unique index
    ``ix_proletarian_job_unique_slot``; the index on ``(queue, unique_key)`` stays, no longer
    unique. On a Galera cluster that index made any two jobs of one queue, written from two
    nodes at once, conflict at commit. One ALTER TABLE; queued jobs keep their keys.
    """
    ops = _operations(op)
    dialect = ops.get_context().dialect
    if not _is_mysql(dialect):
        return
    ops.execute(
        f"ALTER TABLE {_JOB} "
        f"DROP INDEX {_UNIQUE_KEY_INDEX}, "
        "ADD COLUMN unique_slot VARCHAR(515) CHARACTER SET utf8mb4 "
        f"COLLATE {_exact_collation(dialect)} "
        "AS (IF(unique_key IS NULL, NULL, "
        "CONCAT(CHAR_LENGTH(queue), ':', queue, ':', unique_key))) VIRTUAL, "
        f"ADD UNIQUE INDEX {_UNIQUE_SLOT_INDEX} (unique_slot), "
        f"ADD INDEX {_UNIQUE_KEY_INDEX} (queue, unique_key)"
    )


def drop_unique_slot(op: Operations | ModuleType | None = None) -> None:
    """Undo :func:`add_unique_slot`: the index on ``(queue, unique_key)`` is unique again."""
    ops = _operations(op)
    if not _is_mysql(ops.get_context().dialect):
        return
    ops.execute(
        f"ALTER TABLE {_JOB} "
        f"DROP INDEX {_UNIQUE_SLOT_INDEX}, "
        "DROP COLUMN unique_slot, "
        f"DROP INDEX {_UNIQUE_KEY_INDEX}, "
        f"ADD UNIQUE INDEX {_UNIQUE_KEY_INDEX} (queue, unique_key)"
    )
