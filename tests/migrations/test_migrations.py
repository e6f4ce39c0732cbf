"""The Alembic migrations build exactly the models' schema, on every backend.

Three ways in are checked: the library's own environment (``alembic.ini`` at the top of the
repository), a user's project that adds the library's version location and runs
``upgrade heads``, and a user's single-head revision that calls ``create_tables()``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import uuid
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import coerce_resource_to_filename
from sqlalchemy.orm import Session
from sqlalchemy.schema import SchemaItem

import sqla_proletarian as sp
import sqla_proletarian.migrations as spm
from sqla_proletarian.models import (
    LIBRARY_TABLES,
    UNIQUE_KEY_INDEX,
    UNIQUE_SLOT_INDEX,
    compared_on,
)

if TYPE_CHECKING:
    from conftest import Database

REPO = Path(__file__).resolve().parents[2]
ALEMBIC_INI = REPO / "alembic.ini"


def library_config() -> Config:
    """The repository's own Alembic environment, run in-process without touching logging."""
    config = Config(str(ALEMBIC_INI))
    config.attributes["configure_logger"] = False
    return config


def run(config: Config, engine: sa.Engine, action: Any, target: str) -> None:
    """Run an Alembic command on ``engine`` through the shared-connection recipe."""
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        action(config, target)


def only_library_tables(
    obj: SchemaItem, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    return not sp.include_object(obj, name, type_, reflected, compare_to)


def differences(engine: sa.Engine, metadata: sa.MetaData, include_object: Any = None) -> list[Any]:
    """What autogenerate would change to make the database match ``metadata``, leaving out
    what the server's schema holds beyond any MetaData (MySQL's unique slot, which
    ``test_migrated_tables_are_identical_to_what_create_all_makes`` compares)."""
    on_server = compared_on(engine.dialect)

    def included(
        obj: SchemaItem, name: str | None, type_: str, reflected: bool, compare_to: Any
    ) -> bool:
        return on_server(obj, name, type_, reflected, compare_to) and (
            include_object is None or include_object(obj, name, type_, reflected, compare_to)
        )

    options: dict[str, Any] = {
        "compare_type": True,
        "compare_server_default": True,
        "include_object": included,
    }
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts=options)
        return list(compare_metadata(context, metadata))


def library_schema(engine: sa.Engine) -> dict[str, dict[str, Any]]:
    """Everything the database reports about the library's tables, in comparable form.

    Autogenerate overlooks collations, DATETIME precision and table options on MySQL;
    reflection does not.
    """
    inspector = sa.inspect(engine)
    schema: dict[str, dict[str, Any]] = {}
    for table in sorted(LIBRARY_TABLES):
        if not inspector.has_table(table):
            continue
        columns = [
            {**column, "type": str(column["type"].compile(dialect=engine.dialect))}
            for column in inspector.get_columns(table)
        ]
        schema[table] = {
            "columns": columns,
            "primary_key": inspector.get_pk_constraint(table),
            "unique": sorted(inspector.get_unique_constraints(table), key=lambda c: str(c["name"])),
            "indexes": sorted(inspector.get_indexes(table), key=lambda i: str(i["name"])),
            # Table options exist on MySQL only (SQLAlchemy 2.0 raises elsewhere).
            "options": (
                inspector.get_table_options(table)
                if engine.dialect.name in ("mysql", "mariadb")
                else {}
            ),
        }
    return schema


def versions_in_database(engine: sa.Engine) -> set[str]:
    with engine.connect() as connection:
        return set(connection.scalars(sa.text("SELECT version_num FROM alembic_version")))


# --- the library's own environment ------------------------------------------------------------


def test_the_library_revisions_are_one_branch_labelled_sqla_proletarian() -> None:
    """A linear history from sqlap_0001, labelled ``sqla_proletarian``, in VERSION_LOCATION."""
    script = ScriptDirectory.from_config(library_config())
    assert len(script.get_heads()) == 1
    assert script.get_bases() == [spm.INITIAL_REVISION]
    initial = script.get_revision(spm.INITIAL_REVISION)
    assert initial is not None
    assert initial.down_revision is None
    assert initial.branch_labels == {spm.BRANCH_LABEL}
    assert initial.dependencies is None
    for revision in script.walk_revisions():
        assert Path(str(revision.path)).parent == Path(spm.VERSION_LOCATION)
    resource = coerce_resource_to_filename("sqla_proletarian.migrations:versions")
    assert resource.resolve() == Path(spm.VERSION_LOCATION)
    assert spm.include_object is sp.include_object


