"""Enqueue: joins the caller's Session or Connection, never commits, refuses bad jobs whole."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import T0, FakeClock, archived_job, count, enqueue_committed, job_row, jobs
from sqlalchemy.orm import Session

import sqla_proletarian as sp


def _cycle() -> list[Any]:
    items: list[Any] = []
    items.append(items)
    return items


UNSERIALIZABLE: list[tuple[str, Any]] = [
    ("object", {"x": object()}),
    ("set", {"ids": {1, 2}}),
    ("nan", [1.0, math.nan]),
    ("non-str key", {1: "one"}),
    ("cycle", _cycle()),
]


# --- Session --------------------------------------------------------------------------------


def test_session_enqueue_returns_the_id_at_once_and_the_job_exists_after_commit(
    engine: sa.Engine,
) -> None:
    with Session(engine) as session:
        job_id = sp.enqueue(session, "greet", {"name": "Ada"}, queue="mail")
        assert isinstance(job_id, uuid.UUID)
        pending = [obj for obj in session.new if isinstance(obj, sp.Job)]
        assert [job.job_id for job in pending] == [job_id], "id known before any flush"
        assert count(engine, sp.Job) == 0
        session.commit()
    row = job_row(engine, job_id)
    assert row is not None
    assert (row.job_type, row.queue, row.attempts) == ("greet", "mail", 0)


def test_session_enqueue_then_rollback_leaves_no_job(engine: sa.Engine) -> None:
    with Session(engine) as session:
        sp.enqueue(session, "greet", {"name": "Ada"})
        session.flush()
        session.rollback()
    assert count(engine, sp.Job) == 0
    assert not sp.process_next_job(engine, lambda job_type, payload: None)


def test_enqueue_never_commits_the_session(engine: sa.Engine) -> None:
    """Even flushed, an enqueued job is invisible to others until the caller commits."""
    with Session(engine) as session:
        sp.enqueue(session, "greet", None)
        session.flush()
        assert session.in_transaction()
        assert count(engine, sp.Job) == 0
        # Closing without commit is a rollback: the job never existed.
    assert count(engine, sp.Job) == 0


def test_session_add_job_is_an_enqueue_with_the_same_defaults(engine: sa.Engine) -> None:
    clock = FakeClock()
    with Session(engine) as session:
        job = sp.Job(job_type="greet", payload={"name": "Ada"}, clock=clock)
        assert isinstance(job.job_id, uuid.UUID) and job.job_id.version == 4
        session.add(job)
        job_id = job.job_id
        session.commit()
    row = job_row(engine, job_id)
    assert row is not None
    assert row.queue == sp.DEFAULT_QUEUE == "default"
    assert row.attempts == 0
    assert row.enqueued_at == row.process_at == T0
    seen: list[Any] = []
    assert sp.process_next_job(engine, lambda t, p: seen.append((t, p)), clock=clock)
    assert seen == [("greet", {"name": "Ada"})]

    due = T0 + timedelta(minutes=5)
    with Session(engine) as session:
        session.add(sp.Job(job_type="t", payload=[1], queue="q", process_at=due, clock=clock))
        session.commit()
    [row] = jobs(engine)
    assert (row.queue, row.process_at, row.enqueued_at) == ("q", due, T0)


def test_job_constructor_refuses_a_bad_job_where_it_is_built(engine: sa.Engine) -> None:
    with Session(engine) as session:
        with pytest.raises(sp.ProletarianError, match="payload"):
            sp.Job(job_type="greet", payload={"x": object()})
        with pytest.raises(sp.ProletarianError, match="naive"):
            sp.Job(job_type="greet", process_at=datetime(2030, 1, 1))
        with pytest.raises(sp.ProletarianError, match="job_type"):
            sp.Job(job_type="")
        assert not session.new
        session.commit()
    assert count(engine, sp.Job) == 0


def test_unserializable_payload_is_refused_and_nothing_is_added_to_the_session(
    engine: sa.Engine,
) -> None:
    with Session(engine) as session:
        for label, payload in UNSERIALIZABLE:
            with pytest.raises(sp.ProletarianError) as info:
                sp.enqueue(session, "t", payload)
            assert "payload" in str(info.value), label
            assert not session.new, label
        session.commit()
    assert count(engine, sp.Job) == 0


def test_naive_process_at_is_refused_for_session_and_connection(engine: sa.Engine) -> None:
    naive = datetime(2030, 1, 1, 12, 0)
    with Session(engine) as session:
        with pytest.raises(sp.ProletarianError, match="naive"):
            sp.enqueue(session, "t", None, process_at=naive)
        assert not session.new
        session.commit()
    with engine.begin() as conn, pytest.raises(sp.ProletarianError, match="aware"):
        sp.enqueue(conn, "t", None, process_at=naive)
    assert count(engine, sp.Job) == 0


# --- Connection -----------------------------------------------------------------------------


def test_connection_enqueue_inserts_in_the_connections_transaction(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        conn.begin()
        job_id = sp.enqueue(conn, "greet", {"n": 1})
        inside = conn.execute(sa.select(sa.func.count()).select_from(sp.Job)).scalar_one()
        assert inside == 1, "inserted at once, in this transaction"
        assert count(engine, sp.Job) == 0, "not committed by enqueue"
        conn.commit()
    row = job_row(engine, job_id)
    assert row is not None and row.job_type == "greet"


def test_connection_enqueue_rolled_back_leaves_no_job(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        conn.begin()
        sp.enqueue(conn, "greet", {"n": 1})
        conn.rollback()
    assert count(engine, sp.Job) == 0


def test_unserializable_payload_is_refused_and_nothing_is_inserted_by_a_connection(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        for label, payload in UNSERIALIZABLE:
            with pytest.raises(sp.ProletarianError):
                sp.enqueue(conn, "t", payload)
            inside = conn.execute(sa.select(sa.func.count()).select_from(sp.Job)).scalar_one()
            assert inside == 0, label
    assert count(engine, sp.Job) == 0


def test_an_engine_is_refused_with_advice_to_pass_a_session_or_connection(
    engine: sa.Engine,
) -> None:
    with pytest.raises(sp.NotATransactionError) as info:
        sp.enqueue(engine, "t", None)  # type: ignore[arg-type]
    assert isinstance(info.value, sp.ProletarianError)
    assert "Session or Connection" in str(info.value)
    assert count(engine, sp.Job) == 0


# --- ids ------------------------------------------------------------------------------------


def test_a_mistyped_keyword_is_a_type_error_naming_enqueue(engine: sa.Engine) -> None:
    """enqueue's options are real keyword parameters: a typo names ``enqueue`` (and mypy
    catches it), not the internal function that builds the row; nothing is added."""
    with Session(engine) as session:
        with pytest.raises(TypeError) as info:
            sp.enqueue(session, "t", {}, proces_in=5)  # type: ignore[call-arg]
        assert not session.new
    message = str(info.value)
    assert message.startswith("enqueue() got an unexpected keyword argument 'proces_in'")
    assert "build_job_values" not in message
    with Session(engine) as session, pytest.raises(TypeError) as many:
        sp.enqueue_many(session, [("t", {})], clok=None)  # type: ignore[call-arg]
    assert str(many.value).startswith("enqueue_many() got an unexpected keyword argument")
    with pytest.raises(
        TypeError, match=r"^__init__\(\) got an unexpected keyword argument 'prority'"
    ):
        sp.Job(job_type="t", prority=2)  # type: ignore[call-arg]


def test_every_option_of_enqueue_still_applies(engine: sa.Engine) -> None:
    """The keywords once taken as ``**options`` (job_id, serializer, job_id_strategy,
    clock) still reach the row, through a Session and a Connection."""
    clock = FakeClock()
    fixed = uuid.uuid4()

    class Upper:
        def dumps(self, payload: Any) -> str:
            return '"' + str(payload).upper() + '"'

        def loads(self, text: str) -> Any:
            return text

    with Session(engine) as session:
        given = sp.enqueue(session, "t", "a", job_id=fixed, serializer=Upper(), clock=clock)
        made = sp.enqueue(session, "t", "b", job_id_strategy=sp.uuid7, priority=3)
        session.commit()
    with engine.begin() as conn:
        many = sp.enqueue_many(conn, [("t", "c")], serializer=Upper(), clock=clock)
    assert given == fixed and made.version == 7
    first, second, third = (job_row(engine, job_id) for job_id in (fixed, made, many[0]))
    assert first is not None and second is not None and third is not None
    assert (first.payload, first.enqueued_at) == ('"A"', T0)
    assert (third.payload, third.enqueued_at) == ('"C"', T0)
    assert second.priority == 3


def test_job_ids_are_client_side_uuid4_by_default_and_uuid7_on_request(
    engine: sa.Engine,
) -> None:
    with Session(engine) as session:
        default_id = sp.enqueue(session, "t", None)
        v7_ids = [sp.enqueue(session, "t", i, job_id_strategy=sp.uuid7) for i in range(3)]
        job = sp.Job(job_type="t", payload=None, job_id_strategy=sp.uuid7)
        session.add(job)
        session.commit()
        added_id = job.job_id
    with engine.begin() as conn:
        conn_id = sp.enqueue(conn, "t", None, job_id_strategy=sp.uuid7)
    assert default_id.version == 4
    assert [i.version for i in [*v7_ids, added_id, conn_id]] == [7] * 5
    stored = {row.job_id for row in jobs(engine)}
    assert stored == {default_id, *v7_ids, added_id, conn_id}


def test_job_id_is_stable_across_retries(engine: sa.Engine) -> None:
    job_id = enqueue_committed(engine, "flaky", None)
    runs: list[uuid.UUID] = []

    def handler(job: sp.JobContext) -> None:
        runs.append(job.job_id)
        if len(runs) == 1:
            raise RuntimeError("first run fails")

    options: dict[str, Any] = {
        "handler_mode": "advanced",
        "retry_strategy": lambda job, exc: sp.RetryStrategy(1),
    }
    assert sp.process_next_job(engine, handler, **options)
    row = job_row(engine, job_id)
    assert row is not None and row.attempts == 1
    assert sp.process_next_job(engine, handler, **options)
    assert runs == [job_id, job_id]
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("success", 2)


# --- payloads -------------------------------------------------------------------------------


def test_payload_round_trips_through_the_worker(engine: sa.Engine) -> None:
    payload = {
        "at": datetime(2040, 2, 29, 23, 59, 59, 999999, tzinfo=UTC),
        "local": datetime(2031, 7, 1, 9, 30, 0, 1, tzinfo=timezone(timedelta(hours=5, minutes=30))),
        "day": date(1999, 12, 31),
        "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "amount": Decimal("12345678901234567890.000100"),
        "nested": [{"a": [1, 2.5, None, True, False]}, [], {}, ["x", [Decimal("-0.1")]]],
        "unicode": "zażółć gęślą jaźń · 日本語 · emoji 🎉 · \u00e9\u0301",
        "ключ": "значение",
        "big": 2**62,
    }
    job_id = enqueue_committed(engine, "round-trip", payload)
    seen: list[Any] = []
    assert sp.process_next_job(engine, lambda job_type, p: seen.append(p))
    [got] = seen
    assert got == payload
    assert got["local"].utcoffset() == timedelta(hours=5, minutes=30)
    assert str(got["amount"]) == "12345678901234567890.000100"
    assert isinstance(got["id"], uuid.UUID) and isinstance(got["day"], date)
    assert not isinstance(got["day"], datetime)
    done = archived_job(engine, job_id)
    assert done is not None and done.status == "success"
