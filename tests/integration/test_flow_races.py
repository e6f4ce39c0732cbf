"""Queue limits kept by real worker processes racing for one queue, proved from the handlers'
own start and end times (``programs/flow_tasks.py`` notes them), not from the library's
counters: ``max_running`` across processes, ``max_running_per_key`` with a few jobs of one
key overtaking a long run of another's, a sliding-window ``rate_limit``, and a lease-mode
worker frozen past its lease; on every backend, in transaction and lease mode. Jobs held
back are never failed or charged an attempt."""

from __future__ import annotations

import os
import signal
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import archived, jobs, wait_for
from process_helpers import DRAIN_TIMEOUT, LEASE, MODES, QUEUE, Run, Workers

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database


@pytest.fixture(params=list(MODES))
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def workers(database: Database, tmp_path: Path) -> Iterator[Workers]:
    started = Workers(database, tmp_path)
    try:
        yield started
    finally:
        started.kill_all()


def set_limits(engine: sa.Engine, **limits: Any) -> None:
    with engine.begin() as conn:
        sp.set_queue_limits(conn, QUEUE, **limits)


def enqueue(
    engine: sa.Engine, count: int, seconds: float, key: str | None = None
) -> list[uuid.UUID]:
    """``count`` jobs that sleep ``seconds``, of ``key``, committed in one transaction."""
    payload = {"seconds": seconds, "key": key}
    with engine.begin() as conn:
        return sp.enqueue_many(conn, [("sleep", payload)] * count, queue=QUEUE, concurrency_key=key)


def drain(engine: sa.Engine, workers: Workers, count: int) -> list[Run]:
    """Wait until ``count`` jobs are archived, stop the workers (which count them all as
    succeeded, none retried or failed): the handlers' runs."""
    assert wait_for(lambda: len(archived(engine)) >= count, DRAIN_TIMEOUT, 0.1), (
        f"{len(archived(engine))} of {count} jobs archived"
    )
    assert workers.stop() == count
    return workers.runs()


def most_at_once(runs: list[Run]) -> int:
    """The most runs going at one instant (a run that ends as another starts is not with
    it)."""
    edges = sorted([(run.start, 1) for run in runs] + [(run.end, -1) for run in runs])
    going = peak = 0
    for _, step in edges:
        going += step
        peak = max(peak, going)
    return peak


def timeline(runs: list[Run]) -> str:
    """The runs, times from the first start, for a failure's message."""
    zero = min(run.start for run in runs)
    return "\n".join(
        f"{run.start - zero:8.3f} {run.end - zero:8.3f} {run.key} pid={run.pid} {run.job_id}"
        for run in runs
    )


def assert_each_ran_once(runs: list[Run], job_ids: list[uuid.UUID]) -> None:
    counts = Counter(run.job_id for run in runs)
    assert sorted(counts) == sorted(job_ids), timeline(runs)
    assert set(counts.values()) == {1}, timeline(runs)


def assert_archived_once_each_uncharged(engine: sa.Engine, job_ids: list[uuid.UUID]) -> None:
    """Every job left the queue archived once as a success at its first attempt: holding a
    job back neither failed it nor charged it an attempt."""
    done = archived(engine)
    assert sorted(row.job_id for row in done) == sorted(job_ids)
    assert {(row.status, row.attempts) for row in done} == {("success", 1)}, [
        (row.job_id, row.status, row.attempts, row.error) for row in done
    ]
    assert jobs(engine) == []


def test_max_running_holds_across_three_worker_processes_of_four_threads(
    database: Database, engine: sa.Engine, workers: Workers, mode: str
) -> None:
    """max_running=2 with 12 threads in 3 processes racing for 40 jobs of 50 ms: no two
    handlers' intervals are ever joined by a third, every job runs once, and on the servers
    (which run jobs side by side) the limit is reached: 2 run at once."""
    set_limits(engine, max_running=2)
    for _ in range(3):
        workers.start("--threads", "4", *MODES[mode])
    job_ids = enqueue(engine, 40, 0.05)
    runs = drain(engine, workers, 40)

    assert_each_ran_once(runs, job_ids)
    peak = most_at_once(runs)
    assert peak <= 2, timeline(runs)
    if database.backend != "sqlite":
        assert peak == 2, f"never 2 at once, the limit held them back further:\n{timeline(runs)}"
    assert_archived_once_each_uncharged(engine, job_ids)


