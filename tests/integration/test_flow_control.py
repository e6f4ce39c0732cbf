"""Queue limits kept by the claims of threaded workers, in both modes, on every backend,
measured from the handlers' own start and end times (not the library's counters).

The races between worker processes are in ``test_flow_races.py``; here two workers of one
process (each with several threads, each thread its own connections) share a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived, count, events, wait_for
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session
from test_leases_asyncio import ASYNC_DRIVERNAME

import sqla_proletarian as sp
from sqla_proletarian.models import Start

MODES = {
    "transaction": {"polling_interval": 0.02},
    "lease": {"polling_interval": 0.02, "lease_seconds": 30.0},
}


@pytest.fixture(params=sorted(MODES))
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Intervals:
    """A handler that sleeps and records when it ran: (key, start, end) by the clock of the
    handler itself."""

    def __init__(self, seconds: float = 0.03) -> None:
        self.seconds = seconds
        self.lock = threading.Lock()
        self.runs: list[tuple[uuid.UUID, str | None, float, float]] = []

    def __call__(self, job: sp.JobContext) -> None:
        start = time.monotonic()
        time.sleep(self.seconds)
        key = job.payload.get("key") if isinstance(job.payload, dict) else None
        with self.lock:
            self.runs.append((job.job_id, key, start, time.monotonic()))

    def most_at_once(self, key: str | None = "*") -> int:
        """The most handlers (of ``key``; "*": any) that overlapped at one moment."""
        points = []
        for _, run_key, start, end in self.runs:
            if key == "*" or run_key == key:
                points += [(start, 1), (end, -1)]
        most = now = 0
        for _, step in sorted(points, key=lambda p: (p[0], p[1])):
            now += step
            most = max(most, now)
        return most


@contextmanager
def workers(
    database: Any, handler: Any, mode: str, number: int = 2, threads: int = 4, **options: Any
) -> Iterator[None]:
    with ExitStack() as stack:
        for _ in range(number):
            worker = sp.create_queue_worker(
                database.engine(pool_size=threads * 2 + 2),
                handler,
                handler_mode="advanced",
                worker_threads=threads,
                queues=["q"],
                **MODES[mode],
                **options,
            )
            worker.start()
            stack.callback(worker.stop)
        yield


def enqueue(engine: sa.Engine, number: int, key: str | None = None, queue: str = "q") -> list[Any]:
    with Session(engine) as session:
        ids = [
            sp.enqueue(session, "work", {"key": key, "n": n}, queue=queue, concurrency_key=key)
            for n in range(number)
        ]
        session.commit()
    return ids


def set_limits(engine: sa.Engine, queue: str = "q", **limits: Any) -> None:
    with engine.begin() as conn:
        sp.set_queue_limits(conn, queue, **limits)


def drained(engine: sa.Engine, number: int, timeout: float = 60.0) -> None:
    assert wait_for(lambda: count(engine, sp.ArchivedJob) == number, timeout=timeout), (
        f"{count(engine, sp.ArchivedJob)} of {number} jobs archived"
    )


def test_max_running_holds_across_two_workers_of_four_threads(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    set_limits(engine, max_running=2)
    enqueue(engine, 30)
    handler = Intervals()
    with workers(database, handler, mode):
        drained(engine, 30)
    assert handler.most_at_once() <= 2
    if database.backend != "sqlite":
        assert handler.most_at_once() == 2, "the limit let fewer run than it allows"
    assert len({run[0] for run in handler.runs}) == len(handler.runs) == 30
    assert {(row.status, row.attempts) for row in archived(engine)} == {("success", 1)}


def test_a_key_at_its_limit_holds_back_no_other_key(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    set_limits(engine, max_running_per_key=1)
    enqueue(engine, 24, key="A")
    enqueue(engine, 4, key="B")
    handler = Intervals()
    with workers(database, handler, mode):
        drained(engine, 28)
    assert handler.most_at_once("A") == 1
    assert handler.most_at_once("B") == 1
    if database.backend != "sqlite" or mode == "lease":
        ends = sorted((end, key) for _, key, _, end in handler.runs)
        last_b = max(index for index, (_, key) in enumerate(ends) if key == "B")
        a_before = sum(1 for _, key in ends[:last_b] if key == "A")
        assert a_before < 12, f"B's jobs waited for {a_before} of A's"


def test_a_rate_limit_holds_in_every_window_of_its_seconds(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    set_limits(engine, rate_limit=(4, 0.5))
    enqueue(engine, 14)
    handler = Intervals(0.001)
    began = time.monotonic()
    with workers(database, handler, mode):
        drained(engine, 14)
    starts = sorted(start for _, _, start, _ in handler.runs)
    for index, start in enumerate(starts):
        within = [s for s in starts[index:] if s - start < 0.5]
        assert len(within) <= 4, f"{len(within)} starts within 0.5 s of {start - began:.3f}"
    # 14 starts at 4 per half second take at least three windows.
    assert starts[-1] - starts[0] >= 1.5
    assert {(row.status, row.attempts) for row in archived(engine)} == {("success", 1)}


def test_a_batch_under_a_rate_with_room_to_spare_starts_every_handler_in_time(
    database: Any, engine: sa.Engine, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """rate_limit=(1000, 10.0), far from binding; one thread claims batches of 10 jobs of
    40 ms and runs them one after another, the last about 0.4 s after the claim: every
    handler starts (the starts made ahead count at a moment to come, and the claim's
    handlers have until just past it), none goes back unrun as too late."""
    if database.backend == "sqlite" and mode == "transaction":
        pytest.skip("SQLite in transaction mode claims one job at a time: no batch")
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    set_limits(engine, rate_limit=(1000, 10.0))
    enqueue(engine, 30)
    handler = Intervals(0.04)
    with workers(database, handler, mode, number=1, threads=1, batch_size=10):
        drained(engine, 30)
    assert events(caplog.records, "start-too-late") == []
    assert len(handler.runs) == 30
    assert {(row.status, row.attempts) for row in archived(engine)} == {("success", 1)}


def test_a_rate_limit_with_room_to_spare_reserves_for_many_claims_at_once(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    """rate_limit=(100000, 60.0), far from binding, 4 threads claiming one job at a time:
    the worker reserves starts ahead in growing pools that its threads share, so that 200
    jobs take a handful of reservations (a row of ``proletarian_start`` each, none pruned
    within the minute), not one every few claims."""
    set_limits(engine, rate_limit=(100_000, 60.0))
    enqueue(engine, 200)
    with workers(database, Intervals(0.001), mode, number=1):
        drained(engine, 200)
    assert count(engine, Start) <= 12


def test_a_rate_limit_per_key_counts_each_key_apart(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    # A window of two seconds: on a loaded machine (a CI run's shared cores stalled a claim
    # for over a second) the other key's first claim still comes well within it.
    set_limits(engine, rate_limit_per_key=(2, 2.0))
    enqueue(engine, 6, key="A")
    enqueue(engine, 6, key="B")
    handler = Intervals(0.001)
    with workers(database, handler, mode):
        drained(engine, 12)
    for key in "AB":
        starts = sorted(start for _, run_key, start, _ in handler.runs if run_key == key)
        for index, start in enumerate(starts):
            assert len([s for s in starts[index:] if s - start < 2.0]) <= 2, key
    # Neither key waits for the other's windows: each key's first start comes before the
    # other's third, which its own limit holds at least two seconds after its first.
    firsts = {k: sorted(s for _, key, s, _ in handler.runs if key == k) for k in "AB"}
    assert firsts["B"][0] < firsts["A"][2] and firsts["A"][0] < firsts["B"][2], firsts


def first_claim_too_late(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The first claimed job of a rate-limited queue is found too late to start, as on an
    overloaded machine (both modes); the list returned gets an item when it was."""
    from sqla_proletarian import execution, flow, leases

    late: list[bool] = []

    def first_too_late(job: dict[str, Any], now: Any) -> bool:
        if not late:
            late.append(True)
            return True
        return flow.too_late(job, now)

    monkeypatch.setattr(execution, "too_late", first_too_late)
    monkeypatch.setattr(leases, "too_late", first_too_late)
    return late