def test_the_library_revisions_do_not_import_the_live_models() -> None:
    """Revisions import only alembic, sqlalchemy and the frozen DDL helpers."""
    allowed = {"__future__", "collections.abc", "typing", "sqla_proletarian.migrations"}
    files = sorted(Path(spm.VERSION_LOCATION).glob("*.py"))
    assert files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                assert module in allowed or module.split(".")[0] in {"alembic", "sqlalchemy"}, (
                    f"{path.name} imports {module}"
                )


def test_upgrade_heads_matches_metadata_and_survives_downgrade_and_upgrade_again(
    empty_database: Database,
) -> None:
    """Upgrade an empty database: no autogenerate difference; downgrade base removes it all."""
    engine = empty_database.engine()
    config = library_config()

    run(config, engine, command.upgrade, "heads")
    assert versions_in_database(engine) == {spm.HEAD_REVISION}
    assert set(library_schema(engine)) == LIBRARY_TABLES
    assert differences(engine, sp.metadata) == []

    run(config, engine, command.downgrade, "base")
    assert library_schema(engine) == {}
    assert versions_in_database(engine) == set()

    run(config, engine, command.upgrade, "heads")
    assert differences(engine, sp.metadata) == []


def test_migrated_tables_are_identical_to_what_create_all_makes(empty_database: Database) -> None:
    """Same columns, types, collations, keys, indexes and table options as the models."""
    engine = empty_database.engine()
    config = library_config()
    run(config, engine, command.upgrade, "heads")
    migrated = library_schema(engine)
    run(config, engine, command.downgrade, "base")
    sp.metadata.create_all(engine)
    assert migrated == library_schema(engine)


EXPECTED_JOB_COLUMN_TYPES = {
    "sqlite": {
        "seq": "INTEGER",
        "queue": "VARCHAR(255)",
        "payload": "TEXT",
        "process_at": "DATETIME",
    },
    "postgresql": {
        "seq": "BIGINT",
        "job_id": "UUID",
        "queue": "VARCHAR(255)",
        "payload": "TEXT",
        "process_at": "TIMESTAMP WITH TIME ZONE",
    },
    "mariadb": {
        "seq": "BIGINT",
        "queue": "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin",
        "job_type": "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin",
        "payload": "LONGTEXT",
        "process_at": "DATETIME(6)",
    },
}


def test_migrated_job_table_has_the_documented_column_types(empty_database: Database) -> None:
    """BIGINT/INTEGER seq, binary-collated names and LONGTEXT on MySQL, microsecond instants."""
    engine = empty_database.engine()
    run(library_config(), engine, command.upgrade, "heads")
    job = library_schema(engine)["proletarian_job"]
    types = {
        column["name"]: re.sub(r"^(BIGINT|INTEGER)\(\d+\)", r"\1", column["type"])
        for column in job["columns"]
    }
    expected = EXPECTED_JOB_COLUMN_TYPES[empty_database.backend]
    assert {name: types[name] for name in expected} == expected
    assert job["primary_key"]["constrained_columns"] == ["seq"]
    if empty_database.backend != "sqlite":
        seq = next(column for column in job["columns"] if column["name"] == "seq")
        assert seq["autoincrement"] is True
    if empty_database.backend == "mariadb":
        assert job["options"]["mysql_engine"] == "InnoDB"
        assert job["options"]["mysql_default charset"] == "utf8mb4"


def test_the_alembic_command_line_installs_and_removes_the_tables(tmp_path: Path) -> None:
    """``alembic -c alembic.ini upgrade heads`` with SP_DATABASE_URL; downgrade with -x url.

    The URL handling is the same for every dialect, so one (SQLite) keeps the subprocesses few.
    """
    url = f"sqlite:///{tmp_path / 'installed.db'}"
    alembic = [sys.executable, "-m", "alembic", "-c", str(ALEMBIC_INI)]
    environment = {**os.environ, "SP_DATABASE_URL": url}
    subprocess.run(
        [*alembic, "upgrade", "heads"], env=environment, cwd=tmp_path, check=True, timeout=60
    )
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        assert set(library_schema(engine)) == LIBRARY_TABLES
        subprocess.run(
            [*alembic, "-x", f"url={url}", "downgrade", "base"],
            cwd=tmp_path,
            check=True,
            timeout=60,
        )
        assert library_schema(engine) == {}
    finally:
        engine.dispose()


