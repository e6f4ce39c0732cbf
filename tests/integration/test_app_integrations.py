"""Works in the apps people already have: ``scoped_session`` (Flask-SQLAlchemy's
``db.session``), SQLModel's Session, the test-transaction pattern of many test suites, and
SQLite engines that carry SQLAlchemy's pysqlite SAVEPOINT recipe."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
import sqlmodel
from helpers import archived_job, count, job_row, running, wait_for
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, scoped_session
from sqlalchemy.orm import sessionmaker as make_sessionmaker

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database

TESTING_PAGE = Path(__file__).resolve().parents[2] / "docs" / "howto" / "testing.md"

#: The SQLite backend alone, when the run covers it (for tests of the pysqlite recipe).
SQLITE_ONLY = pytest.mark.parametrize(
    "empty_database",
    [b for b in ("sqlite",) if b in os.environ.get("SP_TEST_BACKENDS", "sqlite").split(",")],
    indirect=True,
)


def with_pysqlite_savepoints(engine: sa.Engine) -> sa.Engine:
    """Install SQLAlchemy's pysqlite recipe ("Serializable isolation / Savepoints /
    Transactional DDL") on a SQLite engine, before its first connection: SQLAlchemy, not
    the driver, emits BEGIN, so a SAVEPOINT nests inside the outer transaction. Engines on
    other servers need nothing and are returned as they are."""
    if engine.dialect.name != "sqlite":
        return engine

    @sa.event.listens_for(engine, "connect")
    def do_connect(dbapi_connection: Any, connection_record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver emits no BEGIN of its own

    @sa.event.listens_for(engine, "begin")
    def do_begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN")

    return engine


class Base(DeclarativeBase):
    pass


class Note(Base):
    """An app table of the caller's own, written in the job's transactions."""

    __tablename__ = "app_integration_notes"

    id: Mapped[int] = mapped_column(primary_key=True)
    text: Mapped[str] = mapped_column(sa.String(255))


class Hero(sqlmodel.SQLModel, table=True):
    """A SQLModel table of the app's own."""

    __tablename__ = "app_integration_heroes"

    id: int | None = sqlmodel.Field(default=None, primary_key=True)
    name: str = sqlmodel.Field(max_length=255)


def job_count(engine: sa.Engine) -> int:
    return count(engine, sp.Job)


def create_heroes_table(engine: sa.Engine) -> None:
    """The SQLModel table alone (SQLModel.metadata is shared by every SQLModel class)."""
    sqlmodel.SQLModel.metadata.create_all(engine, tables=[Hero.__table__])  # type: ignore[attr-defined]


def decoded(stored: str) -> Any:
    """A job row's payload as the handler will see it."""
    return sp.JsonSerializer().loads(stored)


# --- scoped_session ---------------------------------------------------------------------------


def test_scoped_session_enqueue_commits_with_the_current_session(engine: sa.Engine) -> None:
    """A scoped_session is passed as it is: the job joins the session of the current scope
    and exists once that session commits."""
    db_session = scoped_session(make_sessionmaker(engine))
    try:
        job_id = sp.enqueue(db_session, "greet", {"name": "Ada"})
        assert [job.job_id for job in db_session.new if isinstance(job, sp.Job)] == [job_id]
        assert job_count(engine) == 0
        db_session.commit()
    finally:
        db_session.remove()
    row = job_row(engine, job_id)
    assert row is not None
    assert (row.job_type, decoded(row.payload)) == ("greet", {"name": "Ada"})


def test_scoped_session_enqueue_then_rollback_leaves_no_job(engine: sa.Engine) -> None:
    db_session = scoped_session(make_sessionmaker(engine))
    try:
        sp.enqueue(db_session, "greet", {"name": "Ada"})
        db_session.flush()  # the row is in the database, uncommitted
        db_session.rollback()
        db_session.commit()  # nothing left to commit
    finally:
        db_session.remove()
    assert job_count(engine) == 0


def test_scoped_session_enqueue_joins_only_the_session_of_its_own_scope(
    engine: sa.Engine,
) -> None:
    """Enqueued while scope "a" is current, the job belongs to a's session: committing the
    session of scope "b" leaves no job; committing a's does."""
    scope = ["a"]
    db_session = scoped_session(make_sessionmaker(engine), scopefunc=lambda: scope[0])
    try:
        job_id = sp.enqueue(db_session, "greet", None)
        scope[0] = "b"
        db_session.commit()
        assert job_count(engine) == 0
        db_session.remove()
        scope[0] = "a"
        db_session.commit()
    finally:
        db_session.remove()
    assert job_row(engine, job_id) is not None


