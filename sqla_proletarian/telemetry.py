"""OpenTelemetry: a span for each enqueue and each run, and the worker's metrics.

Active when ``opentelemetry-api`` is importable (the ``otel`` extra); otherwise nothing is
imported, every call returns at its first check, and jobs carry no trace context. The
library only uses the API: spans and metrics go wherever the application's SDK sends them
(with no SDK configured, the API's no-op tracer and meter record nothing, and a run whose
job carries no stored context skips them).

- Enqueue records a ``send <queue>`` span (kind PRODUCER) where the job is made and stores its
  context (W3C ``traceparent``/``tracestate``, and any baggage, from the global propagator) in
  the job row's ``trace_context``, as JSON; nothing when there is no context to propagate.
  ``enqueue_many`` records one such span for all its jobs, which then share that context.
- Each run is a ``process <queue>`` span (kind CONSUMER) whose parent is the stored context,
  so it joins the enqueuer's trace, with a link to the same context as the messaging
  conventions ask. The handler runs inside it. A stored context that cannot be read is
  ignored: the run starts a trace of its own.
- Metrics: ``sqla_proletarian.jobs`` (runs by outcome), ``sqla_proletarian.job.duration``
  (seconds a run took) and ``sqla_proletarian.job.lag`` (seconds between when a job was due
  and when it was claimed).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Mapping
from contextvars import Token
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import baggage, metrics, propagate, trace
    from opentelemetry import context as otel_context
    from opentelemetry.metrics import _internal as _metrics_api
except ImportError:  # the otel extra is not installed: every function below returns at once
    ENABLED = False
else:
    ENABLED = True

if TYPE_CHECKING:
    from opentelemetry.context import Context

#: The instrumentation scope of the library's tracer and meter, and its ``messaging.system``.
SYSTEM = "sqla_proletarian"

#: Runs by outcome (a counter); attributes ``messaging.destination.name`` (the queue),
#: ``sqla_proletarian.job_type`` and ``sqla_proletarian.outcome``.
JOBS = "sqla_proletarian.jobs"
#: Seconds a run took, handler and outcome (a histogram); the same attributes.
DURATION = "sqla_proletarian.job.duration"
#: Seconds from a job's ``process_at`` to its claim (a histogram); queue and job type.
LAG = "sqla_proletarian.job.lag"

#: A run that raised out of the worker's handling of the job (its transaction or connection
#: lost, the worker interrupted): the job stays queued and runs again.
INTERRUPTED = "interrupted"

#: The process spans' and metrics' histogram buckets, in seconds.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)

_QUEUE = "messaging.destination.name"
_JOB_TYPE = "sqla_proletarian.job_type"
_OUTCOME = "sqla_proletarian.outcome"


class _Instruments:
    """The library's tracer and metric instruments, made at their first use (the global
    providers may be set after the library is imported; the API's proxies follow them)."""

    def __init__(self) -> None:
        from sqla_proletarian import __version__

        self.tracer = trace.get_tracer(SYSTEM, __version__)
        meter = metrics.get_meter(SYSTEM, __version__)
        self.jobs = meter.create_counter(JOBS, unit="{run}", description="Job runs, by outcome")
        self.duration = meter.create_histogram(
            DURATION,
            unit="s",
            description="How long a job's run took, its handler and outcome",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.lag = meter.create_histogram(
            LAG,
            unit="s",
            description="How long a due job waited in its queue before a worker claimed it",
            explicit_bucket_boundaries_advisory=LAG_BUCKETS,
        )


_made: list[_Instruments] = []
_making = threading.Lock()


def _instruments() -> _Instruments:
    if not _made:
        with _making:  # once, even when worker threads start together
            if not _made:
                _made.append(_Instruments())
    return _made[0]


def enqueue_context(
    queue: str,
    *,
    job_id: uuid.UUID | None = None,
    job_type: str | None = None,
    batch: int | None = None,
) -> str | None:
    """Record the ``send <queue>`` span of one job (``job_id``) or of a batch of ``batch``
    jobs, and return its context as the JSON the job rows keep; None without OpenTelemetry
    or when there is nothing to propagate (no SDK configured and no context from outside
    current: then no span is started at all)."""
    if not ENABLED or not (_sdk_configured() or _context_from_outside()):
        return None
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        _QUEUE: queue,
    }
    if job_id is not None:
        attributes["messaging.message.id"] = str(job_id)
    if job_type is not None:
        attributes[_JOB_TYPE] = job_type
    if batch is not None:
        attributes["messaging.batch.message_count"] = batch
    carrier: dict[str, str] = {}
    span = _instruments().tracer.start_span(
        f"send {queue}", kind=trace.SpanKind.PRODUCER, attributes=attributes
    )
    try:
        propagate.inject(carrier, context=trace.set_span_in_context(span))
    except Exception:  # a failing propagator must not fail the enqueue
        carrier.clear()
    finally:
        span.end()
    return json.dumps(carrier, separators=(",", ":"), sort_keys=True) if carrier else None


class Run:
    """One run's span and metrics: ``with run_span(job, claimed_at) as run:`` around the run,
    ``run.ended(outcome, error)`` once it has its outcome. Without OpenTelemetry, a no-op."""

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def ended(self, outcome: str, error: BaseException | None = None) -> None:
        """The outcome the run recorded, and the exception that failed it, if any."""


