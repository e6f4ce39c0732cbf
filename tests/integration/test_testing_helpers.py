"""``sqla_proletarian.testing`` (drain, enqueued_jobs) and the pytest plugin's fixtures, on
every backend: what an application's own test suite relies on."""

from __future__ import annotations

import json
import textwrap
import uuid
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import T0, FakeClock, archived, archived_job, count, enqueue_committed, run_records
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian.testing import DrainLimitError, EnqueuedJob, drain, enqueued_jobs

if TYPE_CHECKING:
    from conftest import Database

pytest_plugins = ["pytester"]


def _noop(job_type: str, payload: Any) -> None:
    return None


def _always_retry(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
    return sp.RetryStrategy(retries=3, delays=[0])


# --- drain ---------------------------------------------------------------------------------


def test_drain_runs_every_due_job_in_order_and_returns_the_runs(engine: sa.Engine) -> None:
    clock = FakeClock()
    for name in ("ada", "bob", "cy"):
        enqueue_committed(engine, "greet", {"name": name}, clock=clock)
    later = enqueue_committed(engine, "greet", {"name": "later"}, process_in=60, clock=clock)
    seen: list[str] = []
    assert drain(engine, lambda t, p: seen.append(p["name"]), clock=clock) == 3
    assert seen == ["ada", "bob", "cy"]
    assert [job.job_id for job in enqueued_jobs(engine)] == [later], "not due yet: not run"
    assert sorted(job.status for job in archived(engine)) == ["success"] * 3
    assert drain(engine, _noop, clock=clock) == 0, "nothing due: nothing runs"


def test_drain_runs_retries_already_due_but_not_those_due_later(engine: sa.Engine) -> None:
    """A zero-delay retry runs again in the same drain; a delayed one waits for the clock."""
    clock = FakeClock()
    flaky = enqueue_committed(engine, "flaky", clock=clock)
    runs: dict[str, int] = {}

    def fail_first(job_type: str, payload: Any) -> None:
        runs[job_type] = runs.get(job_type, 0) + 1
        if runs[job_type] == 1:
            raise ConnectionError("first run fails")

    def retry_now_or_later(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
        return sp.RetryStrategy(retries=1, delays=[0 if job.job_type == "flaky" else 60])

    options: dict[str, Any] = {"clock": clock, "retry_strategy": retry_now_or_later}
    assert drain(engine, fail_first, **options) == 2, "the failed run and its retry"
    assert archived_job(engine, flaky).status == "success"  # type: ignore[union-attr]
    slow = enqueue_committed(engine, "slow", clock=clock)
    assert drain(engine, fail_first, **options) == 1, "the retry is due in 60 s"
    [waiting] = enqueued_jobs(engine)
    assert (waiting.job_id, waiting.attempts) == (slow, 1)
    assert waiting.process_at == T0 + timedelta(seconds=60)
    clock.advance(60)
    assert drain(engine, fail_first, **options) == 1
    assert enqueued_jobs(engine) == []


def test_drain_of_a_job_that_always_fails_ends_when_the_strategy_gives_up(
    engine: sa.Engine,
) -> None:
    job_id = enqueue_committed(engine, "doomed")
    failed: list[tuple[uuid.UUID, int, str]] = []

    def boom(job_type: str, payload: Any) -> None:
        raise ValueError("always")

    ran = drain(
        engine,
        boom,
        retry_strategy=_always_retry,
        failed_job_handler=lambda job, exc: failed.append((job.job_id, job.attempts, str(exc))),
    )
    assert ran == 4, "the first run and 3 retries"
    assert failed == [(job_id, 4, "always")]
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("failure", 4)


def test_drain_stops_at_max_runs_with_a_clear_error_and_leaves_the_job_queued(
    engine: sa.Engine,
) -> None:
    """A strategy that never gives up on a failing handler would loop forever: max_runs
    ends it, and the job not run stays queued as it was, with no run record left."""
    job_id = enqueue_committed(engine, "forever")

    def never_give_up(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
        return sp.RetryStrategy(retries=10**6)

    def boom(job_type: str, payload: Any) -> None:
        raise ValueError("again")

    with pytest.raises(DrainLimitError, match="ran 5 jobs and more are still due") as raised:
        drain(engine, boom, retry_strategy=never_give_up, max_runs=5)
    assert isinstance(raised.value, sp.ProletarianError) and raised.value.max_runs == 5
    [job] = enqueued_jobs(engine)
    assert (job.job_id, job.attempts) == (job_id, 5)
    assert run_records(engine) == 0 and archived(engine) == []


def test_drain_honours_queue_handler_mode_batch_size_and_runs_follow_up_jobs(
    engine: sa.Engine,
) -> None:
    """Only the given queue runs; advanced handlers get a JobContext whose session writes
    commit with the job; jobs a handler enqueues run in the same drain."""
    with Session(engine) as session:
        sp.enqueue_many(session, [("invoice", {"n": n}) for n in range(3)], queue="billing")
        sp.enqueue(session, "other", None)
        session.commit()
    seen: list[tuple[str, int]] = []

    def handle(job: sp.JobContext) -> None:
        seen.append((job.job_type, job.payload["n"]))
        if job.job_type == "invoice" and job.payload["n"] == 0:
            sp.enqueue(job.session, "receipt", {"n": 10}, queue="billing")

    assert drain(engine, handle, queue="billing", handler_mode="advanced", batch_size=10) == 4
    assert seen == [("invoice", 0), ("invoice", 1), ("invoice", 2), ("receipt", 10)]
    assert [job.job_type for job in enqueued_jobs(engine)] == ["other"]


def test_drain_refuses_what_it_cannot_run(engine: sa.Engine) -> None:
    with engine.connect() as conn, pytest.raises(sp.ConfigurationError, match="needs the sql"):
        drain(conn, _noop)  # type: ignore[arg-type]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(sp.ConfigurationError, match="max_runs"):
            drain(engine, _noop, max_runs=bad)  # type: ignore[arg-type]
    with pytest.raises(sp.ConfigurationError, match="unknown worker option"):
        drain(engine, _noop, polling=1)
    with pytest.raises(sp.ConfigurationError, match="handler"):
        drain(engine, "not a function")  # type: ignore[arg-type]


def test_drain_refuses_an_async_engine_saying_what_to_give_instead(tmp_path: Path) -> None:
    async_engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'jobs.db'}")
    for bind in (async_engine, async_engine.sync_engine):
        with pytest.raises(sp.ConfigurationError, match="create_engine on the same database"):
            drain(bind, _noop)  # type: ignore[arg-type]


# --- enqueued_jobs -------------------------------------------------------------------------


def test_enqueued_jobs_are_frozen_decoded_and_in_due_order(engine: sa.Engine) -> None:
    clock = FakeClock()
    late = enqueue_committed(engine, "b", {"at": T0}, process_in=10, clock=clock)
    first = enqueue_committed(engine, "a", [1, "x"], clock=clock)
    second = enqueue_committed(engine, "b", None, queue="other", clock=clock)
    jobs = enqueued_jobs(engine)
    assert [job.job_id for job in jobs] == [first, second, late]
    assert jobs[0] == EnqueuedJob(first, "default", "a", [1, "x"], 0, T0)
    assert jobs[2].payload == {"at": T0}, "decoded with the JSON serializer's types"
    with pytest.raises(AttributeError):
        jobs[0].payload = None  # type: ignore[misc]
    assert [j.job_id for j in enqueued_jobs(engine, queue="default")] == [first, late]
    assert [j.job_id for j in enqueued_jobs(engine, job_type="b")] == [second, late]
    assert enqueued_jobs(engine, queue="other", job_type="a") == []


def test_enqueued_jobs_sees_a_transactions_own_uncommitted_jobs(engine: sa.Engine) -> None:
    """A Session's pending jobs (flushed for the read) and a Connection's inserted ones are
    visible to themselves before the commit, and gone with a rollback."""
    with Session(engine) as session:
        job_id = sp.enqueue(session, "pending", {"n": 1})
        assert [job.job_id for job in enqueued_jobs(session)] == [job_id]
        session.rollback()
        assert enqueued_jobs(session) == []
    with engine.connect() as conn:
        job_id = sp.enqueue(conn, "inserted", None)
        assert [job.job_id for job in enqueued_jobs(conn)] == [job_id]
        conn.rollback()
    assert enqueued_jobs(engine) == []
    with pytest.raises(sp.ConfigurationError, match="Engine, Connection or Session"):
        enqueued_jobs("sqlite://")  # type: ignore[arg-type]


def test_enqueued_jobs_and_drain_decode_with_the_given_serializer(engine: sa.Engine) -> None:
    class Tagged:
        def dumps(self, payload: Any) -> str:
            return json.dumps({"v": payload})

        def loads(self, text: str) -> Any:
            return json.loads(text)["v"]

    enqueue_committed(engine, "t", [1, 2], serializer=Tagged())
    assert enqueued_jobs(engine, serializer=Tagged())[0].payload == [1, 2]
    with pytest.raises(sp.PayloadDeserializationError, match="cannot be decoded"):
        enqueued_jobs(engine, serializer=type("Broken", (Tagged,), {"loads": lambda s, t: 1 / 0})())
    seen: list[Any] = []
    assert drain(engine, lambda t, p: seen.append(p), serializer=Tagged()) == 1
    assert seen == [[1, 2]]


# --- the pytest plugin ---------------------------------------------------------------------

#: The inner runs leave out the cache and hypothesis's plugin (which imports hypothesis anew
#: in every in-process run, a second each).
INNER_ARGS = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")

INNER_TESTS = """
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    import sqla_proletarian as sp
    from sqla_proletarian.testing import enqueued_jobs


    def test_runs_what_it_enqueued(proletarian_tables, proletarian_drain):
        with Session(proletarian_tables) as session:
            sp.enqueue(session, "greet", {"name": "ada"})
            sp.enqueue(session, "greet", {"name": "bob"})
            session.commit()
        seen = []
        assert proletarian_drain(lambda job_type, payload: seen.append(payload["name"])) == 2
        assert seen == ["ada", "bob"]
        with proletarian_tables.begin() as conn:
            sp.enqueue(conn, "left-over", None)


    def test_starts_with_empty_tables(proletarian_tables):
        assert enqueued_jobs(proletarian_tables) == []
        with proletarian_tables.connect() as conn:
            archive = sp.ArchivedJob.__table__
            assert conn.execute(sa.select(sa.func.count()).select_from(archive)).scalar() == 0
"""


def _inner_conftest(url: sa.URL) -> str:
    return textwrap.dedent(
        f"""
        import pytest
        import sqlalchemy as sa


        @pytest.fixture
        def proletarian_engine():
            engine = sa.create_engine({url.render_as_string(hide_password=False)!r})
            yield engine
            engine.dispose()
        """
    )


def _library_tables(database: Database) -> set[str]:
    engine = database.engine()
    try:
        return set(sa.inspect(engine).get_table_names()) & set(sp.metadata.tables)
    finally:
        engine.dispose()


def test_plugin_gives_each_test_fresh_tables_and_drops_them(
    pytester: pytest.Pytester, empty_database: Database
) -> None:
    """With the user's proletarian_engine, each test gets the library's tables (created for
    it, dropped after it) and a drain bound to that engine."""
    pytester.makeconftest(_inner_conftest(empty_database.url))
    pytester.makepyfile(test_app=textwrap.dedent(INNER_TESTS))
    result = pytester.runpytest_inprocess(*INNER_ARGS)
    result.assert_outcomes(passed=2)
    assert _library_tables(empty_database) == set(), "dropped after the last test"


def test_plugin_empties_tables_that_existed_instead_of_dropping_them(
    pytester: pytest.Pytester, database: Database
) -> None:
    """Tables made by the user's migrations are used as they are and emptied after each test."""
    pytester.makeconftest(_inner_conftest(database.url))
    pytester.makepyfile(test_app=textwrap.dedent(INNER_TESTS))
    result = pytester.runpytest_inprocess(*INNER_ARGS)
    result.assert_outcomes(passed=2)
    assert _library_tables(database) == set(sp.metadata.tables), "kept"
    engine = database.engine()
    assert [count(engine, table) for table in sp.metadata.sorted_tables] == [0] * len(
        sp.metadata.sorted_tables
    )


def test_plugin_without_proletarian_engine_says_what_to_define(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_app="def test_jobs(proletarian_drain):\n    proletarian_drain(print)\n"
    )
    result = pytester.runpytest_inprocess(*INNER_ARGS)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*define a fixture named proletarian_engine in your conftest.py*"])


def test_plugin_refuses_a_database_whose_queue_tables_hold_rows_and_keeps_them(
    pytester: pytest.Pytester, database: Database
) -> None:
    """A proletarian_engine on a developer's database (a queued job, an archived one, a
    paused queue): each test errors saying what to do, and every row is still there after
    the run (the fixture used to empty the tables after each test)."""
    engine = database.engine()
    with engine.begin() as conn:
        queued = sp.enqueue(conn, "mine", {"n": 1})
        done = sp.enqueue(conn, "mine", {"n": 2}, queue="done")
        sp.pause_queue(conn, "held")
    assert sp.process_next_job(engine, _noop, queue="done")
    before = [count(engine, table) for table in sp.metadata.sorted_tables]
    pytester.makeconftest(_inner_conftest(database.url))
    pytester.makepyfile(test_app=textwrap.dedent(INNER_TESTS))
    result = pytester.runpytest_inprocess(*INNER_ARGS)
    assert [count(engine, table) for table in sp.metadata.sorted_tables] == before
    assert [job.job_id for job in enqueued_jobs(engine)] == [queued]
    assert [job.job_id for job in archived(engine)] == [done]
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*queue tables of * already hold rows (*proletarian_job: 1*"])
    result.stdout.fnmatch_lines(["*never deletes rows a test did not create: point*"])
    engine.dispose()
