"""OpenTelemetry: the enqueue's send span and the trace context it leaves in the job row, the
run's process span in the same trace, its outcome and error, the worker's metrics, batches,
a stored context that cannot be read, and a library that imports nothing without the API.

The test process gets one global tracer provider and one meter provider (each can be set only
once); spans are recorded only while a test of this module runs, so the rest of the suite
sees the API's no-op tracer, as with no SDK configured.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import FakeClock, archived, enqueue_committed, job_row
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian import telemetry


class _SwitchedProvider(trace.TracerProvider):
    """An SDK tracer provider that records only while ``on``; otherwise its tracers are the
    API's no-op tracer, so tests elsewhere in the process run as if no SDK were set."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.sdk = TracerProvider()
        self.sdk.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.on = False

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return _SwitchedTracer(self, self.sdk.get_tracer(*args, **kwargs))


class _SwitchedTracer(trace.Tracer):
    def __init__(self, switch: _SwitchedProvider, tracer: trace.Tracer) -> None:
        self._switch = switch
        self._tracer = tracer

    def _now(self) -> trace.Tracer:
        return self._tracer if self._switch.on else trace.NoOpTracer()

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return self._now().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        return self._now().start_as_current_span(*args, **kwargs)


class Telemetry:
    """What the library recorded during one test: finished spans and metric points."""

    def __init__(self, provider: _SwitchedProvider, reader: InMemoryMetricReader) -> None:
        self.provider = provider
        self.reader = reader
        self.tracer = trace.get_tracer("tests")

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        finished = self.provider.exporter.get_finished_spans()
        return [s for s in finished if name is None or s.name == name]

    def metrics(self) -> dict[str, list[Any]]:
        """The metric points recorded since the last call (delta temporality), by name."""
        data = self.reader.get_metrics_data()
        found: dict[str, list[Any]] = {}
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    found.setdefault(metric.name, []).extend(metric.data.data_points)
        return found


_INSTALLED: list[Telemetry] = []


def _install() -> Telemetry:
    if _INSTALLED:
        return _INSTALLED[0]
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.fail("a global tracer provider was set before these tests could set theirs")
    provider = _SwitchedProvider()
    delta = AggregationTemporality.DELTA
    reader = InMemoryMetricReader(preferred_temporality={Counter: delta, Histogram: delta})
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    _INSTALLED.append(Telemetry(provider, reader))
    return _INSTALLED[0]


@pytest.fixture
def otel() -> Iterator[Telemetry]:
    """Spans recorded for this test only, and metrics from its start."""
    recorded = _install()
    recorded.provider.exporter.clear()
    recorded.metrics()
    recorded.provider.on = True
    try:
        yield recorded
    finally:
        recorded.provider.on = False
        recorded.provider.exporter.clear()


def _ok(job_type: str, payload: Any) -> None:
    return None


class Boom(Exception):
    """The handler's failure in these tests."""


def _fail(job_type: str, payload: Any) -> None:
    raise Boom(f"cannot {job_type}")