# --- a user's project ------------------------------------------------------------------------

# A user's naming convention that renames every constraint and index it may: the library's
# names must come out unchanged all the same.
USER_NAMING_CONVENTION = {
    "ix": "user_ix_%(constraint_name)s",
    "uq": "user_uq_%(constraint_name)s",
    "pk": "user_pk_%(table_name)s",
}

USER_ENV = """
from alembic import context

config = context.config
context.configure(
    connection=config.attributes["connection"],
    target_metadata=config.attributes["target_metadata"],
    include_object=config.attributes["include_object"],
)
with context.begin_transaction():
    context.run_migrations()
"""

USER_REVISION = '''
"""The user's own table{extra_doc}."""

import sqlalchemy as sa
from alembic import op

from sqla_proletarian.migrations import (
    add_archived_unique_key,
    add_enqueue_notifications,
    add_flow_control,
    add_job_control,
    add_job_history,
    add_leases,
    add_run_owners,
    add_trace_context,
    add_uncharged_runs,
    add_unique_slot,
    add_workflows,
    create_tables,
    drop_archived_unique_key,
    drop_enqueue_notifications,
    drop_flow_control,
    drop_job_control,
    drop_job_history,
    drop_leases,
    drop_run_owners,
    drop_tables,
    drop_trace_context,
    drop_uncharged_runs,
    drop_unique_slot,
    drop_workflows,
)

revision = "user_0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        "account",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("email", sa.String(200), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("user_pk_account")),
    )
    {upgrade_extra}


def downgrade():
    {downgrade_extra}
    op.drop_table("account")
'''


def user_metadata() -> sa.MetaData:
    """The user's own models: one table that has nothing to do with the library."""
    metadata = sa.MetaData(naming_convention=USER_NAMING_CONVENTION)
    sa.Table(
        "account",
        metadata,
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("email", sa.String(200), nullable=False),
    )
    return metadata


def user_project(root: Path, *, calls_helpers: bool, library_location: bool) -> Config:
    """Write a user's Alembic project under ``root`` and return its config.

    ``library_location`` adds the library's versions to ``version_locations`` exactly as
    docs/howto/alembic.md says; ``calls_helpers`` makes the user's revision call
    create_tables/drop_tables.
    """
    (root / "migrations" / "versions").mkdir(parents=True)
    (root / "migrations" / "env.py").write_text(USER_ENV)
    revision = USER_REVISION.format(
        extra_doc=" and the library's tables" if calls_helpers else "",
        upgrade_extra=(
            "create_tables(op); add_run_owners(op); add_enqueue_notifications(op); "
            "add_trace_context(op); add_job_control(op); add_archived_unique_key(op); "
            "add_leases(op); add_uncharged_runs(op); add_job_history(op); add_flow_control(op); "
            "add_workflows(op); add_unique_slot(op)"
            if calls_helpers
            else "pass"
        ),
        downgrade_extra=(
            "drop_unique_slot(op); drop_workflows(op); drop_flow_control(op); "
            "drop_job_history(op); "
            "drop_uncharged_runs(op); "
            "drop_leases(op); "
            "drop_archived_unique_key(op); "
            "drop_job_control(op); "
            "drop_trace_context(op); "
            "drop_enqueue_notifications(op); "
            "drop_run_owners(op); drop_tables(op)"
            if calls_helpers
            else "pass"
        ),
    )
    (root / "migrations" / "versions" / "user_0001.py").write_text(revision)
    locations = "%(here)s/migrations/versions"
    if library_location:
        locations += "\n    sqla_proletarian.migrations:versions"
    ini = textwrap.dedent(
        """\
        [alembic]
        script_location = %(here)s/migrations
        path_separator = newline
        version_locations =
            {locations}
        """
    ).format(locations=locations)
    (root / "alembic.ini").write_text(ini)
    config = Config(str(root / "alembic.ini"))
    config.attributes["target_metadata"] = user_metadata()
    config.attributes["include_object"] = sp.include_object
    return config


