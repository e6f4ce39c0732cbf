"""A queue worker's options: their defaults, and the checks that refuse a bad one with
advice (``WorkerOptions``, built from ``create_queue_worker``'s keywords)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from sqla_proletarian import ledger
from sqla_proletarian.errors import ConfigurationError
from sqla_proletarian.leases import check_lease_settings, check_task_timeouts
from sqla_proletarian.models import DEFAULT_QUEUE
from sqla_proletarian.periodic import PeriodicJob, check_periodic_jobs
from sqla_proletarian.progress import DEFAULT_PROGRESS_INTERVAL
from sqla_proletarian.results import DEFAULT_MAX_RESULT_BYTES as DEFAULT_MAX_RESULT_BYTES
from sqla_proletarian.results import check_max_result_bytes
from sqla_proletarian.running import FailedJobHandler, RetryStrategyFn, RunSettings
from sqla_proletarian.serialization import DEFAULT_SERIALIZER, Serializer
from sqla_proletarian.values import Clock, check_name, utc_now

DEFAULT_WORKER_THREADS = 1
#: Seconds to wait before polling again once the queue is drained.
DEFAULT_POLLING_INTERVAL = 0.1
#: Seconds stop() waits for running jobs to finish.
DEFAULT_AWAIT_TERMINATION_TIMEOUT = 10.0
#: Runs of one job that may end uncleanly (worker died) before it is archived as failed.
DEFAULT_MAX_UNCLEAN_ENDS = 3
#: Seconds a dead-looking worker's run records wait before they count as unclean ends: its
#: session may have ended with a restart, a failover or a kill while the worker lives on.
DEFAULT_RECONNECT_GRACE = ledger.OWNER_GRACE
#: Jobs a thread claims in one transaction (1: the original's semantics).
DEFAULT_BATCH_SIZE = 1
#: Largest batch_size accepted.
MAX_BATCH_SIZE = 1000

PollingErrorHandler = Callable[[Exception], object]


def stop_on_polling_error(exc: Exception) -> bool:
    """The default polling-error handler: stop, as the original does."""
    return True


@dataclass(frozen=True)
class WorkerOptions:
    """A queue worker's options, checked; see create_queue_worker for their meaning."""

    queue: str = DEFAULT_QUEUE
    #: The queues served, in claim order (``queue`` alone when not given; ``queue`` is then
    #: the first of them).
    queues: tuple[str, ...] = ()
    worker_threads: int = DEFAULT_WORKER_THREADS
    polling_interval: float = DEFAULT_POLLING_INTERVAL
    retry_strategy: RetryStrategyFn | None = None
    failed_job_handler: FailedJobHandler | None = None
    on_polling_error: PollingErrorHandler = stop_on_polling_error
    handler_mode: Literal["default", "advanced"] = "default"
    install_signal_handlers: bool = False
    on_shutdown: Callable[[], object] | None = None
    await_termination_timeout: float = DEFAULT_AWAIT_TERMINATION_TIMEOUT
    worker_id: str | None = None
    serializer: Serializer = field(default=DEFAULT_SERIALIZER)
    clock: Clock = utc_now
    max_unclean_ends: int | None = DEFAULT_MAX_UNCLEAN_ENDS
    batch_size: int = DEFAULT_BATCH_SIZE
    poll_only: bool = False
    periodic_jobs: tuple[PeriodicJob, ...] = ()
    reconnect_grace: float = DEFAULT_RECONNECT_GRACE
    lease_seconds: float | None = None
    heartbeat_interval: float | None = None
    job_timeout: float | None = None
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL
    max_result_bytes: int | None = DEFAULT_MAX_RESULT_BYTES

    def __post_init__(self) -> None:
        queues = check_queues(self.queues) if self.queues != () else (self.queue,)
        check_name("queue", self.queue)
        if self.queues != () and self.queue not in (DEFAULT_QUEUE, queues[0]):
            raise ConfigurationError(
                f"queue is {self.queue!r} and queues is {list(queues)!r}; give one of them "
                "(queues=[...] for several queues, claimed in the order given)"
            )
        object.__setattr__(self, "queues", queues)
        object.__setattr__(self, "queue", queues[0])
        _positive_int("worker_threads", self.worker_threads)
        _positive("polling_interval", self.polling_interval)
        _non_negative("await_termination_timeout", self.await_termination_timeout)
        _non_negative("reconnect_grace", self.reconnect_grace)
        _non_negative("progress_interval", self.progress_interval)
        if self.handler_mode not in ("default", "advanced"):
            raise ConfigurationError(
                f"handler_mode is {self.handler_mode!r}; use 'default' for "
                "handler(job_type, payload) or 'advanced' for handler(job)"
            )
        for name in ("retry_strategy", "failed_job_handler", "on_polling_error", "on_shutdown"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigurationError(f"{name} is {value!r}; give a function or None")
        if self.max_unclean_ends is not None:
            _positive_int("max_unclean_ends", self.max_unclean_ends)
        _positive_int("batch_size", self.batch_size)
        for flag in ("poll_only", "install_signal_handlers"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigurationError(f"{flag} is {getattr(self, flag)!r}; give True or False")
        if self.batch_size > MAX_BATCH_SIZE:
            raise ConfigurationError(
                f"batch_size is {self.batch_size}; give at most {MAX_BATCH_SIZE} (a batch "
                "holds its jobs' row locks until its last handler has run)"
            )
        check_lease_settings(self.lease_seconds, self.heartbeat_interval, self.job_timeout)
        check_max_result_bytes(self.max_result_bytes)
        if self.worker_id is None:
            object.__setattr__(self, "worker_id", f"proletarian[{self.queue_names}]")
        object.__setattr__(self, "periodic_jobs", check_periodic_jobs(self.periodic_jobs))

    @property
    def queue_names(self) -> str:
        """The queues as names and logs show them: comma-separated, in claim order."""
        return ",".join(self.queues)

    @classmethod
    def from_parameters(cls, given: dict[str, Any]) -> WorkerOptions:
        """Build options from a creator's keyword parameters (its ``locals()``, whose
        names are the options' own), leaving out what is not an option."""
        return cls(**{name: given[name] for name in cls.__dataclass_fields__ if name in given})

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> WorkerOptions:
        """Build options from keyword arguments, naming any that do not exist."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigurationError(
                f"unknown worker option(s) {', '.join(unknown)}; "
                f"the options are {', '.join(sorted(known))}"
            )
        if "queue" in options and "queues" in options:
            raise ConfigurationError(
                "both queue and queues were given; give queue='name' for one queue, or "
                "queues=[...] for several, claimed in the order given"
            )
        return cls(**options)

    def run_settings(self, handler: Callable[..., Any]) -> RunSettings:
        if not callable(handler):
            raise ConfigurationError(f"the handler is {handler!r}; give a function")
        assert self.worker_id is not None
        tasks = RunSettings.task_settings(handler)
        check_task_timeouts(self.lease_seconds, tasks["task_timeouts"])
        return RunSettings(
            queues=self.queues,
            handler=handler,
            handler_mode=self.handler_mode,
            retry_strategy=self.retry_strategy,
            failed_job_handler=self.failed_job_handler,
            serializer=self.serializer,
            clock=self.clock,
            worker_id=self.worker_id,
            max_unclean_ends=self.max_unclean_ends,
            batch_size=self.batch_size,
            reconnect_grace=self.reconnect_grace,
            lease_seconds=self.lease_seconds,
            heartbeat_interval=self.heartbeat_interval,
            job_timeout=self.job_timeout,
            progress_interval=self.progress_interval,
            max_result_bytes=self.max_result_bytes,
            **tasks,
        )


def check_queues(queues: object) -> tuple[str, ...]:
    """The ``queues`` option as a tuple: one or more distinct queue names, in claim order."""
    if isinstance(queues, str) or not isinstance(queues, list | tuple):
        raise ConfigurationError(
            f"queues is {queues!r}; give a list of queue names, e.g. queues=['critical', "
            "'default'] (claimed in that order), or queue='name' for one queue"
        )
    if not queues:
        raise ConfigurationError("queues is empty; give at least one queue name")
    for name in queues:
        check_name("queues", name)
    repeated = sorted({name for name in queues if queues.count(name) > 1})
    if repeated:
        raise ConfigurationError(
            f"queues lists {', '.join(map(repr, repeated))} more than once; give each queue once"
        )
    return tuple(queues)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} is {value!r}; give a whole number >= 1")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigurationError(
            f"{name} is {value!r}; give a number of seconds > 0 (0 would poll without pause)"
        )


def _non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigurationError(f"{name} is {value!r}; give a number of seconds >= 0")