def _retry_once(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
    return sp.RetryStrategy(retries=1, delays=[10])


def _only(spans: list[ReadableSpan]) -> ReadableSpan:
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def _is_child(span: ReadableSpan, parent: ReadableSpan) -> bool:
    assert span.parent is not None and span.context is not None and parent.context is not None
    return (span.context.trace_id, span.parent.span_id) == (
        parent.context.trace_id,
        parent.context.span_id,
    )


# --- a job's trace --------------------------------------------------------------------------


def test_a_job_enqueued_in_a_span_runs_in_a_child_span_of_its_send_span(
    engine: sa.Engine, otel: Telemetry
) -> None:
    """Session enqueue in a request span: ``send`` (PRODUCER) under the request, its context
    in the row; the run's ``process`` span (CONSUMER) under ``send``, linked to it, with the
    job's attributes; the handler's own span nests under the run's."""

    def handler(job_type: str, payload: Any) -> None:
        with otel.tracer.start_as_current_span("inside the handler"):
            pass

    with otel.tracer.start_as_current_span("request") as request:
        job_id = enqueue_committed(engine, "greet", {"n": 1}, queue="mail")
    stored = job_row(engine, job_id)
    assert stored is not None and stored.trace_context is not None
    carrier = json.loads(stored.trace_context)
    trace_id = request.get_span_context().trace_id
    assert carrier["traceparent"].split("-")[1] == f"{trace_id:032x}"

    assert sp.process_next_job(engine, handler, queue="mail")

    request_span = _only(otel.spans("request"))
    send = _only(otel.spans("send mail"))
    process = _only(otel.spans("process mail"))
    inside = _only(otel.spans("inside the handler"))
    assert send.kind == SpanKind.PRODUCER and _is_child(send, request_span)
    assert process.kind == SpanKind.CONSUMER and _is_child(process, send)
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
    assert _is_child(inside, process)
    assert dict(send.attributes or {}) == {
        "messaging.system": "sqla_proletarian",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": "mail",
        "messaging.message.id": str(job_id),
        "sqla_proletarian.job_type": "greet",
    }
    assert dict(process.attributes or {}) == {
        "messaging.system": "sqla_proletarian",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "mail",
        "messaging.message.id": str(job_id),
        "sqla_proletarian.job_type": "greet",
        "sqla_proletarian.attempt": 1,
        "sqla_proletarian.outcome": "succeeded",
    }
    assert process.status.status_code == StatusCode.UNSET


def test_a_connection_enqueue_and_an_added_job_carry_the_trace_context_too(
    engine: sa.Engine, otel: Telemetry
) -> None:
    """``enqueue`` on a Connection and ``session.add(sp.Job(...))`` store the context of
    their send span, and each run continues that trace."""
    with otel.tracer.start_as_current_span("request"):
        with engine.begin() as conn:
            by_connection = sp.enqueue(conn, "by-connection")
        with Session(engine) as session:
            added = sp.Job(job_type="added")
            session.add(added)
            session.commit()
            by_session = added.job_id
    assert sp.process_next_job(engine, _ok)
    assert sp.process_next_job(engine, _ok)

    sends = {s.attributes["messaging.message.id"]: s for s in otel.spans("send default")}
    runs = {s.attributes["messaging.message.id"]: s for s in otel.spans("process default")}
    for job_id in (by_connection, by_session):
        assert _is_child(runs[str(job_id)], sends[str(job_id)])


def test_a_failing_run_is_an_error_span_with_its_exception_and_outcome(
    engine: sa.Engine, otel: Telemetry
) -> None:
    """A run that is retried and the run that fails for good: both ERROR, each with the
    handler's exception recorded once, their outcome and attempt, in the enqueuer's trace."""
    clock = FakeClock()
    with otel.tracer.start_as_current_span("request"):
        enqueue_committed(engine, "charge", clock=clock)
    options: dict[str, Any] = {"retry_strategy": _retry_once, "clock": clock}
    assert sp.process_next_job(engine, _fail, **options)
    clock.advance(10)
    assert sp.process_next_job(engine, _fail, **options)
    assert [job.status for job in archived(engine)] == ["failure"]

    send = _only(otel.spans("send default"))
    runs = sorted(otel.spans("process default"), key=lambda s: s.start_time or 0)
    assert [(s.attributes or {})["sqla_proletarian.outcome"] for s in runs] == [
        "retried",
        "failed",
    ]
    for attempt, run in enumerate(runs, start=1):
        attributes = run.attributes or {}
        assert attributes["sqla_proletarian.attempt"] == attempt
        assert attributes["error.type"] == f"{__name__}.Boom"
        assert run.status.status_code == StatusCode.ERROR
        assert run.status.description == "Boom: cannot charge"
        exceptions = [e for e in run.events if e.name == "exception"]
        assert len(exceptions) == 1
        assert (exceptions[0].attributes or {})["exception.message"] == "cannot charge"
        assert _is_child(run, send)


def test_the_metrics_count_runs_by_outcome_with_their_duration_and_lag(
    engine: sa.Engine, otel: Telemetry
) -> None:
    """``sqla_proletarian.jobs`` counts each run by queue, job type and outcome; the duration
    histogram has one point each; the lag is the claim's time minus ``process_at``."""
    clock = FakeClock()
    for job_type in ("ok", "flaky", "bad"):
        enqueue_committed(engine, job_type, clock=clock)
    clock.advance(7.25)

    def handler(job_type: str, payload: Any) -> None:
        if job_type != "ok":
            raise Boom(job_type)

    def strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy | None:
        return sp.RetryStrategy(retries=1, delays=[60]) if job.job_type == "flaky" else None

    for _ in range(3):
        assert sp.process_next_job(engine, handler, retry_strategy=strategy, clock=clock)
    recorded = otel.metrics()

    def by_outcome(points: list[Any]) -> dict[tuple[str, str, str], Any]:
        return {
            (
                p.attributes["messaging.destination.name"],
                p.attributes["sqla_proletarian.job_type"],
                p.attributes["sqla_proletarian.outcome"],
            ): p
            for p in points
        }

    expected = {
        ("default", "ok", "succeeded"),
        ("default", "flaky", "retried"),
        ("default", "bad", "failed"),
    }
    counts = by_outcome(recorded[telemetry.JOBS])
    assert {key: point.value for key, point in counts.items()} == dict.fromkeys(expected, 1)
    durations = by_outcome(recorded[telemetry.DURATION])
    assert set(durations) == expected
    assert all(p.count == 1 and 0 < p.sum < 5 for p in durations.values())
    lags = recorded[telemetry.LAG]
    assert sorted(p.attributes["sqla_proletarian.job_type"] for p in lags) == ["bad", "flaky", "ok"]
    assert all((p.count, p.sum) == (1, 7.25) for p in lags)


def test_enqueue_many_sends_one_span_and_a_batch_runs_one_span_per_job(
    engine: sa.Engine, otel: Telemetry
) -> None:
    """``enqueue_many`` records one ``send`` span for its jobs, which share its context; a
    batched claim (one job at a time on SQLite) gives each job its own process span."""
    with otel.tracer.start_as_current_span("request"), engine.begin() as conn:
        job_ids = sp.enqueue_many(conn, [("import", {"row": n}) for n in range(3)])
    with engine.connect() as conn:
        contexts = set(conn.execute(sa.select(sp.Job.__table__.c.trace_context)).scalars())
    assert len(contexts) == 1 and None not in contexts

    ran = 0
    while sp.process_next_job(engine, _ok, batch_size=3):
        ran += 1
    assert ran == (3 if engine.dialect.name == "sqlite" else 1)

    send = _only(otel.spans("send default"))
    assert (send.attributes or {})["messaging.batch.message_count"] == 3
    assert "messaging.message.id" not in (send.attributes or {})
    runs = otel.spans("process default")
    assert sorted(s.attributes["messaging.message.id"] for s in runs) == sorted(map(str, job_ids))
    assert all(_is_child(run, send) for run in runs)
    assert {s.attributes["sqla_proletarian.outcome"] for s in runs} == {"succeeded"}


@pytest.mark.parametrize(
    "stored",
    ["not json", '["00-a-b-01"]', '{"traceparent": "00-zz-yy-01"}', '{"traceparent": 7}'],
)
def test_a_trace_context_that_cannot_be_read_starts_a_new_trace_and_the_job_runs(
    engine: sa.Engine, otel: Telemetry, stored: str
) -> None:
    job_id = enqueue_committed(engine, "handwritten")
    table = sp.Job.__table__
    with engine.begin() as conn:
        conn.execute(sa.update(table).values(trace_context=stored))
    assert sp.process_next_job(engine, _ok)
    run = _only(otel.spans("process default"))
    assert run.parent is None and not run.links
    assert (run.attributes or {})["sqla_proletarian.outcome"] == "succeeded"
    assert [job.job_id for job in archived(engine)] == [job_id]


# --- without OpenTelemetry ------------------------------------------------------------------

_WITHOUT = textwrap.dedent(
    """
    import json
    import sys

    if sys.argv[1] == "absent":
        sys.modules["opentelemetry"] = None  # any import of it raises ImportError

    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    import sqla_proletarian as sp

    engine = sa.create_engine(sys.argv[2])
    with Session(engine) as session:
        sp.enqueue(session, "by-session")
        session.add(sp.Job(job_type="added"))
        session.commit()
    with engine.begin() as conn:
        sp.enqueue(conn, "by-connection")
        sp.enqueue_many(conn, [("many", 1), ("many", 2)])
    with engine.connect() as conn:
        stored = conn.execute(sa.select(sp.Job.__table__.c.trace_context)).scalars().all()
    ran = 0
    while sp.process_next_job(engine, lambda job_type, payload: None):
        ran += 1
    with Session(engine) as session:
        statuses = session.scalars(sa.select(sp.ArchivedJob.status)).all()
    loaded = [name for name, module in sys.modules.items() if "opentelemetry" in name and module]
    print(json.dumps({"stored": stored, "ran": ran, "statuses": statuses, "loaded": loaded}))
    """
)


@pytest.mark.parametrize("mode", ["absent", "api-without-sdk"])
def test_without_opentelemetry_or_its_sdk_jobs_run_with_no_trace_context(
    engine: sa.Engine, mode: str
) -> None:
    """Without the API the library imports nothing of OpenTelemetry; with the API and no SDK
    configured there is no context to keep: either way every job's ``trace_context`` stays
    NULL, on every enqueue path, and the jobs run."""
    url = engine.url.render_as_string(hide_password=False)
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT, mode, url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["stored"] == [None] * 5
    assert (result["ran"], result["statuses"]) == (5, ["success"] * 5)
    if mode == "absent":
        assert result["loaded"] == []
    else:
        assert "opentelemetry.trace" in result["loaded"]
