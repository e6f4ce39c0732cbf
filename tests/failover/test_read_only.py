"""A worker pointed at a read-only server (a standby, reached without
target_session_attrs=read-write) says so in one clear line, not once per poll, keeps
retrying, fails no job, and runs the jobs once the server takes writes (here: once the
standby is promoted)."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
import sqlalchemy as sa
from failover_helpers import MODES, Pair, Runs, archive, enqueue, events, wait_until
from sqlalchemy.ext.asyncio import create_async_engine
from test_failover import wait_async

import sqla_proletarian as sp
from sqla_proletarian import logs


@pytest.mark.parametrize("mode", MODES)
def test_a_worker_on_a_standby_says_so_once_fails_no_job_and_runs_them_once_it_can_write(
    pair: Pair, mode: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An outage's follow-up lines every 0.2 s instead of every 30 s: a read-only server is
    # no outage, and still gets its one line.
    monkeypatch.setattr(logs, "OUTAGE_REPORT_INTERVAL", 0.2)
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    ids = enqueue(pair.engine("primary"), 20)
    pair.replayed()  # the jobs can be seen on the standby
    runs = Runs()
    worker = sp.create_queue_worker(
        pair.engine("standby"),
        runs,
        handler_mode="advanced",
        worker_threads=2,
        polling_interval=0.05,
        worker_id="on-standby",
        **MODES[mode],
    )
    with worker:
        # Polls refused one after the other (the pollers' count of failed attempts).
        outage = worker._polling.outage
        wait_until(lambda: outage.attempts >= 6, "six polls were refused", worker)
        assert len(runs) == 0
        warnings = [
            record
            for record in caplog.records
            if record.levelno >= logging.WARNING and record.name.startswith("sqla_proletarian")
        ]
        assert [record.event for record in warnings] == ["database-read-only"]  # type: ignore[attr-defined]
        line = warnings[0]
        assert "read-only transaction" in line.error  # type: ignore[attr-defined]
        assert "target_session_attrs=read-write" in line.hint  # type: ignore[attr-defined]
        assert "primary" in line.hint  # type: ignore[attr-defined]

        pair.failover()
        check = pair.engine("standby", poolclass=sa.pool.NullPool)
        wait_until(lambda: len(archive(check)) == 20, "every job is archived", worker)
        assert worker.running

    rows = archive(check)
    assert sorted(row.job_id for row in rows) == sorted(ids)
    assert {(row.status, row.attempts) for row in rows} == {("success", 1)}
    assert sorted(runs.counts) == sorted(ids) and runs.reruns() == 0
    assert len(events(caplog.records, "database-read-only")) == 1
    assert events(caplog.records, "database-writable")
    for unexpected in ("polling-error", "database-still-unreachable", "handle-job-exception"):
        assert not events(caplog.records, unexpected)


def test_the_asyncio_worker_on_a_standby_says_so_once_and_runs_the_jobs_once_it_can_write(
    pair: Pair, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through the asyncio worker (psycopg's asyncio driver): one line while its
    polls are refused, then every job once the standby is promoted."""
    monkeypatch.setattr(logs, "OUTAGE_REPORT_INTERVAL", 0.2)
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    ids = enqueue(pair.engine("primary"), 20)
    pair.replayed()
    ran: list[uuid.UUID] = []

    async def handler(job: sp.AsyncJobContext) -> None:
        ran.append(job.job_id)

    def warnings() -> list[str]:
        return [
            record.event  # type: ignore[attr-defined]
            for record in caplog.records
            if record.levelno >= logging.WARNING and record.name.startswith("sqla_proletarian")
        ]

    async def main() -> None:
        engine = create_async_engine(pair.url("standby", "psycopg_async"))
        worker = sp.create_async_queue_worker(
            engine, handler, handler_mode="advanced", concurrency=2, polling_interval=0.05
        )
        try:
            async with worker:
                await wait_async(lambda: warnings() != [], "the worker says why it waits")
                await asyncio.sleep(1.5)  # polls go on being refused, past several report times
                assert warnings() == ["database-read-only"]
                assert ran == []
                await asyncio.to_thread(pair.failover)
                check = pair.engine("standby", poolclass=sa.pool.NullPool)
                await wait_async(lambda: len(archive(check)) == 20, "every job is archived")
                assert worker.running
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert sorted(ran) == sorted(ids)
    assert len(events(caplog.records, "database-read-only")) == 1
    assert events(caplog.records, "database-writable")
    for unexpected in ("polling-error", "database-still-unreachable", "handle-job-exception"):
        assert not events(caplog.records, unexpected)
