"""Tasks (``JobHandlers.task``): a function enqueued with its own arguments, checked against
its signature at enqueue, run by either worker in either handler mode and either run mode,
with its own enqueue options, retry strategy and lease-mode timeout."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import T0, archived, archived_job, jobs, running, wait_for
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian.testing import drain as drain_for_tests

ASYNC_DRIVERNAME = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+psycopg",
    "mariadb": "mysql+aiomysql",
}
#: The two run modes: transaction mode, and lease mode.
MODES = {"transaction": {}, "lease": {"lease_seconds": 60.0}}
SHORT_LEASE = {"lease_seconds": 2.0, "heartbeat_interval": 0.1, "polling_interval": 0.02}


def committed(engine: sa.Engine, enqueue: Callable[[Session], Any]) -> Any:
    """What ``enqueue`` returned, in a Session transaction that commits."""
    with Session(engine) as session:
        made = enqueue(session)
        session.commit()
    return made


def drain(engine: sa.Engine, handler: Any, **options: Any) -> int:
    runs = 0
    while sp.process_next_job(engine, handler, **options):
        runs += 1
    return runs


def run_async_worker(
    database: Any, handler: Any, until: Callable[[], bool], **options: Any
) -> None:
    """Run the asyncio worker on the test's database until ``until()`` holds."""

    async def main() -> None:
        url = database.url.set(drivername=ASYNC_DRIVERNAME[database.backend])
        engine = create_async_engine(url)
        try:
            async with sp.create_async_queue_worker(
                engine, handler, **{"polling_interval": 0.02, **options}
            ):
                deadline = time.monotonic() + 15
                while not await asyncio.to_thread(until):
                    assert time.monotonic() < deadline, "the jobs did not run in time"
                    await asyncio.sleep(0.02)
        finally:
            await engine.dispose()

    asyncio.run(main())


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("handler_mode", ["default", "advanced"])
def test_a_task_runs_with_the_arguments_it_was_enqueued_with(
    engine: sa.Engine, mode: str, handler_mode: str
) -> None:
    handlers = sp.JobHandlers()
    calls: list[tuple[Any, ...]] = []

    @handlers.task("send-email")
    def send_email(to: str, subject: str = "hi", *, cc: list[str] | None = None) -> None:
        calls.append((to, subject, cc))

    committed(engine, lambda s: send_email.enqueue(s, "ada@example.com", cc=["bob"]))
    committed(engine, lambda s: send_email.enqueue(s, to="cy@example.com", subject="yo"))
    assert drain(engine, handlers, handler_mode=handler_mode, **MODES[mode]) == 2
    assert sorted(calls) == [("ada@example.com", "hi", ["bob"]), ("cy@example.com", "yo", None)]
    assert {job.status for job in archived(engine)} == {"success"}


def test_a_task_is_still_the_function_and_its_job_type_defaults_to_module_and_qualname(
    engine: sa.Engine,
) -> None:
    handlers = sp.JobHandlers()

    @handlers.task
    def double(n: int) -> int:
        """Twice n."""
        return 2 * n

    @handlers.task()
    def triple(n: int) -> int:
        return 3 * n

    assert isinstance(double, sp.Task)
    assert double(21) == 42 and triple(2) == 6
    assert double.__doc__ == "Twice n." and double.__name__ == "double"
    assert double.job_type == f"{__name__}.{double.__qualname__}"
    assert double.job_type.endswith(
        "test_a_task_is_still_the_function_and_its_job_type_"
        "defaults_to_module_and_qualname.<locals>.double"
    )
    job_id = committed(engine, lambda s: double.enqueue(s, 4))
    [job] = jobs(engine)
    assert (job.job_id, job.job_type, json.loads(job.payload)) == (
        job_id,
        double.job_type,
        {"args": [4], "kwargs": {}},
    )
    with pytest.raises(sp.ConfigurationError, match="already has a handler"):
        handlers.register(double.job_type)(lambda job_type, payload: None)


