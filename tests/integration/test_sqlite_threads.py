"""SQLite with several worker threads: one job at a time, and no phantom unclean ends."""

from __future__ import annotations

import logging
import time

import pytest
import sqlalchemy as sa

import sqla_proletarian as sp

JOBS = 300


def test_threads_sharing_a_sqlite_file_run_each_job_once_and_count_no_unclean_end(
    engine: sa.Engine, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Four threads on one SQLite file: every job runs once, and no job is taken for one
    whose run ended uncleanly (a thread claiming between another's run record and its
    re-claim would count one)."""
    if backend != "sqlite":
        pytest.skip("the run-record re-claim race is SQLite's (one connection per claim)")
    with engine.begin() as conn:
        for n in range(JOBS):
            sp.enqueue(conn, "n", n)
    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    ran: list[int] = []
    with sp.create_queue_worker(
        engine,
        lambda job_type, payload: ran.append(payload),
        worker_threads=4,
        polling_interval=0.01,
    ) as worker:
        deadline = time.monotonic() + 60
        while worker.summary()["succeeded"] < JOBS and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sorted(ran) == list(range(JOBS))
    with engine.connect() as conn:
        attempts = conn.execute(sa.select(sp.ArchivedJob.attempts)).scalars().all()
    assert sorted(set(attempts)) == [1]
    assert not [r for r in caplog.records if getattr(r, "event", "") == "job-interrupted"]
