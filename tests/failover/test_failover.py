"""A worker and an app given every server of a PostgreSQL pair (target_session_attrs=
read-write) keep going when the primary stops and its standby is promoted: the worker
reconnects to the new primary without a restart, in both modes and through psycopg 3 and
psycopg2 (and the asyncio worker), and the app's enqueues resume; no job committed before
the failover is lost, none is archived twice, and none is charged an unclean end for it."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
import sqlalchemy as sa
from failover_helpers import MODES, Pair, Runs, archive, count, enqueue, events, wait_until
from sqlalchemy.ext.asyncio import create_async_engine

import sqla_proletarian as sp
from sqla_proletarian import statements


def server_port(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT inet_server_port()").scalar_one())


def check_every_job_archived_once(
    pair: Pair, ids: list[uuid.UUID], caplog: pytest.LogCaptureFixture
) -> None:
    """Every job archived as succeeded at its first counted attempt (no unclean end charged),
    no run record left, nothing queued, and no error that a failover should not cause."""
    check = pair.engine("multihost", poolclass=sa.pool.NullPool)
    rows = archive(check)
    assert sorted(row.job_id for row in rows) == sorted(ids)
    assert {(row.status, row.attempts) for row in rows} == {("success", 1)}
    assert count(check, statements.JOB) == 0
    assert count(check, sp.JobRun) == 0
    names = {getattr(record, "event", None) for record in caplog.records}
    for unexpected in ("polling-error", "job-crashed", "job-interrupted", "lease-release-error"):
        assert unexpected not in names, events(caplog.records, unexpected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_a_worker_and_an_app_on_every_server_keep_going_across_a_failover(
    pair: Pair, mode: str, driver: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    # The app checks its pooled connection before use, so its next enqueue finds the new
    # primary; the worker's engine has no pre-ping: the worker copes with stale connections.
    app = pair.engine("multihost", driver, pool_pre_ping=True)
    before = enqueue(app, 300)
    runs = Runs(pause=0.002)
    worker = sp.create_queue_worker(
        pair.engine("multihost", driver),
        runs,
        handler_mode="advanced",
        worker_threads=4,
        polling_interval=0.05,
        worker_id="failover",
        **MODES[mode],
    )
    with worker:
        wait_until(lambda: len(runs) >= 100, "the worker is under way", worker)
        pair.failover()
        after = enqueue(app, 50)
        assert server_port(app) == int(pair.env["SP_PGPAIR_STANDBY_PORT"])
        wait_until(lambda: len(runs) == 350, "every job ran", worker)
        check = pair.engine("multihost", driver, poolclass=sa.pool.NullPool)
        wait_until(lambda: len(archive(check)) == 350, "every job is archived", worker)
        assert worker.running
        assert worker.exception is None
    check_every_job_archived_once(pair, before + after, caplog)
    names = {getattr(record, "event", None) for record in caplog.records}
    assert names & {"transient-polling-error", "listen-error"}, "the failover never reached it"


def test_the_asyncio_worker_keeps_going_across_a_failover(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    app = pair.engine("multihost", pool_pre_ping=True)
    before = enqueue(app, 200)
    ran: set[uuid.UUID] = set()

    async def handler(job: sp.AsyncJobContext) -> None:
        ran.add(job.job_id)
        await asyncio.sleep(0.002)

    async def main() -> list[uuid.UUID]:
        engine = create_async_engine(pair.url("multihost", "psycopg_async"))
        worker = sp.create_async_queue_worker(
            engine, handler, handler_mode="advanced", concurrency=4, polling_interval=0.05
        )
        try:
            async with worker:
                await wait_async(lambda: len(ran) >= 50, "the worker is under way")
                await asyncio.to_thread(pair.failover)
                after = await asyncio.to_thread(enqueue, app, 50)
                await wait_async(lambda: len(ran) == 250, "every job ran")
                check = pair.engine("multihost", poolclass=sa.pool.NullPool)
                await wait_async(lambda: len(archive(check)) == 250, "every job is archived")
                assert worker.running
        finally:
            await engine.dispose()
        return after

    after = asyncio.run(main())
    check_every_job_archived_once(pair, before + after, caplog)


async def wait_async(condition: object, what: str, timeout: float = 60.0) -> None:
    """wait_until, in the event loop (its checks in a thread: they may block)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            if await asyncio.to_thread(condition):  # type: ignore[arg-type]
                return
        except sa.exc.DBAPIError:
            pass
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting until {what}")
        await asyncio.sleep(0.05)