# --- SQLModel ---------------------------------------------------------------------------------


def test_sqlmodel_session_commits_the_job_with_the_apps_own_row(engine: sa.Engine) -> None:
    """sqlmodel.Session is a Session subclass: the job and a SQLModel row commit together."""
    create_heroes_table(engine)
    with sqlmodel.Session(engine) as session:
        hero = Hero(name="Ada")
        session.add(hero)
        session.flush()
        job_id = sp.enqueue(session, "welcome-hero", {"hero_id": hero.id})
        session.commit()
        hero_id = hero.id
    with sqlmodel.Session(engine) as session:
        assert [h.name for h in session.exec(sqlmodel.select(Hero)).all()] == ["Ada"]
    row = job_row(engine, job_id)
    assert row is not None
    assert decoded(row.payload) == {"hero_id": hero_id}


def test_sqlmodel_session_rollback_leaves_neither_the_row_nor_the_job(
    engine: sa.Engine,
) -> None:
    create_heroes_table(engine)
    with sqlmodel.Session(engine) as session:
        hero = Hero(name="Bob")
        session.add(hero)
        session.flush()
        sp.enqueue(session, "welcome-hero", {"hero_id": hero.id})
        session.flush()
        session.rollback()
    assert count(engine, Hero) == 0
    assert job_count(engine) == 0


# --- the test-transaction pattern -------------------------------------------------------------


def test_outer_transaction_rollback_undoes_a_job_the_test_committed(database: Database) -> None:
    """The fixture pattern of many test suites: an outer transaction on one connection, a
    Session joined to it with create_savepoint. The test enqueues and commits (which only
    releases a savepoint); rolling the outer transaction back removes the job, on every
    backend (on SQLite, with the pysqlite recipe)."""
    engine = with_pysqlite_savepoints(database.engine())
    Base.metadata.create_all(engine)
    with engine.connect() as connection:
        outer = connection.begin()
        session = Session(bind=connection, join_transaction_mode="create_savepoint")
        session.add(Note(text="written by the test"))
        job_id = sp.enqueue(session, "greet", {"name": "Ada"})
        session.commit()
        assert session.get(sp.Job, job_id) is not None, "committed, as the test sees it"
        session.close()
        assert connection.scalar(sa.select(sa.func.count()).select_from(sp.Job)) == 1
        outer.rollback()
    assert job_count(engine) == 0
    assert count(engine, Note) == 0
    assert not sp.process_next_job(engine, lambda job_type, payload: None)


def test_outer_transaction_rollback_also_undoes_a_job_after_a_rolled_back_savepoint(
    database: Database,
) -> None:
    """A test that rolls its Session back keeps working in the outer transaction: the job it
    then enqueues and commits disappears with the outer rollback too."""
    engine = with_pysqlite_savepoints(database.engine())
    with engine.connect() as connection:
        outer = connection.begin()
        session = Session(bind=connection, join_transaction_mode="create_savepoint")
        sp.enqueue(session, "discarded", None)
        session.flush()
        session.rollback()
        sp.enqueue(session, "kept-until-the-outer-rollback", None)
        session.commit()
        kinds = connection.scalars(sa.select(sp.Job.job_type)).all()
        assert kinds == ["kept-until-the-outer-rollback"]
        session.close()
        outer.rollback()
    assert job_count(engine) == 0


@SQLITE_ONLY
def test_sqlite_without_the_recipe_the_released_savepoint_commits_for_good(
    database: Database,
) -> None:
    """Why the recipe is needed: in the driver's legacy transaction control, SQLite's first
    SAVEPOINT opens the transaction itself, so the session's commit (RELEASE) commits the job
    and the outer rollback cannot undo it."""
    engine = database.engine()
    with engine.connect() as connection:
        driver = connection.connection.driver_connection
        legacy = getattr(sqlite3, "LEGACY_TRANSACTION_CONTROL", object())
        if driver.isolation_level is None or getattr(driver, "autocommit", legacy) != legacy:
            pytest.skip("this sqlite3 driver does not use legacy transaction control")
        outer = connection.begin()
        session = Session(bind=connection, join_transaction_mode="create_savepoint")
        sp.enqueue(session, "greet", None)
        session.commit()
        session.close()
        outer.rollback()
    assert job_count(engine) == 1


# --- the worker on a SQLite engine with the recipe --------------------------------------------