def test_enqueue_refuses_missing_unknown_and_extra_arguments_naming_them(
    engine: sa.Engine,
) -> None:
    handlers = sp.JobHandlers()

    @handlers.task("charge")
    def charge(account: str, cents: int) -> None: ...

    bad: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
        (("acct-1",), {}, "'cents'"),
        (("acct-1", 5), {"currency": "EUR"}, "'currency'"),
        (("acct-1", 5, 6), {}, "too many positional arguments"),
    ]
    with Session(engine) as session:
        for args, kwargs, named in bad:
            with pytest.raises(sp.InvalidJobError, match=named) as refused:
                charge.enqueue(session, *args, **kwargs)
            assert "charge" in str(refused.value)
        session.commit()
    assert jobs(engine) == []


def test_enqueue_joins_the_callers_transaction_and_never_commits(engine: sa.Engine) -> None:
    handlers = sp.JobHandlers()

    @handlers.task("note")
    def note(text: str) -> None: ...

    with Session(engine) as session:
        note.enqueue(session, "rolled back")
        session.rollback()
    with engine.connect() as conn:
        note.enqueue(conn, "never committed")
    assert jobs(engine) == []
    with engine.begin() as conn:
        job_id = note.enqueue(conn, "kept")
    assert [j.job_id for j in jobs(engine)] == [job_id]


def test_with_options_overrides_the_tasks_defaults_even_for_same_named_parameters(
    engine: sa.Engine,
) -> None:
    """The task's own parameters are called queue and priority: enqueue passes them to the
    function, with_options sets the job's; the task's defaults stay as they were, and a
    later with_options keeps the earlier's but for what it gives (a due time replaces the
    other kind)."""
    handlers = sp.JobHandlers()

    @handlers.task("route", queue="mail", priority=3, concurrency_key="tenant-1")
    def route(queue: str, priority: int) -> None: ...

    plain = committed(engine, lambda s: route.enqueue(s, "q-arg", priority=7))
    later = route.with_options(
        queue="slow",
        priority=-5,
        process_in=timedelta(seconds=30),
        unique_key="route-once",
        concurrency_key=None,
    )
    assert later.job_type == route.job_type and later.fn is route.fn
    other = committed(engine, lambda s: later.enqueue(s, "q", 1))
    again = committed(engine, lambda s: later.enqueue(s, "q", 2))
    at_t0 = later.with_options(process_at=T0, unique_key=None)  # replaces process_in
    at = committed(engine, lambda s: at_t0.enqueue(s, "q", 3))
    rows = {job.job_id: job for job in jobs(engine)}
    assert again == other, "the unique key was taken by the first job"
    assert len(rows) == 3
    first, second, third = rows[plain], rows[other], rows[at]
    assert (first.queue, first.priority, first.concurrency_key, first.unique_key) == (
        "mail",
        3,
        "tenant-1",
        None,
    )
    assert json.loads(first.payload) == {"args": ["q-arg"], "kwargs": {"priority": 7}}
    assert (second.queue, second.priority, second.concurrency_key, second.unique_key) == (
        "slow",
        -5,
        None,
        "route-once",
    )
    assert second.process_at - second.enqueued_at == timedelta(seconds=30)
    assert (third.queue, third.priority, third.unique_key, third.process_at) == (
        "slow",
        -5,
        None,
        T0,
    )
    with pytest.raises(sp.InvalidJobError, match="depends_on: item 0, 'not-an-id'"):
        route.with_options(depends_on=["not-an-id"])


def test_keys_may_be_functions_of_the_tasks_arguments(engine: sa.Engine) -> None:
    handlers = sp.JobHandlers()

    @handlers.task(
        "sync-user",
        unique_key=lambda user_id, full=False: f"sync-{user_id}",
        concurrency_key=lambda user_id, full=False: "full" if full else None,
    )
    def sync_user(user_id: int, full: bool = False) -> None: ...

    first = committed(engine, lambda s: sync_user.enqueue(s, 7))
    assert committed(engine, lambda s: sync_user.enqueue(s, 7, full=True)) == first
    other = committed(engine, lambda s: sync_user.enqueue(s, user_id=8, full=True))
    rows = {job.job_id: job for job in jobs(engine)}
    assert (rows[first].unique_key, rows[first].concurrency_key) == ("sync-7", None)
    assert (rows[other].unique_key, rows[other].concurrency_key) == ("sync-8", "full")

    @handlers.task("bad-key", unique_key=lambda n: n)
    def bad_key(n: int) -> None: ...

    with Session(engine) as session, pytest.raises(sp.InvalidJobError, match="unique_key"):
        bad_key.enqueue(session, 5)


