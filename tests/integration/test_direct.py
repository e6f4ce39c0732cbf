"""The worker's hot path (``direct``): its statements executed on the driver's cursor give the
same rows, rowcounts and errors as ``Connection.execute``, on every backend and driver; and
anything that listens to statements still sees every one."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Database
from helpers import archived, enqueue_committed
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql

import sqla_proletarian as sp
from sqla_proletarian import direct, testing
from sqla_proletarian import statements as sql
from sqla_proletarian.dialects import dialect_of


@pytest.fixture
def both_paths() -> Iterator[None]:
    yield
    direct.enabled = True


def _fill(engine: sa.Engine) -> list[uuid.UUID]:
    later = datetime.now(UTC) + timedelta(hours=1)
    with engine.begin() as conn:
        ids = sp.enqueue_many(conn, [("a", {"n": n, "text": "é\u2603"}) for n in range(4)])
        ids += sp.enqueue_many(conn, [("b", [1, None])], priority=5)
        ids += sp.enqueue_many(conn, [("c", "later")], process_at=later)
    return ids


def _hot_statements(conn: sa.Connection, job_ids: list[uuid.UUID]) -> list[Any]:
    """Run the claim, run-record, retry and archive statements once; what each returned."""
    dialect = dialect_of(conn)
    now = datetime.now(UTC)
    seen: list[Any] = []
    if dialect.poll_finds_priority:
        first = sql.poll_first("default", now, 2, with_runs=True)
        seen.append(direct.execute(conn, *first).mappings())
    if dialect.priority_scan == "hops":
        first = direct.execute(conn, *sql.first_entry("default")).rows
        second = direct.execute(conn, *sql.first_entry("default", after=first[0][0])).rows
        seen += [first, second]
        orders = [first[0][0], second[0][0]]
    else:
        orders = sorted(direct.execute(conn, *sql.due_run_orders("default", now)).scalars())
    seen.append(orders)
    for run_order in orders:
        poll = sql.poll("default", now, 10, run_order=run_order, with_runs=True)
        seen.append(direct.execute(conn, *poll).mappings())
    run_ids = {job_id: uuid.uuid5(job_id, "run") for job_id in job_ids[:2]}
    rows = [
        {
            "run_id": run_id,
            "job_id": job_id,
            "worker_id": "w",
            "owner": None,
            "started_at": now,
            "batched": False,
        }
        for job_id, run_id in run_ids.items()
    ]
    for row in rows:
        # (its rowcount is not read: psycopg reports -1 through SQLAlchemy's execution)
        direct.execute(conn, *sql.start_runs([row]))
    seen.append(direct.execute(conn, *sql.runs_of(job_ids[0])).mappings())
    retry_at = now + timedelta(minutes=5)
    seen.append(direct.execute(conn, *sql.retry(job_ids[2], retry_at)).rowcount)
    statements = sql.archive_succeeded(
        job_ids[:2],
        job_ids[:2],
        {},
        now,
        upsert=dialect.archive_upsert,
        returning=dialect.deletes_runs_with_job,
        force_index=dialect.force_index,
    )
    seen.append([direct.execute(conn, *statement).rowcount for statement in statements])
    seen.append(direct.execute(conn, *sql.delete_job(uuid.uuid4())).rowcount)
    return seen


def _tables(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return [
            sorted(tuple(row) for row in conn.execute(sa.select(table)))
            for table in (sp.Job.__table__, sp.ArchivedJob.__table__)
        ]


def test_both_paths_return_the_same_rows(driver_database: Database, both_paths: None) -> None:
    """Each hot statement returns the same rows (types and time zones included) and
    rowcounts through the driver's cursor as through ``Connection.execute``, and leaves the
    same rows behind."""
    engine = driver_database.engine()
    job_ids = _fill(engine)
    results = {}
    for enabled in (False, True):
        direct.enabled = enabled
        with engine.connect() as conn:
            results[enabled] = _hot_statements(conn, job_ids)
            after = conn.execute(sa.select(sp.Job.__table__.c.job_id)).scalars().all()
            conn.rollback()
        assert sorted(after) == sorted(job_ids[2:]), "the statements ran in one transaction"
    assert results[True] == results[False]
    polled = [row for result in results[True] if isinstance(result, list) for row in result]
    job = next(row for row in polled if isinstance(row, dict) and "payload" in row)
    assert isinstance(job["job_id"], uuid.UUID)
    assert job["enqueued_at"].utcoffset() == timedelta(0)
    assert job["runs"] in (0, 1)
    # The worker's drain through each path archives the same jobs the same way.
    finished = {}
    for enabled in (True, False):
        direct.enabled = enabled
        with engine.begin() as conn:
            conn.execute(sa.delete(sp.ArchivedJob.__table__))
        testing.drain(engine, lambda job_type, payload: None)
        finished[enabled] = sorted((a.job_type, a.status, a.attempts) for a in archived(engine))
        with engine.begin() as conn:
            conn.execute(sa.delete(sp.Job.__table__))
        _fill(engine)
    assert finished[True] == finished[False]
    assert len(finished[True]) == 5


def test_the_direct_path_raises_what_sqlalchemy_raises(driver_database: Database) -> None:
    """A statement the server refuses raises SQLAlchemy's wrapped error (with the driver's
    error as its ``orig``), and the connection can roll back and go on."""
    engine = driver_database.engine()
    job_ids = _fill(engine)
    with engine.connect() as conn:
        row = {
            "run_id": uuid.uuid4(),
            "job_id": job_ids[0],
            "worker_id": "w",
            "owner": None,
            "started_at": datetime.now(UTC),
            "batched": False,
        }
        direct.execute(conn, *sql.start_runs([row]))
        with pytest.raises(sa_exc.IntegrityError) as raised:
            direct.execute(conn, *sql.start_runs([row]))
        assert raised.value.orig is not None
        conn.rollback()
        assert direct.execute(conn, *sql.delete_job(uuid.uuid4())).rowcount == 0


def test_a_statement_listener_sees_every_worker_statement(engine: sa.Engine) -> None:
    """With a ``before_cursor_execute`` listener on the engine (query logging, tracing), the
    worker's statements go through ``Connection.execute``, so the listener sees the polls
    and the archive as before."""
    seen: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _log(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    enqueue_committed(engine, "a", {})
    assert testing.drain(engine, lambda job_type, payload: None) == 1
    text = " ".join(seen).lower()
    assert "for update" in text or "proletarian_job" in text
    assert "proletarian_archived_job" in text


def test_id_arrays_go_to_psycopg_as_one_binary_uuid_array(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through psycopg 3, an array of ids is sent as one ``uuid[]`` that the library builds
    (``UuidArray``), not element by element by psycopg's list dumper; the server reads the
    same ids in the same order, an empty array and a large one included."""
    if (engine.dialect.name, engine.dialect.driver) != ("postgresql", "psycopg"):
        pytest.skip("UuidArray is psycopg 3's")
    built: list[int] = []
    build = direct.uuid_array_binary

    def counted(ids: list[uuid.UUID]) -> bytes:
        built.append(len(ids))
        return build(ids)

    monkeypatch.setattr(direct, "uuid_array_binary", counted)
    array = postgresql.ARRAY(sa.Uuid())
    statement = sa.select(
        sa.func.cardinality(sa.bindparam("ids", type_=array)),
        sa.bindparam("back", type_=array),
    )
    many = [uuid.uuid4() for _ in range(2_000)]
    with engine.connect() as conn:
        for ids in (many, many[:1], []):
            rows = direct.execute(conn, statement, {"ids": ids, "back": ids}).rows
            assert rows == [(len(ids), ids)]
    assert built == [2_000, 2_000, 1, 1, 0, 0]