def test_a_users_project_with_the_library_version_location_upgrades_heads(
    empty_database: Database, tmp_path: Path
) -> None:
    """Both histories install side by side; the library's branch comes off on its own."""
    engine = empty_database.engine()
    config = user_project(tmp_path, calls_helpers=False, library_location=True)
    heads = set(ScriptDirectory.from_config(config).get_heads())
    assert heads == {"user_0001", spm.HEAD_REVISION}

    run(config, engine, command.upgrade, "heads")
    assert versions_in_database(engine) == heads
    assert differences(engine, sp.metadata, only_library_tables) == []
    assert differences(engine, user_metadata(), sp.include_object) == []

    run(config, engine, command.downgrade, f"{spm.BRANCH_LABEL}@base")
    assert versions_in_database(engine) == {"user_0001"}
    assert library_schema(engine) == {}
    assert sa.inspect(engine).has_table("account")


def test_a_users_single_head_revision_calling_create_tables_builds_the_same_schema(
    empty_database: Database, tmp_path: Path
) -> None:
    """create_tables()/drop_tables() in the user's revision equal the library's revision."""
    engine = empty_database.engine()
    config = user_project(tmp_path, calls_helpers=True, library_location=False)
    assert ScriptDirectory.from_config(config).get_heads() == ["user_0001"]

    run(config, engine, command.upgrade, "head")
    from_helper = library_schema(engine)
    assert set(from_helper) == LIBRARY_TABLES
    assert differences(engine, sp.metadata, only_library_tables) == []

    run(config, engine, command.downgrade, "base")
    assert library_schema(engine) == {}
    assert not sa.inspect(engine).has_table("account")

    run(library_config(), engine, command.upgrade, "heads")
    assert from_helper == library_schema(engine)


def test_include_object_keeps_a_users_autogenerate_off_the_library_tables(
    empty_database: Database,
) -> None:
    """Without the filter autogenerate would drop the library's tables; with it, no change."""
    engine = empty_database.engine()
    run(library_config(), engine, command.upgrade, "heads")
    user_metadata().create_all(engine)

    unfiltered = differences(engine, user_metadata())
    assert {diff[1].name for diff in unfiltered if diff[0] == "remove_table"} == LIBRARY_TABLES

    assert differences(engine, user_metadata(), sp.include_object) == []


def test_upgrading_from_the_first_revision_keeps_queued_jobs_and_drops_ownerless_run_records(
    empty_database: Database,
) -> None:
    """sqlap_0001 -> sqlap_0002 on a database with a queued job and a 0.1 run record: the
    job stays, the record (which could not tell a live worker from a dead one) goes, and the
    job then runs with no unclean end counted."""
    engine = empty_database.engine()
    config = library_config()
    run(config, engine, command.upgrade, spm.INITIAL_REVISION)
    job_id = uuid.uuid4()
    now = sp.utc_now()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(sp.Job.__table__).values(
                job_id=job_id,
                queue="default",
                job_type="kept",
                payload="{}",
                attempts=0,
                enqueued_at=now,
                process_at=now,
            )
        )
        # A 0.1 run record: the table has no owner column yet.
        old_record = sa.table(
            "proletarian_job_run",
            sa.column("run_id", sa.Uuid()),
            sa.column("job_id", sa.Uuid()),
            sa.column("worker_id", sa.String()),
            sa.column("started_at", sp.Job.__table__.c.enqueued_at.type),
        )
        conn.execute(
            sa.insert(old_record).values(
                run_id=uuid.uuid4(), job_id=job_id, worker_id="w", started_at=now
            )
        )
    run(config, engine, command.upgrade, "heads")
    assert versions_in_database(engine) == {spm.HEAD_REVISION}
    assert differences(engine, sp.metadata) == []
    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(sp.JobRun)) == 0
        assert conn.scalar(sa.select(sa.func.count()).select_from(sp.Job)) == 1
    assert sp.process_next_job(engine, lambda job_type, payload: None, max_unclean_ends=1)
    with Session(engine) as session:
        archived = session.get(sp.ArchivedJob, job_id)
        assert archived is not None and (archived.status, archived.attempts) == ("success", 1)


