"""Handler modes (default and advanced) and the JobHandlers dispatch table, through the worker."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import T0, FakeClock, archived_job, aware_utc, enqueue_committed
from sqlalchemy.orm import Session

import sqla_proletarian as sp


def test_default_mode_calls_handler_with_job_type_and_payload(engine: sa.Engine) -> None:
    enqueue_committed(engine, "send-email", {"to": "ada@example.com"})
    calls: list[tuple[Any, ...]] = []

    def handler(*args: Any, **kwargs: Any) -> None:
        calls.append((args, kwargs))

    assert sp.process_next_job(engine, handler)
    assert calls == [(("send-email", {"to": "ada@example.com"}), {})]


def test_advanced_mode_calls_handler_with_a_full_job_context(engine: sa.Engine) -> None:
    clock = FakeClock()
    due = T0 + timedelta(seconds=4, microseconds=11)
    job_id = enqueue_committed(
        engine, "report", {"month": 2}, queue="reports", process_at=due, clock=clock
    )
    clock.set(due)
    seen: list[sp.JobContext] = []
    assert sp.process_next_job(
        engine, seen.append, handler_mode="advanced", queue="reports", clock=clock
    )
    [job] = seen
    assert isinstance(job, sp.JobContext)
    assert job.job_id == job_id
    assert (job.queue, job.job_type, job.payload, job.attempts) == (
        "reports",
        "report",
        {"month": 2},
        1,
    )
    assert (job.enqueued_at, job.process_at) == (T0, due)
    assert aware_utc(job.enqueued_at) and aware_utc(job.process_at)
    assert isinstance(job.session, Session)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.attempts = 5  # type: ignore[misc]


def test_advanced_mode_attempts_count_runs_across_retries(engine: sa.Engine) -> None:
    clock = FakeClock()
    enqueue_committed(engine, "flaky", None, clock=clock)
    seen: list[tuple[int, Any]] = []

    def handler(job: sp.JobContext) -> None:
        seen.append((job.attempts, job.process_at))
        if job.attempts < 3:
            raise RuntimeError("again")

    options: dict[str, Any] = {
        "handler_mode": "advanced",
        "clock": clock,
        "retry_strategy": lambda job, exc: sp.RetryStrategy(5, [2]),
    }
    for _ in range(3):
        assert sp.process_next_job(engine, handler, **options)
        clock.advance(2)
    assert seen == [
        (1, T0),
        (2, T0 + timedelta(seconds=2)),
        (3, T0 + timedelta(seconds=4)),
    ]


def _dispatch_table(calls: list[tuple[str, Any]]) -> sp.JobHandlers:
    handlers = sp.JobHandlers()

    @handlers.register("a")
    def handle_a(*args: Any) -> None:
        calls.append(("a", args))

    @handlers.register("b")
    def handle_b(*args: Any) -> None:
        calls.append(("b", args))

    @handlers.default
    def handle_other(*args: Any) -> None:
        calls.append(("default", args))

    return handlers


def test_job_handlers_dispatch_by_job_type_in_default_mode(engine: sa.Engine) -> None:
    for job_type in ("a", "b", "c", "A"):
        enqueue_committed(engine, job_type, {"t": job_type})
    calls: list[tuple[str, Any]] = []
    handlers = _dispatch_table(calls)
    while sp.process_next_job(engine, handlers):
        pass
    assert calls == [
        ("a", ("a", {"t": "a"})),
        ("b", ("b", {"t": "b"})),
        ("default", ("c", {"t": "c"})),
        ("default", ("A", {"t": "A"})),
    ]


def test_job_handlers_dispatch_by_job_type_in_advanced_mode(engine: sa.Engine) -> None:
    ids = [enqueue_committed(engine, job_type, job_type) for job_type in ("b", "zzz", "a")]
    calls: list[tuple[str, Any]] = []
    handlers = _dispatch_table(calls)
    while sp.process_next_job(engine, handlers, handler_mode="advanced"):
        pass
    assert [name for name, _ in calls] == ["b", "default", "a"]
    contexts = [args[0] for _, args in calls]
    assert all(len(args) == 1 for _, args in calls)
    assert [(c.job_id, c.job_type, c.payload) for c in contexts] == [
        (ids[0], "b", "b"),
        (ids[1], "zzz", "zzz"),
        (ids[2], "a", "a"),
    ]


def test_unknown_job_type_without_default_fails_at_once_in_both_handler_modes(
    engine: sa.Engine,
) -> None:
    """In both modes: the registered type runs; the unknown one fails for good at once (the
    retry strategy is not asked), and the failed-job handler sees UnknownJobTypeError."""
    handlers = sp.JobHandlers()
    ran: list[Any] = []
    handlers.register("known")(lambda *args: ran.append(args))
    for mode in ("default", "advanced"):
        ran.clear()
        known = enqueue_committed(engine, "known", None)
        unknown = enqueue_committed(engine, "mystery", None)
        seen: list[tuple[uuid.UUID, Exception]] = []
        asked: list[Exception] = []

        def failed(job: sp.JobContext, exc: Exception, seen: list[Any] = seen) -> None:
            seen.append((job.job_id, exc))

        def strategy(job: sp.JobContext, exc: Exception, asked: list[Any] = asked) -> Any:
            asked.append(exc)
            return sp.RetryStrategy(3)

        options: dict[str, Any] = {"retry_strategy": strategy, "failed_job_handler": failed}
        while sp.process_next_job(engine, handlers, handler_mode=mode, **options):
            pass
        assert len(ran) == 1, mode
        assert asked == [], mode
        [(job_id, exc)] = seen
        assert job_id == unknown, mode
        assert isinstance(exc, sp.UnknownJobTypeError) and isinstance(exc, sp.ProletarianError)
        assert exc.job_type == "mystery" and exc.known_types == ("known",)
        done = archived_job(engine, unknown)
        assert done is not None and (done.status, done.attempts) == ("failure", 1), mode
        assert done.error is not None and "mystery" in done.error
        ok = archived_job(engine, known)
        assert ok is not None and ok.status == "success", mode


def test_registering_a_job_type_twice_is_refused_and_the_first_handler_stays(
    engine: sa.Engine,
) -> None:
    handlers = sp.JobHandlers()
    calls: list[str] = []

    @handlers.register("t")
    def first(job_type: str, payload: Any) -> None:
        calls.append("first")

    with pytest.raises(sp.ConfigurationError, match="already has a handler"):

        @handlers.register("t")
        def second(job_type: str, payload: Any) -> None:
            calls.append("second")

    enqueue_committed(engine, "t", None)
    assert sp.process_next_job(engine, handlers)
    assert calls == ["first"]