def test_enqueue_many_checks_every_call_first_then_adds_them_in_order(
    engine: sa.Engine,
) -> None:
    handlers = sp.JobHandlers()
    seen: list[tuple[str, int]] = []

    @handlers.task("resize", concurrency_key=lambda path, width=100: path.split("/")[0])
    def resize(path: str, width: int = 100) -> None:
        seen.append((path, width))

    calls: list[tuple[Any, ...] | dict[str, Any]] = [
        ("a/1.png",),
        {"path": "b/2.png", "width": 50},
        ("a/3.png", 20),
    ]
    with Session(engine) as session:
        with pytest.raises(sp.InvalidJobError, match=r"calls\[3\].*'height'"):
            resize.enqueue_many(session, [*calls, {"path": "c/4.png", "height": 5}])
        with pytest.raises(sp.InvalidJobError, match=r"calls\[1\]"):
            resize.enqueue_many(session, [("a/1.png",), "b/2.png"])  # type: ignore[list-item]
        session.flush()
        assert jobs(engine) == []
        ids = resize.enqueue_many(session, calls)
        session.commit()
    rows = {job.job_id: job for job in jobs(engine)}
    assert [(json.loads(rows[i].payload), rows[i].concurrency_key) for i in ids] == [
        ({"args": ["a/1.png"], "kwargs": {}}, "a"),
        ({"args": [], "kwargs": {"path": "b/2.png", "width": 50}}, "b"),
        ({"args": ["a/3.png", 20], "kwargs": {}}, "a"),
    ]
    assert drain(engine, handlers) == 3
    assert sorted(seen) == [("a/1.png", 100), ("a/3.png", 20), ("b/2.png", 50)]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("handler_mode", ["default", "advanced"])
def test_async_tasks_run_in_the_asyncio_worker(database: Any, mode: str, handler_mode: str) -> None:
    engine = database.engine()
    handlers = sp.JobHandlers()
    done: list[tuple[int, str]] = []

    @handlers.task("fetch")
    async def fetch(n: int, *, label: str) -> None:
        await asyncio.sleep(0)
        done.append((n, label))

    committed(engine, lambda s: [fetch.enqueue(s, n, label=f"l{n}") for n in (1, 2)])
    run_async_worker(
        database,
        handlers,
        lambda: len(archived(engine)) == 2,
        handler_mode=handler_mode,
        **MODES[mode],
    )
    assert sorted(done) == [(1, "l1"), (2, "l2")]
    assert {job.status for job in archived(engine)} == {"success"}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_tasks_retry_replaces_the_workers_retry_strategy_for_its_job_type(
    engine: sa.Engine, mode: str
) -> None:
    """The worker retries nothing; the task's strategy retries its jobs twice, by a strategy
    object or a function of (job, exception); another job type still fails at once."""
    handlers = sp.JobHandlers()
    runs: list[str] = []

    @handlers.task("flaky", retry=sp.RetryStrategy(2))
    def flaky() -> None:
        runs.append("flaky")
        raise RuntimeError("flaky")

    @handlers.task("picky", retry=lambda job, exc: sp.RetryStrategy(1) if job.attempts else None)
    def picky() -> None:
        runs.append("picky")
        raise RuntimeError("picky")

    @handlers.register("plain")
    def plain(job_type: str, payload: Any) -> None:
        runs.append("plain")
        raise RuntimeError("plain")

    committed(engine, lambda s: (flaky.enqueue(s), picky.enqueue(s), sp.enqueue(s, "plain")))
    drain(engine, handlers, retry_strategy=lambda job, exc: None, **MODES[mode])
    assert sorted(runs) == ["flaky"] * 3 + ["picky"] * 2 + ["plain"]
    assert {(job.job_type, job.status, job.attempts) for job in archived(engine)} == {
        ("flaky", "failure", 3),
        ("picky", "failure", 2),
        ("plain", "failure", 1),
    }


def test_testing_drain_keeps_a_tasks_retry_and_refuses_its_timeout_without_a_lease(
    engine: sa.Engine,
) -> None:
    handlers = sp.JobHandlers()
    runs: list[int] = []

    @handlers.task("flaky", retry=sp.RetryStrategy(1))
    def flaky() -> None:
        runs.append(1)
        raise RuntimeError("flaky")

    committed(engine, flaky.enqueue)
    assert drain_for_tests(engine, handlers) == 2
    assert runs == [1, 1]

    @handlers.task("slow", timeout=5)
    def slow() -> None: ...

    with pytest.raises(sp.ConfigurationError, match="lease_seconds"):
        drain_for_tests(engine, handlers)