@pytest.mark.parametrize("rate", ["rate_limit", "rate_limit_per_key"])
def test_a_run_given_back_too_late_to_start_gives_its_counted_start_back(
    database: Any,
    engine: sa.Engine,
    mode: str,
    rate: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker too slow to start a rate-limited job in time (here: its first claim's job,
    found too late) gives the job back unrun, and the start its window counted for it too:
    the job runs at the next claim, not once the window (a minute) has passed."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    late = first_claim_too_late(monkeypatch)
    set_limits(engine, **{rate: (1, 60.0)})
    enqueue(engine, 1, key="A")
    handler = Intervals(0.001)
    with workers(database, handler, mode, number=1, threads=1):
        drained(engine, 1, timeout=15.0)
    assert late == [True]
    assert len(events(caplog.records, "start-too-late")) == 1
    assert len(handler.runs) == 1
    assert {(row.status, row.attempts) for row in archived(engine)} == {("success", 1)}


def test_limits_set_and_cleared_while_workers_run_take_effect_at_the_next_claims(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    handler = Intervals(0.05)
    with workers(database, handler, mode, number=1):
        enqueue(engine, 4)
        drained(engine, 4)
        set_limits(engine, max_running=1)
        handler.runs.clear()
        enqueue(engine, 8)
        drained(engine, 12)
        assert handler.most_at_once() == 1
        with engine.begin() as conn:
            assert sp.clear_queue_limits(conn, "q")
        handler.runs.clear()
        enqueue(engine, 8)
        drained(engine, 20)
    if database.backend != "sqlite" or mode == "lease":
        assert handler.most_at_once() > 1, "the cleared limit still held"


def test_queue_limits_are_read_back_set_whole_and_refused_when_bad(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        sp.set_queue_limits(conn, "a", max_running=3, rate_limit=(10, 1))
        sp.set_queue_limits(conn, "b", max_running_per_key=1)
        sp.set_queue_limits(conn, "b", rate_limit_per_key=(5, 60))
    limits = sp.queue_limits(engine)
    assert limits == {
        "a": sp.QueueLimits(max_running=3, rate_limit=(10, 1.0)),
        "b": sp.QueueLimits(rate_limit_per_key=(5, 60.0)),
    }
    assert limits["a"].describe() == "max_running=3 rate_limit=10/1s"
    for bad in (
        {"max_running": 0},
        {"max_running": True},
        {"max_running_per_key": 10_001},
        {"rate_limit": (5, 0)},
        {"rate_limit": (5, float("nan"))},
        {"rate_limit": 5},
        {"rate_limit_per_key": (0, 1)},
    ):
        with pytest.raises(sp.ConfigurationError), engine.begin() as conn:
            sp.set_queue_limits(conn, "a", **bad)
    assert sp.queue_limits(engine)["a"] == limits["a"]
    with engine.begin() as conn:
        sp.set_queue_limits(conn, "a")  # all None: no limits
        assert not sp.clear_queue_limits(conn, "a")
    assert set(sp.queue_limits(engine)) == {"b"}
    with pytest.raises(sp.InvalidJobError, match="concurrency_key"), Session(engine) as session:
        sp.enqueue(session, "work", concurrency_key="")


def test_the_asyncio_workers_claims_keep_max_running_and_the_per_key_limit(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    """Two asyncio workers of eight tasks each: at most two jobs run, one of each key."""
    set_limits(engine, max_running=2, max_running_per_key=1)
    enqueue(engine, 8, key="A")
    enqueue(engine, 8, key="B")
    runs: list[tuple[str, float, float]] = []

    async def handler(job: sp.AsyncJobContext) -> None:
        start = time.monotonic()
        await asyncio.sleep(0.03)
        runs.append((job.payload["key"], start, time.monotonic()))

    async def main() -> None:
        url = database.url.set(drivername=ASYNC_DRIVERNAME[database.backend])
        engines = [create_async_engine(url) for _ in range(2)]
        try:
            async with contextlib.AsyncExitStack() as stack:
                for async_engine in engines:
                    worker = sp.create_async_queue_worker(
                        async_engine,
                        handler,
                        handler_mode="advanced",
                        concurrency=8,
                        queues=["q"],
                        **MODES[mode],
                    )
                    await stack.enter_async_context(worker)
                deadline = time.monotonic() + 60
                while await asyncio.to_thread(count, engine, sp.ArchivedJob) < 16:
                    assert time.monotonic() < deadline, "the jobs were not all archived"
                    await asyncio.sleep(0.05)
        finally:
            for async_engine in engines:
                await async_engine.dispose()

    asyncio.run(main())
    recorded = Intervals()
    recorded.runs = [(uuid.uuid4(), key, start, end) for key, start, end in runs]
    assert len(runs) == 16
    assert recorded.most_at_once() <= 2
    assert recorded.most_at_once("A") == recorded.most_at_once("B") == 1


def test_process_next_job_found_too_late_gives_its_start_back_before_it_returns(
    engine: sa.Engine, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner of one claim whose job is found too late to start (an overloaded machine)
    gives the start back before it returns: it has no next reservation to do it, and the
    window (two starts a minute) still lets two more calls run a job each."""
    late = first_claim_too_late(monkeypatch)
    set_limits(engine, rate_limit=(2, 60.0))
    enqueue(engine, 3)
    ran: list[Any] = []
    options: dict[str, Any] = {"lease_seconds": 30.0} if mode == "lease" else {}
    for _ in range(3):
        sp.process_next_job(engine, lambda t, p: ran.append(p), queue="q", **options)
    assert late == [True]
    assert len(ran) == 2, "the start counted for the run found too late was not given back"
    assert count(engine, sp.Job) == 1


def test_process_next_job_claims_from_a_limited_queue_within_its_limits(
    engine: sa.Engine, mode: str
) -> None:
    """A runner of one claim reads the limits first: it claims a limited queue's jobs, and a
    rate limit holds it back once the window is full."""
    set_limits(engine, max_running=1, rate_limit=(2, 60.0))
    enqueue(engine, 3)
    ran: list[Any] = []
    options: dict[str, Any] = {"lease_seconds": 30.0} if mode == "lease" else {}
    for _ in range(3):
        sp.process_next_job(engine, lambda t, p: ran.append(p), queue="q", **options)
    assert len(ran) == 2, "the rate limit's window of a minute holds two starts"
    assert count(engine, sp.Job) == 1
