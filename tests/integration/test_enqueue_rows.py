"""The driver-level enqueue paths (psycopg 3's COPY, psycopg2's unnest, executemany, one
job's driver SQL) write exactly the rows that SQLAlchemy's Core insert of the same values
writes, as the driver reads them back; and a batch is all or nothing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import FakeClock

import sqla_proletarian as sp
from sqla_proletarian import telemetry

JOB = sp.Job.__table__
#: Every column an enqueue writes, and the server's own (read back to compare them too).
COLUMNS = [column.name for column in JOB.c if column.name != "seq"]
TRACE = '{"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}'


def _ids() -> Iterator[uuid.UUID]:
    n = 0
    while True:
        n += 1
        yield uuid.UUID(int=n, version=4)


def _driver_rows(conn: sa.Connection) -> list[tuple[Any, ...]]:
    """The job rows as the driver reads them (no SQLAlchemy type processing), by id."""
    text = sa.select(*(JOB.c[name] for name in COLUMNS)).order_by(JOB.c.job_id)
    compiled = text.compile(dialect=conn.dialect)
    return [tuple(row) for row in conn.exec_driver_sql(compiled.string).all()]


def _rewritten_by_core(conn: sa.Connection) -> list[tuple[Any, ...]]:
    """Read the jobs through SQLAlchemy's types, delete them, insert the same values with a
    plain Core insert, and return what the driver reads back."""
    values = [dict(row._mapping) for row in conn.execute(sa.select(JOB)).all()]
    conn.execute(sa.delete(JOB))
    for row in values:
        del row["seq"]
    conn.execute(sa.insert(JOB), values)
    return _driver_rows(conn)


@pytest.mark.parametrize("with_trace", [False, True])
def test_the_fast_paths_write_the_rows_a_core_insert_of_the_same_values_writes(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, with_trace: bool
) -> None:
    """Payload JSON (tags, non-ASCII), job id, queue, times (type, zone, microseconds),
    run_order, unique_key and trace_context: enqueue_many's and enqueue(connection)'s rows
    equal, as stored, those of SQLAlchemy's Core insert of what they read back as."""
    if with_trace:
        monkeypatch.setattr(telemetry, "enqueue_context", lambda *args, **kwargs: TRACE)
    clock = FakeClock(datetime(2026, 3, 4, 5, 6, 7, 890123, tzinfo=UTC))
    ids = _ids()
    payload = {
        "when": datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC),
        "day": date(2026, 1, 2),
        "id": uuid.UUID(int=7),
        "amount": Decimal("1.10"),
        "text": "zürich ✓",
        "list": [1, 2.5, None, True, {"nested": "x"}],
    }
    options: dict[str, Any] = {"clock": clock, "job_id_strategy": lambda: next(ids)}
    with engine.begin() as conn:
        sp.enqueue_many(conn, [("a", payload), ("b", [1, "two"])], **options)
        sp.enqueue_many(
            conn,
            [("c", None), ("d", 3)],
            queue="later",
            priority=5,
            process_in=timedelta(seconds=90),
            **options,
        )
        sp.enqueue(
            conn,
            "e",
            payload,
            priority=-3,
            process_at=clock.now + timedelta(hours=1),
            job_id=next(ids),
            clock=clock,
        )
        sp.enqueue(conn, "f", "x", unique_key="key-1", job_id=next(ids), clock=clock)
        written = _driver_rows(conn)
        assert len(written) == 6
        assert _rewritten_by_core(conn) == written
    with engine.connect() as conn:
        jobs = conn.execute(sa.select(JOB).order_by(JOB.c.job_id)).all()
    assert [job.run_order for job in jobs] == [0, 0, -5, -5, 3, 0]
    assert {job.trace_context for job in jobs} == {TRACE if with_trace else None}
    assert jobs[2].process_at == clock.now + timedelta(seconds=90)
    assert all(job.enqueued_at == clock.now for job in jobs)


def test_enqueue_many_of_10001_jobs_with_a_bad_one_in_the_middle_writes_nothing(
    engine: sa.Engine,
) -> None:
    """A bad job (an unserializable payload, an empty job type) is refused with its index
    before any row is written, in one call of 10,001 jobs."""
    good = [("n", {"n": n}) for n in range(10001)]
    with engine.begin() as conn:
        for bad, error in (
            (("n", {"n": {1, 2}}), sp.PayloadSerializationError),
            (("", 1), sp.InvalidJobError),
        ):
            batch = [*good[:5000], bad, *good[5001:]]
            with pytest.raises(error, match=r"jobs\[5000\]"):
                sp.enqueue_many(conn, batch)
            assert conn.execute(sa.select(sa.func.count()).select_from(JOB)).scalar() == 0
        assert len(sp.enqueue_many(conn, good)) == 10001
        assert conn.execute(sa.select(sa.func.count()).select_from(JOB)).scalar() == 10001


def test_a_database_error_of_enqueue_many_is_sqlalchemys_and_writes_nothing(
    engine: sa.Engine,
) -> None:
    """Two jobs with one id (a job_id_strategy that repeats itself): the batch fails as
    SQLAlchemy's IntegrityError, whichever path the driver took, and no row stays."""
    same = uuid.uuid4()
    with engine.connect() as conn:
        with pytest.raises(sa.exc.IntegrityError):
            sp.enqueue_many(conn, [("a", 1), ("b", 2)], job_id_strategy=lambda: same)
        conn.rollback()
        assert conn.execute(sa.select(sa.func.count()).select_from(JOB)).scalar() == 0


def test_enqueue_many_unique_keys_held_in_the_same_call_and_in_the_table_add_nothing(
    engine: sa.Engine,
) -> None:
    """A key given twice in one call, and a key a queued job holds, add no job: those ids
    are the holders'; the jobs without keys go in beside them."""
    with engine.begin() as conn:
        held = sp.enqueue(conn, "old", 0, unique_key="held")
    with engine.begin() as conn:
        ids = sp.enqueue_many(
            conn,
            [("a", 1, "k"), ("b", 2, None), ("c", 3, "k"), ("d", 4, "held"), ("e", 5, None)],
        )
    assert ids[2] == ids[0]
    assert ids[3] == held
    assert len(set(ids)) == 4
    with engine.connect() as conn:
        rows = conn.execute(sa.select(JOB.c.job_id, JOB.c.job_type, JOB.c.unique_key)).all()
    assert sorted((row.job_type, row.unique_key) for row in rows) == [
        ("a", "k"),
        ("b", None),
        ("e", None),
        ("old", "held"),
    ]
