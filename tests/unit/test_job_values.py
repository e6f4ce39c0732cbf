"""Building a job without a database: enqueue's validation, scheduling and job ids."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian.types import MAX_NAME_LENGTH
from sqla_proletarian.values import build_job_values

NOW = datetime(2024, 5, 17, 12, 0, 0, 250000, tzinfo=UTC)


def clock() -> datetime:
    return NOW


def test_a_new_job_gets_its_defaults_from_the_clock_and_the_serializer() -> None:
    job_id = uuid.uuid4()
    values = build_job_values("greet", {"n": 1}, job_id=job_id, clock=clock)
    assert values == {
        "job_id": job_id,
        "queue": sp.DEFAULT_QUEUE,
        "job_type": "greet",
        "payload": '{"n":1}',
        "attempts": 0,
        "enqueued_at": NOW,
        "process_at": NOW,
        "run_order": 0,
        "unique_key": None,
        "concurrency_key": None,
    }


def test_the_job_constructor_fills_the_same_values_as_enqueue() -> None:
    job = sp.Job(job_type="greet", payload=[1], queue="mail", process_in=5, clock=clock)
    assert isinstance(job.job_id, uuid.UUID)
    assert (job.queue, job.job_type, job.payload, job.attempts) == ("mail", "greet", "[1]", 0)
    assert job.enqueued_at == NOW
    assert job.process_at == NOW + timedelta(seconds=5)


def test_the_default_job_id_is_a_random_uuid4_and_each_job_gets_its_own() -> None:
    first = sp.Job(job_type="t")
    second = sp.Job(job_type="t")
    assert first.job_id.version == 4
    assert first.job_id != second.job_id


def test_the_job_id_strategy_is_pluggable() -> None:
    assert sp.Job(job_type="t", job_id_strategy=sp.uuid7).job_id.version == 7
    fixed = uuid.UUID(int=42)
    assert sp.Job(job_type="t", job_id_strategy=lambda: fixed).job_id == fixed


def test_a_job_id_that_is_not_a_uuid_is_refused() -> None:
    with pytest.raises(sp.InvalidJobError, match="job_id"):
        build_job_values("t", job_id="not-a-uuid")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("process_in", "expected"),
    [
        (None, NOW),
        (0, NOW),
        (2.5, NOW + timedelta(seconds=2.5)),
        (timedelta(minutes=3), NOW + timedelta(minutes=3)),
        (-10, NOW),
        (timedelta(days=-1), NOW),
    ],
)
def test_process_in_delays_the_job_and_a_negative_delay_means_now(
    process_in: Any, expected: datetime
) -> None:
    assert sp.Job(job_type="t", process_in=process_in, clock=clock).process_at == expected


def test_process_at_in_the_past_means_now() -> None:
    job = sp.Job(job_type="t", process_at=NOW - timedelta(days=3), clock=clock)
    assert job.process_at == NOW


def test_process_at_wins_over_process_in() -> None:
    at = NOW + timedelta(hours=1)
    job = sp.Job(job_type="t", process_at=at, process_in=timedelta(days=9), clock=clock)
    assert job.process_at == at


def test_process_at_in_another_zone_is_stored_as_the_same_instant_in_utc() -> None:
    at = datetime(2024, 5, 17, 20, 0, tzinfo=timezone(timedelta(hours=5)))
    process_at = sp.Job(job_type="t", process_at=at, clock=clock).process_at
    assert process_at == at
    assert process_at.utcoffset() == timedelta(0)


def test_a_naive_process_at_is_refused_with_advice() -> None:
    with pytest.raises(sp.InvalidJobError) as info:
        sp.Job(job_type="t", process_at=datetime(2030, 1, 1))
    assert info.value.field == "process_at"
    assert "naive" in str(info.value)
    assert "aware" in str(info.value)


@pytest.mark.parametrize("process_in", ["5", True, float("nan"), float("inf"), [1]])
def test_a_process_in_that_is_not_a_finite_duration_is_refused(process_in: Any) -> None:
    with pytest.raises(sp.InvalidJobError, match="process_in"):
        sp.Job(job_type="t", process_in=process_in)


def test_a_clock_that_returns_a_naive_datetime_is_refused() -> None:
    with pytest.raises(sp.InvalidJobError, match="naive"):
        sp.Job(job_type="t", clock=lambda: datetime(2024, 1, 1))


@pytest.mark.parametrize("field", ["job_type", "queue"])
@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("", ["empty"]),
        ("x" * (MAX_NAME_LENGTH + 1), [f"{MAX_NAME_LENGTH + 1} characters", "255"]),
        ("a\x00b", ["NUL"]),
        ("bad\ud800", ["Unicode"]),
        (7, ["int", "string"]),
        (None, ["string"]),
    ],
    ids=["empty", "too-long", "nul", "surrogate", "int", "none"],
)
def test_bad_job_types_and_queue_names_are_refused(
    field: str, value: Any, words: list[str]
) -> None:
    kwargs: dict[str, Any] = {"job_type": "t", "queue": "q", field: value}
    with pytest.raises(sp.InvalidJobError) as info:
        sp.Job(**kwargs)
    assert info.value.field == field
    for word in words:
        assert word in str(info.value)


def test_a_name_of_exactly_the_limit_is_accepted() -> None:
    name = "é" * MAX_NAME_LENGTH
    job = sp.Job(job_type=name, queue=name)
    assert job.job_type == job.queue == name


def test_a_payload_that_cannot_be_serialized_fails_where_the_job_is_built() -> None:
    with pytest.raises(sp.PayloadSerializationError):
        sp.Job(job_type="t", payload={"tags": {"a", "b"}})


def test_enqueue_into_a_session_adds_the_job_and_returns_its_id_without_flushing() -> None:
    with Session() as session:
        job_id = sp.enqueue(session, "greet", {"name": "Ada"}, queue="mail")
        (job,) = session.new
        assert isinstance(job, sp.Job)
        assert job.job_id == job_id
        assert job.queue == "mail"


def test_a_refused_payload_adds_nothing_to_the_session() -> None:
    with Session() as session:
        with pytest.raises(sp.PayloadSerializationError):
            sp.enqueue(session, "greet", {"when": object()})
        assert not session.new


def test_enqueue_refuses_an_engine_and_says_to_pass_a_session_or_connection() -> None:
    engine = sa.create_engine("sqlite://")
    try:
        with pytest.raises(sp.NotATransactionError) as info:
            sp.enqueue(engine, "greet")  # type: ignore[arg-type]
    finally:
        engine.dispose()
    assert "Session or Connection" in str(info.value)
    assert isinstance(info.value, sp.ProletarianError)


def test_enqueue_refuses_something_that_is_not_a_session_or_connection() -> None:
    with pytest.raises(sp.NotATransactionError, match="str"):
        sp.enqueue("postgresql://", "greet")  # type: ignore[arg-type]


def test_uuid7_sets_the_version_and_variant_bits() -> None:
    for _ in range(200):
        value = sp.uuid7()
        assert value.version == 7
        assert value.variant == uuid.RFC_4122


def test_uuid7_carries_the_creation_time_in_milliseconds() -> None:
    before = time.time_ns() // 1_000_000
    value = sp.uuid7()
    after = time.time_ns() // 1_000_000
    assert before <= value.int >> 80 <= after


def test_uuid7_ids_made_in_later_milliseconds_sort_after_earlier_ones() -> None:
    ids = []
    for _ in range(20):
        ids.append(sp.uuid7())
        time.sleep(0.002)
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