def test_upgrading_a_database_with_queued_jobs_to_the_last_revision_and_back_keeps_them(
    empty_database: Database,
) -> None:
    """sqlap_0001 -> head with jobs queued and archived: they stay, with priority 0
    and no unique key, and still run in due order; keyed and prioritised jobs can be added.
    Back to sqlap_0001 the queued jobs stay again (their priorities and keys are dropped)."""
    engine = empty_database.engine()
    config = library_config()
    run(config, engine, command.upgrade, spm.INITIAL_REVISION)
    now = sp.utc_now()
    # The first revision's job table, as 0.1 wrote it.
    old_job = sa.table(
        "proletarian_job",
        *(sa.column(name, sp.Job.__table__.c[name].type) for name in OLD_JOB_COLUMNS),
    )
    old_ids = [uuid.uuid4() for _ in range(3)]
    with engine.begin() as conn:
        conn.execute(
            sa.insert(old_job),
            [
                {
                    "job_id": job_id,
                    "queue": "default",
                    "job_type": f"kept-{n}",
                    "payload": "{}",
                    "attempts": 0,
                    "enqueued_at": now,
                    "process_at": now,
                }
                for n, job_id in enumerate(old_ids)
            ],
        )
    run(config, engine, command.upgrade, spm.HEAD_REVISION)
    assert versions_in_database(engine) == {spm.HEAD_REVISION}
    assert differences(engine, sp.metadata) == []
    with Session(engine) as session:
        kept = session.scalars(sa.select(sp.Job).order_by(sp.Job.__table__.c.seq)).all()
        assert [(job.job_id, job.priority, job.unique_key) for job in kept] == [
            (job_id, 0, None) for job_id in old_ids
        ]
        urgent = sp.enqueue(session, "urgent", priority=5, unique_key="once")
        assert sp.enqueue(session, "urgent", priority=5, unique_key="once") == urgent
        session.commit()
    ran: list[str] = []
    while sp.process_next_job(engine, lambda job_type, payload: ran.append(job_type)):
        pass
    assert ran == ["urgent", "kept-0", "kept-1", "kept-2"]
    with Session(engine) as session:
        assert session.get(sp.ArchivedJob, urgent).priority == 5  # type: ignore[union-attr]
        sp.enqueue(session, "queued-at-downgrade", priority=3, unique_key="k")
        session.commit()

    run(config, engine, command.downgrade, spm.INITIAL_REVISION)
    assert versions_in_database(engine) == {spm.INITIAL_REVISION}
    with engine.connect() as conn:
        rows = conn.execute(sa.select(old_job.c.job_type)).scalars().all()
        assert rows == ["queued-at-downgrade"]
        columns = {column["name"] for column in sa.inspect(conn).get_columns("proletarian_job")}
        assert columns == set(OLD_JOB_COLUMNS) | {"seq"}
        assert not sa.inspect(conn).has_table("proletarian_periodic")


def installed_job_table(engine: sa.Engine) -> tuple[sa.TableClause, set[str]]:
    """The job table as the database has it now (an older revision's), to write rows as that
    revision's enqueue did (``seq`` aside: the database numbers it), and its columns."""
    job = sp.Job.__table__
    with engine.connect() as conn:
        columns = {column["name"] for column in sa.inspect(conn).get_columns(job.name)}
    names = sorted(columns - {"seq"})
    return sa.table(job.name, *(sa.column(name, job.c[name].type) for name in names)), columns