def test_max_running_per_key_runs_one_of_each_key_and_lets_another_key_overtake(
    database: Database, engine: sa.Engine, workers: Workers, mode: str
) -> None:
    """max_running_per_key=1: 30 jobs of key A enqueued before 5 of key B, 6 threads in 2
    processes. A's jobs never overlap one another, nor B's; and B's jobs are not stuck
    behind A's (the claim skips a key whose slots are taken): all of B's finish before half
    of A's have. On SQLite in transaction mode jobs run one at a time per file whatever the
    limits, so only the one-at-a-time part is asked there."""
    set_limits(engine, max_running_per_key=1)
    for _ in range(2):
        workers.start("--threads", "3", *MODES[mode])
    a_ids = enqueue(engine, 30, 0.08, key="A")
    b_ids = enqueue(engine, 5, 0.08, key="B")
    runs = drain(engine, workers, 35)

    assert_each_ran_once(runs, a_ids + b_ids)
    a_runs = [run for run in runs if run.key == "A"]
    b_runs = [run for run in runs if run.key == "B"]
    assert sorted(run.job_id for run in b_runs) == sorted(b_ids)
    assert most_at_once(a_runs) == 1, timeline(runs)
    assert most_at_once(b_runs) == 1, timeline(runs)
    if not (database.backend == "sqlite" and mode == "transaction"):
        a_ends = sorted(run.end for run in a_runs)
        assert max(run.end for run in b_runs) < a_ends[len(a_ends) // 2 - 1], timeline(runs)
    assert_archived_once_each_uncharged(engine, a_ids + b_ids)


def test_rate_limit_lets_no_window_of_its_seconds_hold_more_starts_than_its_count(
    engine: sa.Engine, workers: Workers, mode: str
) -> None:
    """rate_limit=(5, 1.0), 20 jobs, 8 threads in 2 processes: in the 1 s window from any
    handler's start at most 5 handlers start (a sliding window over the handlers' own start
    times, with no allowance: ``time.time()`` on one machine is finer than a microsecond,
    and the limit has its own margin for the gap between a claim and its handler's start),
    so the 20 starts take more than 3 s; every job runs once."""
    set_limits(engine, rate_limit=(5, 1.0))
    for _ in range(2):
        workers.start("--threads", "4", *MODES[mode])
    job_ids = enqueue(engine, 20, 0.01)
    runs = drain(engine, workers, 20)

    assert_each_ran_once(runs, job_ids)
    starts = [run.start for run in runs]
    crowded = [
        f"from {first - starts[0]:.3f}: 6 starts in {starts[i + 5] - first:.3f} s"
        for i, first in enumerate(starts[:-5])
        if starts[i + 5] - first < 1.0
    ]
    assert not crowded, "\n".join([*crowded, timeline(runs)])
    assert starts[-1] - starts[0] > 3.0, timeline(runs)
    assert_archived_once_each_uncharged(engine, job_ids)


def test_held_back_jobs_are_neither_failed_nor_charged_an_attempt(
    engine: sa.Engine, workers: Workers, mode: str
) -> None:
    """max_running=1 and rate_limit=(6, 1.0) with 8 threads in 2 processes: 12 jobs of
    50 ms wait their turn, one at a time and the second six a second after the first six,
    while seven threads find only held-back jobs (or no start left in the window) at each
    poll; yet the workers count 12 successes, no retry, no failure, and every job is
    archived as a success at attempt 1."""
    set_limits(engine, max_running=1, rate_limit=(6, 1.0))
    for _ in range(2):
        workers.start("--threads", "4", *MODES[mode])
    job_ids = enqueue(engine, 12, 0.05)
    runs = drain(engine, workers, 12)

    assert most_at_once(runs) == 1, timeline(runs)
    assert runs[6].start - runs[0].start >= 1.0, timeline(runs)
    assert_each_ran_once(runs, job_ids)
    assert_archived_once_each_uncharged(engine, job_ids)


def test_a_worker_frozen_past_its_lease_gives_its_slot_to_another_and_takes_no_second(
    engine: sa.Engine, workers: Workers
) -> None:
    """Lease mode, max_running=1, 2 s leases. Worker A starts a 4 s job and is frozen
    (SIGSTOP); worker B starts, and once A's lease has expired B takes the job over in its
    slot; A is resumed (SIGCONT) while B runs it, and more jobs come, for which A and B race.
    From the handlers' intervals: never 3 at once; at most 2, and only while A's frozen run
    lasts (the one that lost its slot beside the one that took it): leaving that run out,
    never 2 at once, so A, awake, starts nothing while B holds the slot. Every job is
    archived once as a success; the frozen job counts its two runs."""
    set_limits(engine, max_running=1)
    # One thread: frozen in its handler, it holds no lock (a thread frozen in a claim could
    # hold one that keeps the other worker waiting).
    frozen = workers.start("--threads", "1", *LEASE)
    [long_id] = enqueue(engine, 1, 4.0)
    assert wait_for(lambda: workers.started(frozen) == [long_id], 30)
    os.kill(frozen.pid, signal.SIGSTOP)
    short_ids = enqueue(engine, 6, 0.1)
    taker = workers.start("--threads", "2", *LEASE)
    try:
        assert wait_for(lambda: long_id in workers.started(taker), 30), workers.notes()
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    short_ids += enqueue(engine, 4, 0.1)
    assert wait_for(lambda: len(archived(engine)) == 11, DRAIN_TIMEOUT, 0.1), workers.notes()
    for process in workers.processes:  # a graceful stop: any handler going ends first
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    runs = workers.runs()

    stale = [run for run in runs if run.pid == frozen.pid and run.job_id == long_id]
    assert len(stale) == 1, timeline(runs)
    assert stale[0].end - stale[0].start >= 4.0, timeline(runs)
    assert most_at_once(runs) <= 2, timeline(runs)
    live = [run for run in runs if run not in stale]
    assert most_at_once(live) == 1, timeline(runs)
    assert sorted(run.job_id for run in live) == sorted([long_id, *short_ids]), timeline(runs)

    done = {row.job_id: row for row in archived(engine)}
    assert sorted(done) == sorted([long_id, *short_ids])
    assert {row.status for row in done.values()} == {"success"}
    assert done[long_id].attempts == 2
    assert {done[job_id].attempts for job_id in short_ids} == {1}
    assert jobs(engine) == []