def test_a_tasks_retry_applies_in_the_asyncio_worker(database: Any) -> None:
    engine = database.engine()
    handlers = sp.JobHandlers()
    runs: list[int] = []

    async def strategy(job: sp.AsyncJobContext, exc: Exception) -> sp.RetryStrategy:
        assert isinstance(job, sp.AsyncJobContext)
        return sp.RetryStrategy(1)

    @handlers.task("flaky", retry=strategy)
    async def flaky() -> None:
        runs.append(1)
        raise RuntimeError("flaky")

    committed(engine, flaky.enqueue)
    run_async_worker(database, handlers, lambda: len(archived(engine)) == 1)
    assert runs == [1, 1]
    [job] = archived(engine)
    assert (job.status, job.attempts) == ("failure", 2)


def test_a_tasks_timeout_times_out_its_runs_in_lease_mode_without_job_timeout(
    engine: sa.Engine,
) -> None:
    """The worker has no job_timeout: the task's timeout alone makes the heartbeat fail a
    run past it (JobTimeoutError); another job type's run of the same length is not."""
    handlers = sp.JobHandlers()
    stopped: list[bool] = []

    @handlers.task("slow", timeout=0.3)
    def slow() -> None:
        job = sp.current_job()
        stopped.append(job.cancel_requested.wait(10))

    @handlers.task("patient")
    def patient() -> None:
        time.sleep(0.6)

    slow_id = committed(engine, slow.enqueue)
    patient_id = committed(engine, patient.enqueue)
    worker = sp.create_queue_worker(engine, handlers, worker_threads=2, **SHORT_LEASE)
    with running(worker):
        assert wait_for(lambda: len(archived(engine)) == 2, timeout=15)
    assert stopped == [True]
    timed_out = archived_job(engine, slow_id)
    assert timed_out is not None and timed_out.status == "failure"
    assert timed_out.error is not None and "JobTimeoutError" in timed_out.error
    finished = archived_job(engine, patient_id)
    assert finished is not None and finished.status == "success"


def test_a_tasks_timeout_cancels_its_async_run_in_lease_mode(database: Any) -> None:
    engine = database.engine()
    handlers = sp.JobHandlers()
    cancelled: list[bool] = []

    @handlers.task("slow", timeout=0.3)
    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    job_id = committed(engine, slow.enqueue)
    run_async_worker(database, handlers, lambda: len(archived(engine)) == 1, **SHORT_LEASE)
    assert cancelled == [True]
    done = archived_job(engine, job_id)
    assert done is not None and done.status == "failure"
    assert done.error is not None and "JobTimeoutError" in done.error


def test_a_task_with_a_timeout_is_refused_by_a_worker_without_a_lease(database: Any) -> None:
    engine = database.engine()
    handlers = sp.JobHandlers()

    @handlers.task("slow", timeout=5)
    def slow() -> None: ...

    for make in (sp.create_queue_worker, sp.process_next_job):
        with pytest.raises(sp.ConfigurationError, match="lease_seconds") as refused:
            make(engine, handlers)
        assert "'slow'" in str(refused.value) and "timeout" in str(refused.value)

    async def make_async() -> None:
        url = database.url.set(drivername=ASYNC_DRIVERNAME[database.backend])
        async_engine = create_async_engine(url)
        try:
            with pytest.raises(sp.ConfigurationError, match="lease_seconds"):
                sp.create_async_queue_worker(async_engine, handlers)
        finally:
            await async_engine.dispose()

    asyncio.run(make_async())


def test_task_settings_are_checked_when_the_task_is_made() -> None:
    handlers = sp.JobHandlers()
    bad: list[tuple[dict[str, Any], str]] = [
        ({"timeout": 0}, "timeout"),
        ({"timeout": float("inf")}, "timeout"),
        ({"retry": 3}, "retry"),
        ({"queue": ""}, "queue"),
        ({"priority": "high"}, "priority"),
        ({"unique_key": 5}, "unique_key"),
    ]
    for options, named in bad:
        with pytest.raises(sp.ProletarianError, match=named):
            handlers.task("t", **options)(lambda: None)
    assert "t" not in handlers