def test_upgrading_to_the_archived_unique_key_keeps_queued_and_archived_jobs(
    empty_database: Database,
) -> None:
    """sqlap_0004 -> sqlap_0005 with a keyed job queued and a failure archived: both stay
    (the old failure without a key, and it can be put back); the keyed job's outcome keeps
    its key. Back to sqlap_0004 both archive rows stay, without the column."""
    engine = empty_database.engine()
    config = library_config()
    run(config, engine, command.upgrade, "sqlap_0004")
    now = sp.utc_now()
    old_archive = sa.table(
        "proletarian_archived_job",
        *(sa.column(name, sp.ArchivedJob.__table__.c[name].type) for name in OLD_ARCHIVE_COLUMNS),
    )
    old_job, _ = installed_job_table(engine)
    failed_id = uuid.uuid4()
    keyed = uuid.uuid4()
    with Session(engine) as session:
        # The job as sqlap_0004's enqueue wrote it (today's enqueue writes later columns).
        session.execute(
            sa.insert(old_job).values(
                job_id=keyed,
                queue="default",
                job_type="keyed",
                payload="null",
                attempts=0,
                enqueued_at=now,
                process_at=now,
                run_order=0,
                unique_key="k",
            )
        )
        session.execute(
            sa.insert(old_archive).values(
                job_id=failed_id,
                queue="default",
                job_type="old-failure",
                payload="{}",
                attempts=1,
                enqueued_at=now,
                process_at=now,
                status="failure",
                finished_at=now,
                error="boom",
                run_order=0,
            )
        )
        session.commit()
    run(config, engine, command.upgrade, "heads")
    assert versions_in_database(engine) == {spm.HEAD_REVISION}
    assert differences(engine, sp.metadata) == []
    with Session(engine) as session:
        old = session.get(sp.ArchivedJob, failed_id)
        assert old is not None and (old.status, old.unique_key) == ("failure", None)
    assert sp.process_next_job(engine, lambda job_type, payload: None)
    with Session(engine) as session:
        done = session.get(sp.ArchivedJob, keyed)
        assert done is not None and (done.status, done.unique_key) == ("success", "k")
    assert sp.retry_failed(engine, [failed_id]) == 1
    assert sp.process_next_job(engine, lambda job_type, payload: None)

    run(config, engine, command.downgrade, "sqlap_0004")
    assert versions_in_database(engine) == {"sqlap_0004"}
    with engine.connect() as conn:
        rows = conn.execute(sa.select(old_archive.c.job_id, old_archive.c.status)).all()
        assert set(rows) == {(keyed, "success"), (failed_id, "success")}
        columns = {c["name"] for c in sa.inspect(conn).get_columns("proletarian_archived_job")}
        assert columns == set(OLD_ARCHIVE_COLUMNS)


def test_upgrading_to_leases_keeps_queued_jobs_and_downgrading_puts_leased_ones_back_when_due(
    empty_database: Database,
) -> None:
    """sqlap_0005 -> sqlap_0006 with jobs queued, one scheduled: they stay, with no lease and
    no unclean end, and run (the scheduled one once due). Back to sqlap_0005 a job leased at
    the time is due again at its own time (``process_at`` from ``due_at``), and the lease
    columns are gone."""
    engine = empty_database.engine()
    config = library_config()
    run(config, engine, command.upgrade, "sqlap_0005")
    now = sp.utc_now()
    job = sp.Job.__table__
    old_job, columns_0005 = installed_job_table(engine)
    queued = {
        f"kept-{n}": (uuid.uuid4(), now + timedelta(seconds=-1 if n < 2 else 3600))
        for n in range(3)
    }
    with engine.begin() as conn:
        conn.execute(
            sa.insert(old_job),
            [
                {
                    "job_id": job_id,
                    "queue": "default",
                    "job_type": job_type,
                    "payload": "{}",
                    "attempts": 0,
                    "enqueued_at": now,
                    "process_at": due,
                    "run_order": 0,
                }
                for job_type, (job_id, due) in queued.items()
            ],
        )

    run(config, engine, command.upgrade, "sqlap_0006")
    assert versions_in_database(engine) == {"sqlap_0006"}
    with engine.connect() as conn:
        kept = conn.execute(
            sa.select(job.c.job_id, job.c.lease_token, job.c.due_at, job.c.unclean_ends)
        ).all()
    assert sorted(kept) == sorted((job_id, None, None, 0) for job_id, _ in queued.values())
    # sqlap_0007 (the runs given back uncharged) too: 0 for each job; then the later
    # revisions, as the worker needs.
    run(config, engine, command.upgrade, "sqlap_0007")
    with engine.connect() as conn:
        uncharged = conn.execute(sa.select(job.c.uncharged_runs)).scalars().all()
    assert uncharged == [0, 0, 0]
    run(config, engine, command.upgrade, "heads")
    ran: list[str] = []
    while sp.process_next_job(engine, lambda job_type, payload: ran.append(job_type)):
        pass
    assert ran == ["kept-0", "kept-1"]
    later = now + timedelta(hours=2)
    assert sp.process_next_job(engine, lambda t, p: ran.append(t), clock=lambda: later)
    assert ran == ["kept-0", "kept-1", "kept-2"]

    due = now - timedelta(seconds=5)
    with engine.begin() as conn:
        leased = sp.enqueue(conn, "leased-at-downgrade", clock=lambda: due)
        conn.execute(
            sa.update(job)
            .where(job.c.job_id == leased)
            .values(
                lease_token=uuid.uuid4(),
                lease_owner="w@host:1/MainThread",
                heartbeat_at=now,
                due_at=due,
                process_at=now + timedelta(seconds=60),
                attempts=1,
            )
        )
    run(config, engine, command.downgrade, "sqlap_0005")
    assert versions_in_database(engine) == {"sqlap_0005"}
    with engine.connect() as conn:
        assert conn.execute(sa.select(old_job.c.job_id, old_job.c.process_at)).all() == [
            (leased, due)
        ]
        columns = {column["name"] for column in sa.inspect(conn).get_columns("proletarian_job")}
        assert columns == columns_0005


