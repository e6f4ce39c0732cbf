"""Several queues per worker (``queues=[...]``): claimed in the order given, a queue's jobs
once the queues before it have none due; batches filled across them; queues not named are
left alone; a paused queue is passed over; wake-ups for every queue; the asyncio worker the
same; options that name no queue, a queue twice, or both ``queue`` and ``queues`` refused."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import FakeClock, archived, enqueue_committed, jobs
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian.supervisor import run_worker
from sqla_proletarian.worker import WorkerOptions

#: How the asyncio tests reach each backend.
ASYNC_DRIVER = {"sqlite": "aiosqlite", "postgresql": "asyncpg", "mariadb": "aiomysql"}
PREFIX = {"sqlite": "sqlite", "postgresql": "postgresql", "mariadb": "mysql"}
MODES: list[dict[str, Any]] = [{}, {"lease_seconds": 30}]
MODE_IDS = ["transaction", "lease"]


def enqueue_in(engine: sa.Engine, queue: str, *job_types: str, **kw: Any) -> None:
    with Session(engine) as session:
        sp.enqueue_many(session, [(job_type, None) for job_type in job_types], queue=queue, **kw)
        session.commit()


def run_one_at_a_time(engine: sa.Engine, **options: Any) -> list[str]:
    """Run due jobs one claim at a time: the job types in the order they ran."""
    ran: list[str] = []
    while sp.process_next_job(engine, lambda job_type, payload: ran.append(job_type), **options):
        pass
    return ran


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_queues_are_claimed_in_the_order_given(engine: sa.Engine, mode: dict[str, Any]) -> None:
    """The second queue's jobs run only once the first has none due; a job of the first
    enqueued meanwhile goes before the rest of the second; a priority does not cross queues."""
    enqueue_in(engine, "bulk", "b1", "b2", priority=100)
    enqueue_in(engine, "urgent", "u1", "u2")
    ran: list[str] = []

    def handler(job: sp.JobContext) -> None:
        ran.append(job.job_type)
        if job.job_type == "b1":  # the first queue gets a job while the second's are running
            sp.enqueue(job.session, "u3", queue="urgent")

    options = {"queues": ["urgent", "bulk"], "handler_mode": "advanced", **mode}
    while sp.process_next_job(engine, handler, **options):
        pass
    assert ran == ["u1", "u2", "b1", "u3", "b2"]
    assert {a.queue for a in archived(engine)} == {"urgent", "bulk"}


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_batch_is_filled_from_the_next_queue_when_the_first_has_too_few(
    engine: sa.Engine, backend: str, mode: dict[str, Any]
) -> None:
    """batch_size=4 with two due jobs in the first queue: the claim takes them and the first
    two of the second queue, in that order (SQLite claims one job at a time)."""
    enqueue_in(engine, "first", "f1", "f2")
    enqueue_in(engine, "second", "s1", "s2", "s3")
    claims: list[list[str]] = []
    claimed = threading.Event()

    def handler(job: sp.JobContext) -> None:
        if not claims or claimed.is_set():
            claims.append([])
            claimed.clear()
        claims[-1].append(job.job_type)

    def record_claim() -> None:
        claimed.set()

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        queues=["first", "second"],
        batch_size=4,
        polling_interval=0.05,
        **mode,
    )
    worker._runner.on_claim = record_claim  # a new claim starts a new group
    claimed.set()
    with worker:
        deadline = time.monotonic() + 20
        while jobs(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
    ran = [job_type for claim in claims for job_type in claim]
    assert ran == ["f1", "f2", "s1", "s2", "s3"]
    if backend != "sqlite" and not mode:
        assert claims == [["f1", "f2", "s1", "s2"], ["s3"]]


def test_a_worker_leaves_queues_it_does_not_name_and_passes_over_a_paused_one(
    engine: sa.Engine,
) -> None:
    enqueue_in(engine, "a", "a1")
    enqueue_in(engine, "b", "b1")
    enqueue_in(engine, "other", "o1")
    with engine.begin() as conn:
        sp.pause_queue(conn, "a")
    assert run_one_at_a_time(engine, queues=["a", "b"]) == ["b1"]
    with engine.begin() as conn:
        sp.resume_queue(conn, "a")
    assert run_one_at_a_time(engine, queues=["a", "b"]) == ["a1"]
    assert [job.queue for job in jobs(engine)] == ["other"]


def test_a_job_scheduled_later_in_the_first_queue_does_not_hold_up_the_second(
    engine: sa.Engine,
) -> None:
    clock = FakeClock()
    enqueue_committed(engine, "later", queue="first", process_in=60, clock=clock)
    enqueue_committed(engine, "now", queue="second", clock=clock)
    assert run_one_at_a_time(engine, queues=["first", "second"], clock=clock) == ["now"]
    clock.advance(61)
    assert run_one_at_a_time(engine, queues=["first", "second"], clock=clock) == ["later"]


def test_testing_drain_takes_several_queues(engine: sa.Engine) -> None:
    enqueue_in(engine, "two", "t1")
    enqueue_in(engine, "one", "o1")
    ran: list[str] = []
    runs = sp.testing.drain(
        engine, lambda job_type, payload: ran.append(job_type), queues=["one", "two"]
    )
    assert (runs, ran) == (2, ["o1", "t1"])


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_job_committed_to_any_of_the_queues_wakes_the_idle_worker(
    engine: sa.Engine, mode: dict[str, Any]
) -> None:
    """With a polling interval of 30 s, a job enqueued in this process to the second queue
    (or, on PostgreSQL, notified through LISTEN) runs within seconds."""
    done = threading.Event()
    worker = sp.create_queue_worker(
        engine,
        lambda job_type, payload: done.set(),
        queues=["first", "second"],
        polling_interval=30,
        **mode,
    )
    with worker:
        time.sleep(0.5)  # the worker is idle: its first polls found nothing
        started = time.monotonic()
        enqueue_in(engine, "second", "wake")
        assert done.wait(10), "the job of the second queue did not wake the worker"
        assert time.monotonic() - started < 5
    assert worker.summary()["succeeded"] == 1
    assert worker.worker_id == "proletarian[first,second]"


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_postgresql_notify_for_any_of_the_queues_wakes_the_worker(
    engine: sa.Engine, backend: str, mode: dict[str, Any]
) -> None:
    """A row of the second queue inserted with plain Core (no in-process wake-up, as
    another process would) reaches the idle worker through NOTIFY; one of a queue it does
    not serve does not wake it into running anything."""
    if backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    ran: list[str] = []
    done = threading.Event()

    def handler(job_type: str, payload: Any) -> None:
        ran.append(job_type)
        done.set()

    def insert_raw(job_type: str, queue: str) -> None:
        values = sp.Job(job_type=job_type, queue=queue).__dict__
        row = {c.name: values[c.name] for c in sp.Job.__table__.c if c.name in values}
        with engine.begin() as conn:
            conn.execute(sa.insert(sp.Job.__table__), row)

    worker = sp.create_queue_worker(
        engine, handler, queues=["first", "second"], polling_interval=30, **mode
    )
    with worker:
        time.sleep(0.5)  # idle, listening
        insert_raw("elsewhere", "third")
        insert_raw("notified", "second")
        assert done.wait(5), "NOTIFY for the second queue did not wake the worker"
    assert ran == ["notified"]


def test_a_burst_runs_every_queue_until_none_has_a_due_job(engine: sa.Engine) -> None:
    enqueue_in(engine, "first", "f1")
    enqueue_in(engine, "second", "s1", "s2")
    ran: list[str] = []
    worker = run_worker(
        engine,
        lambda job_type, payload: ran.append(job_type),
        burst=True,
        queues=["first", "second"],
        polling_interval=0.05,
    )
    assert worker.summary()["succeeded"] == 3
    assert ran == ["f1", "s1", "s2"] and jobs(engine) == []


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_the_asyncio_worker_claims_its_queues_in_order(
    database: Any, engine: sa.Engine, mode: dict[str, Any]
) -> None:
    enqueue_in(engine, "bulk", "b1", "b2")
    enqueue_in(engine, "urgent", "u1")
    enqueue_in(engine, "elsewhere", "e1")
    ran: list[str] = []
    url = database.url.set(
        drivername=f"{PREFIX[database.backend]}+{ASYNC_DRIVER[database.backend]}"
    )

    async def handler(job_type: str, payload: Any) -> None:
        ran.append(job_type)

    async def main() -> sp.AsyncQueueWorker:
        async_engine = create_async_engine(url)
        try:
            worker = sp.create_async_queue_worker(
                async_engine, handler, queues=("urgent", "bulk"), polling_interval=0.05, **mode
            )
            async with worker:
                deadline = time.monotonic() + 20
                while len(ran) < 3 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            return worker
        finally:
            await async_engine.dispose()

    worker = asyncio.run(main())
    assert ran == ["u1", "b1", "b2"]
    assert worker.options.queues == ("urgent", "bulk") and worker.options.queue == "urgent"
    assert [job.job_type for job in jobs(engine)] == ["e1"]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"queues": "critical"}, "give a list of queue names"),
        ({"queues": []}, "queues is empty"),
        ({"queues": ["a", "b", "a"]}, "lists 'a' more than once"),
        ({"queues": ["a", ""]}, "is empty"),
        ({"queues": ["a", 3]}, "give a string"),
        ({"queue": "a", "queues": ["b"]}, "both queue and queues"),
    ],
)
def test_options_that_name_no_queue_a_queue_twice_or_both_forms_are_refused(
    options: dict[str, Any], says: str
) -> None:
    with pytest.raises(sp.ProletarianError, match=says):
        WorkerOptions.from_kwargs(options)


def test_queues_keeps_queue_as_the_first_and_names_the_worker_after_all(
    engine: sa.Engine,
) -> None:
    options = WorkerOptions.from_kwargs({"queues": ["x", "y"]})
    assert (options.queue, options.queues, options.worker_id) == (
        "x",
        ("x", "y"),
        "proletarian[x,y]",
    )
    single = WorkerOptions.from_kwargs({"queue": "x"})
    assert (single.queues, single.worker_id) == (("x",), "proletarian[x]")
    assert WorkerOptions().queues == (sp.DEFAULT_QUEUE,)


def test_a_retried_job_stays_in_its_own_queue(engine: sa.Engine) -> None:
    clock = FakeClock()
    enqueue_committed(engine, "flaky", queue="second", clock=clock)
    attempts: list[str] = []

    def handler(job: sp.JobContext) -> None:
        attempts.append(job.queue)
        if len(attempts) == 1:
            raise ValueError("once")

    options: dict[str, Any] = {
        "queues": ["first", "second"],
        "handler_mode": "advanced",
        "clock": clock,
        "retry_strategy": lambda job, exc: sp.RetryStrategy(1, [timedelta(seconds=5)]),
    }
    assert sp.process_next_job(engine, handler, **options)
    assert [(job.queue, job.attempts) for job in jobs(engine)] == [("second", 1)]
    clock.advance(6)
    assert sp.process_next_job(engine, handler, **options)
    assert attempts == ["second", "second"] and jobs(engine) == []