_NO_RUN = Run()

#: The run a context belongs to, kept in the OpenTelemetry context of the run.
_RUN_KEY = "sqla_proletarian.run"


class _TracedRun(Run):
    def __init__(self, job: Mapping[str, Any], claimed_at: datetime | None) -> None:
        self._instruments = _instruments()
        queue, job_type = job["queue"], job["job_type"]
        self._metric_attributes: dict[str, Any] = {_QUEUE: queue, _JOB_TYPE: job_type}
        if claimed_at is not None:
            lag = (claimed_at - job["process_at"]).total_seconds()
            self._instruments.lag.record(max(0.0, lag), self._metric_attributes)
        parent = _extract(job.get("trace_context"))
        links = None
        if parent is not None:
            links = [trace.Link(trace.get_current_span(parent).get_span_context())]
        self._span = self._instruments.tracer.start_span(
            f"process {queue}",
            context=parent,
            kind=trace.SpanKind.CONSUMER,
            attributes={
                "messaging.system": SYSTEM,
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                _QUEUE: queue,
                "messaging.message.id": str(job["job_id"]),
                _JOB_TYPE: job_type,
                "sqla_proletarian.attempt": job["attempts"] + 1,
            },
            links=links,
        )
        # The handler sees the enqueuer's baggage too, under the run's span.
        self._context = trace.set_span_in_context(self._span, parent)
        self._context = otel_context.set_value(_RUN_KEY, self, self._context)
        self._outcome: str | None = None
        self._error: BaseException | None = None
        self._token: Token[Context] | None = None
        self._started = 0.0

    def __enter__(self) -> Run:
        self._token = otel_context.attach(self._context)
        self._started = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        duration = time.perf_counter() - self._started
        if self._token is not None:
            otel_context.detach(self._token)
        span = self._span
        if exc is not None:
            self._outcome = INTERRUPTED
            self.error(exc)
        outcome = self._outcome or INTERRUPTED
        span.set_attribute(_OUTCOME, outcome)
        span.end()
        attributes = {**self._metric_attributes, _OUTCOME: outcome}
        self._instruments.jobs.add(1, attributes)
        self._instruments.duration.record(duration, attributes)

    def ended(self, outcome: str, error: BaseException | None = None) -> None:
        self._outcome = outcome
        if error is not None:
            self.error(error)

    def error(self, error: BaseException) -> None:
        """Record what failed the run, each exception once (a handler's is recorded when it
        is caught, and again given with the outcome that follows from it)."""
        if error is self._error:
            return
        self._error = error
        span = self._span
        span.record_exception(error)
        span.set_attribute("error.type", _type_name(error))
        span.set_status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}")


def run_span(job: Mapping[str, Any], claimed_at: datetime | None) -> Run:
    """The span and metrics of a run of ``job`` (a claimed row), claimed at ``claimed_at``
    (the worker's clock); its handler runs inside the ``with`` block."""
    if not ENABLED or (job.get("trace_context") is None and not _sdk_configured()):
        return _NO_RUN
    return _TracedRun(job, claimed_at)


def _context_from_outside() -> bool:
    """Whether a span context or baggage is current (one that reached the process from
    outside, which the no-op tracer passes on)."""
    return trace.get_current_span().get_span_context().is_valid or bool(baggage.get_all())


#: Whether a tracer or meter provider was found set (once set, a provider stays).
_configured = False
#: The environment variables that name a provider for the API to load on first use, as
#: the process started with them (read once: the API's getters read the environment on
#: every call, a lookup that cost a few microseconds a job).
_PROVIDER_VARIABLES = ("OTEL_PYTHON_TRACER_PROVIDER", "OTEL_PYTHON_METER_PROVIDER")
_providers_from_environment = any(name in os.environ for name in _PROVIDER_VARIABLES)


def _sdk_configured() -> bool:
    """Whether the application has set a tracer or meter provider: until it does, the API's
    spans and metrics record nothing, so a run with no stored context to carry needs none.
    (Any provider but the API's own placeholders counts.)"""
    global _configured
    if _configured:
        return True
    if (
        not _providers_from_environment
        and getattr(trace, "_TRACER_PROVIDER", ...) is None
        and getattr(_metrics_api, "_METER_PROVIDER", ...) is None
    ):
        return False  # neither is set: the getters would return their placeholders
    _configured = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider) or (
        type(metrics.get_meter_provider()).__name__ != "_ProxyMeterProvider"
    )
    return _configured


def job_error(error: BaseException) -> None:
    """Record the exception that failed the current run (a handler's) on its span."""
    if not ENABLED:
        return
    run = otel_context.get_value(_RUN_KEY)
    if isinstance(run, _TracedRun):
        run.error(error)


def _extract(stored: object) -> Context | None:
    """The context a job's stored ``trace_context`` carries, or None when it has none that
    can be read (absent, or written by hand): the run then starts a trace of its own."""
    if not isinstance(stored, str):
        return None
    try:
        carrier = json.loads(stored)
        if not isinstance(carrier, dict):
            return None
        headers = {k: v for k, v in carrier.items() if isinstance(k, str) and isinstance(v, str)}
        extracted = propagate.extract(headers)
    except Exception:
        return None
    if not trace.get_current_span(extracted).get_span_context().is_valid:
        return None
    return extracted


def _type_name(error: BaseException) -> str:
    kind = type(error)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