def unique_indexes(engine: sa.Engine) -> dict[str, bool]:
    """The job table's indexes on unique keys: whether each is unique."""
    indexes = sa.inspect(engine).get_indexes("proletarian_job")
    return {
        str(index["name"]): bool(index["unique"])
        for index in indexes
        if index["name"] in (UNIQUE_KEY_INDEX, UNIQUE_SLOT_INDEX)
    }


def test_upgrading_to_the_unique_slot_keeps_keyed_jobs_holding_their_keys(
    empty_database: Database,
) -> None:
    """sqlap_0010 -> sqlap_0011 with a keyed and an unkeyed job queued: both stay, and the key
    is still held (an enqueue with it returns the queued job's id; a failure put back with it
    stays archived). On MySQL and MariaDB the slot's index holds the keys and the index on
    (queue, unique_key) is no longer unique; elsewhere nothing changes. Back to sqlap_0010
    that index is unique again and the jobs stay."""
    engine = empty_database.engine()
    config = library_config()
    run(config, engine, command.upgrade, "sqlap_0010")
    mysql = engine.dialect.name in ("mysql", "mariadb")
    assert unique_indexes(engine) == {UNIQUE_KEY_INDEX: True}
    with engine.begin() as conn:
        keyed = sp.enqueue(conn, "keyed", queue="q", unique_key="k")
        unkeyed = sp.enqueue(conn, "unkeyed", queue="q")

    run(config, engine, command.upgrade, "sqlap_0011")
    assert versions_in_database(engine) == {"sqlap_0011"}
    assert differences(engine, sp.metadata) == []
    expected = {UNIQUE_KEY_INDEX: False, UNIQUE_SLOT_INDEX: True} if mysql else None
    assert unique_indexes(engine) == (expected or {UNIQUE_KEY_INDEX: True})
    with engine.begin() as conn:
        assert sp.enqueue(conn, "again", queue="q", unique_key="k") == keyed
        other_queue = sp.enqueue(conn, "other", queue="q2", unique_key="k")
    # A failure archived with the key while the keyed job is queued: putting it back meets
    # the key (the duplicate-key error names the slot's index on MySQL) and leaves it archived.
    failed = uuid.uuid4()
    now = sp.utc_now()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(sp.ArchivedJob.__table__).values(
                job_id=failed,
                queue="q",
                job_type="failed",
                payload="null",
                attempts=1,
                enqueued_at=now,
                process_at=now,
                status="failure",
                finished_at=now,
                run_order=0,
                snoozes=0,
                unique_key="k",
            )
        )
    assert sp.retry_failed(engine, [failed]) == 0

    run(config, engine, command.downgrade, "sqlap_0010")
    assert unique_indexes(engine) == {UNIQUE_KEY_INDEX: True}
    with engine.connect() as conn:
        ids = set(conn.execute(sa.select(sp.Job.__table__.c.job_id)).scalars())
    assert ids == {keyed, unkeyed, other_queue}


#: The archive's columns in sqlap_0004.
OLD_ARCHIVE_COLUMNS = (
    "job_id",
    "queue",
    "job_type",
    "payload",
    "attempts",
    "enqueued_at",
    "process_at",
    "status",
    "finished_at",
    "error",
    "run_order",
)


#: The job table's columns in the first revision (``seq`` aside).
OLD_JOB_COLUMNS = (
    "job_id",
    "queue",
    "job_type",
    "payload",
    "attempts",
    "enqueued_at",
    "process_at",
)