@pytest.fixture
def recipe_engine(database: Database) -> sa.Engine:
    """An engine with the pysqlite recipe on the test's SQLite database, and an app table."""
    engine = with_pysqlite_savepoints(database.engine())
    Base.metadata.create_all(engine)
    return engine


def enqueue_with(engine: sa.Engine, job_type: str, payload: Any = None) -> uuid.UUID:
    with Session(engine) as session:
        job_id = sp.enqueue(session, job_type, payload)
        session.commit()
    return job_id


def write_note(job: sp.JobContext) -> None:
    """Writes an app row through the job's session; fails for payloads that say so."""
    job.session.add(Note(text=job.payload["text"]))
    job.session.flush()
    if job.payload.get("fail"):
        raise RuntimeError("the handler failed after writing")


@SQLITE_ONLY
def test_process_next_job_on_a_recipe_engine_archives_success_with_the_handlers_write(
    recipe_engine: sa.Engine,
) -> None:
    job_id = enqueue_with(recipe_engine, "note", {"text": "hello"})
    assert sp.process_next_job(recipe_engine, write_note, handler_mode="advanced")
    done = archived_job(recipe_engine, job_id)
    assert done is not None
    assert (done.status, done.attempts) == ("success", 1)
    assert job_count(recipe_engine) == 0
    with Session(recipe_engine) as session:
        assert session.scalars(sa.select(Note.text)).all() == ["hello"]
    assert not sp.process_next_job(recipe_engine, write_note, handler_mode="advanced")


@SQLITE_ONLY
def test_process_next_job_on_a_recipe_engine_rolls_back_a_failed_handlers_write(
    recipe_engine: sa.Engine,
) -> None:
    """The handler's savepoint works inside the claim's transaction: its write rolls back,
    while the failure is archived."""
    job_id = enqueue_with(recipe_engine, "note", {"text": "never kept", "fail": True})
    assert sp.process_next_job(recipe_engine, write_note, handler_mode="advanced")
    done = archived_job(recipe_engine, job_id)
    assert done is not None
    assert done.status == "failure"
    assert done.error is not None and "the handler failed after writing" in done.error
    assert count(recipe_engine, Note) == 0
    assert job_count(recipe_engine) == 0


@SQLITE_ONLY
def test_queue_worker_on_a_recipe_engine_runs_and_archives_committed_jobs(
    recipe_engine: sa.Engine,
) -> None:
    job_ids = [enqueue_with(recipe_engine, "note", {"text": f"note {n}"}) for n in range(3)]
    worker = sp.create_queue_worker(
        recipe_engine, write_note, handler_mode="advanced", polling_interval=0.01
    )
    with running(worker):
        assert wait_for(lambda: count(recipe_engine, sp.ArchivedJob) == 3)
    assert worker.summary_text() == "3 succeeded, 0 retried, 0 failed"
    for job_id in job_ids:
        done = archived_job(recipe_engine, job_id)
        assert done is not None and done.status == "success"
    assert job_count(recipe_engine) == 0
    assert count(recipe_engine, Note) == 3


# --- docs/howto/testing.md, "Tests in a rolled-back transaction" ------------------------------


def rolled_back_test_files() -> dict[str, str]:
    """The python blocks of docs/howto/testing.md written to ``rollback/NAME`` (its
    ``<!-- file: rollback/NAME -->`` markers), after its "runs the next two code blocks"
    marker, by file name."""
    text = TESTING_PAGE.read_text(encoding="utf-8")
    marker = text.index("test_app_integrations.py runs the next two code blocks")
    block = re.compile(r"<!-- file: rollback/(\S+) -->\n```python\n(.*?)```", re.DOTALL)
    return {name: body for name, body in block.findall(text, marker)}


def test_docs_testing_fixtures_roll_back_the_tests_committed_job(
    database: Database, tmp_path: Path
) -> None:
    """The testing page's conftest.py and test file, run by pytest as written (the database
    URL aside): the test passes, and its committed job is gone afterwards."""
    files = rolled_back_test_files()
    assert sorted(files) == ["conftest.py", "test_signup.py"]
    conftest, test_module = files["conftest.py"], files["test_signup.py"]
    url = database.url.render_as_string(hide_password=False)
    default = 'DATABASE_URL = "sqlite:///test.db"'
    assert default in conftest
    (tmp_path / "conftest.py").write_text(conftest.replace(default, f"DATABASE_URL = {url!r}"))
    (tmp_path / "test_signup.py").write_text(test_module)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-W", "error", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    engine = database.engine()
    assert job_count(engine) == 0
