"""Tasks: a plain function registered as its job type's handler (``JobHandlers.task``), and
enqueued with its own arguments, checked against its signature before anything is written.

A task's job carries its arguments as the payload, ``{"args": [...], "kwargs": {...}}``,
through the worker's serializer; the worker calls the function with them, in either handler
mode and either worker (an ``async def`` task runs in the asyncio worker).
"""

from __future__ import annotations

import functools
import inspect
import math
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from sqla_proletarian.enqueue import enqueue, enqueue_many
from sqla_proletarian.errors import ConfigurationError, InvalidJobError
from sqla_proletarian.retry import RetryStrategy
from sqla_proletarian.values import (
    DEFAULT_PRIORITY,
    DEFAULT_QUEUE,
    check_concurrency_key,
    check_name,
    check_priority,
    check_unique_key,
)
from sqla_proletarian.workflows import OnDependencyFailure, check_depends_on

if TYPE_CHECKING:
    from sqla_proletarian.enqueue import SessionOrConnection, Transaction

P = ParamSpec("P")
R = TypeVar("R")

#: A task's ``unique_key`` or ``concurrency_key``: a string, or a function of the task's
#: arguments that returns one (or None: no key for that job).
Key = str | Callable[..., str | None] | None
#: A task's ``retry``: a RetryStrategy, or a function as the worker's ``retry_strategy``.
Retry = RetryStrategy | Callable[[Any, Exception], Any] | None


class _Unset:
    """An option that ``with_options`` was not given (None is a value there: no key)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclass(frozen=True)
class EnqueueOptions:
    """Where and when a task's jobs go: its defaults, and what ``with_options`` overrides."""

    queue: str = DEFAULT_QUEUE
    priority: int = DEFAULT_PRIORITY
    unique_key: Key = None
    concurrency_key: Key = None
    process_at: datetime | None = None
    process_in: timedelta | float | None = None
    #: The jobs a job of the task waits for (``enqueue``'s ``depends_on``).
    depends_on: tuple[uuid.UUID, ...] = ()
    on_dependency_failure: OnDependencyFailure = "cancel"

    def __post_init__(self) -> None:
        check_name("queue", self.queue)
        check_priority(self.priority)
        for name in ("unique_key", "concurrency_key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str) and not callable(value):
                raise ConfigurationError(
                    f"{name} is {value!r}; give a string, a function of the task's arguments "
                    "that returns one, or None"
                )
        if isinstance(self.unique_key, str):
            check_unique_key(self.unique_key)
        if isinstance(self.concurrency_key, str):
            check_concurrency_key(self.concurrency_key)

    def key(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The job's ``unique_key`` or ``concurrency_key`` for these arguments."""
        key: Key = getattr(self, name)
        if key is None or isinstance(key, str):
            return key
        made = key(*args, **kwargs)
        if made is not None and not isinstance(made, str):
            raise InvalidJobError(
                name, f"the {name} function returned {made!r}; return a string, or None"
            )
        return made


class Task(Generic[P, R]):
    """A function registered as the handler of its job type by ``JobHandlers.task``.

    Calling the task calls the function. ``enqueue(session, *args, **kwargs)`` adds a job
    that calls it with those arguments to the caller's transaction (never committing), as
    ``sqla_proletarian.enqueue`` does, after checking them against the function's signature;
    ``with_options(...)`` gives the same task with other enqueue options.
    """

    def __init__(
        self,
        fn: Callable[P, R],
        job_type: str,
        options: EnqueueOptions,
        retry: Retry = None,
        timeout: float | None = None,
    ) -> None:
        self.fn = fn
        self.job_type = job_type
        self.options = options
        #: The retry strategy of this job type's runs (None: the worker's).
        self.retry = retry
        #: Lease mode: seconds a run of this job type may take (None: the worker's
        #: ``job_timeout``).
        self.timeout = timeout
        self._signature = inspect.signature(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Task {self.job_type!r}>"

    def enqueue(
        self, session_or_connection: SessionOrConnection, /, *args: P.args, **kwargs: P.kwargs
    ) -> uuid.UUID:
        """Add a job that calls the function with these arguments to the caller's
        transaction and return its id. Never commits. Arguments the function would refuse
        (missing, unknown, too many) raise InvalidJobError naming them; nothing is written."""
        self._check_arguments("arguments", args, kwargs)
        options = self.options
        return enqueue(
            session_or_connection,
            self.job_type,
            {"args": list(args), "kwargs": kwargs},
            queue=options.queue,
            priority=options.priority,
            process_at=options.process_at,
            process_in=options.process_in,
            unique_key=options.key("unique_key", args, kwargs),
            concurrency_key=options.key("concurrency_key", args, kwargs),
            depends_on=options.depends_on or None,
            on_dependency_failure=options.on_dependency_failure,
        )

    def enqueue_many(
        self,
        session_or_connection: Transaction,
        calls: Iterable[tuple[Any, ...] | Mapping[str, Any]],
    ) -> list[uuid.UUID]:
        """Add a job per call, a tuple of positional arguments or a dict of keyword
        arguments, to the caller's transaction; their ids in order. Never commits. Every
        call is checked first: a bad one raises InvalidJobError naming its index (``calls[2]``)
        and the argument, and nothing is written. Goes through ``sqla_proletarian.enqueue_many``
        (one call per concurrency key, when the task's key is a function)."""
        jobs: list[tuple[str | None, tuple[str, Any, str | None]]] = []
        for index, call in enumerate(calls):
            args, kwargs = _call_arguments(call, index)
            field = f"calls[{index}]"
            self._check_arguments(field, args, kwargs)
            try:
                unique_key = self.options.key("unique_key", args, kwargs)
                concurrency_key = self.options.key("concurrency_key", args, kwargs)
            except InvalidJobError as exc:
                raise InvalidJobError(field, str(exc)) from exc
            payload = {"args": list(args), "kwargs": kwargs}
            jobs.append((concurrency_key, (self.job_type, payload, unique_key)))
        ids: list[uuid.UUID | None] = [None] * len(jobs)
        for key in dict.fromkeys(key for key, _ in jobs):
            places = [n for n, (k, _) in enumerate(jobs) if k == key]
            made = enqueue_many(
                session_or_connection,
                [jobs[n][1] for n in places],
                queue=self.options.queue,
                priority=self.options.priority,
                process_at=self.options.process_at,
                process_in=self.options.process_in,
                concurrency_key=key,
                depends_on=self.options.depends_on or None,
                on_dependency_failure=self.options.on_dependency_failure,
            )
            for n, job_id in zip(places, made, strict=True):
                ids[n] = job_id
        return [job_id for job_id in ids if job_id is not None]

    def with_options(
        self,
        *,
        process_in: timedelta | float | None = UNSET,
        process_at: datetime | None = UNSET,
        priority: int = UNSET,
        queue: str = UNSET,
        unique_key: Key = UNSET,
        concurrency_key: Key = UNSET,
        depends_on: Iterable[uuid.UUID] | None = UNSET,
        on_dependency_failure: OnDependencyFailure = UNSET,
    ) -> Task[P, R]:
        """The same task (function, job type, retry, timeout) whose ``enqueue`` and
        ``enqueue_many`` use these options instead of the task's own. ``depends_on`` and
        ``on_dependency_failure`` as for ``sqla_proletarian.enqueue``: every job enqueued
        through the returned task waits for those jobs."""
        if depends_on is not UNSET or on_dependency_failure is not UNSET:
            policy = (
                self.options.on_dependency_failure
                if on_dependency_failure is UNSET
                else on_dependency_failure
            )
            ids = self.options.depends_on if depends_on is UNSET else depends_on
            depends_on = tuple(check_depends_on(ids, policy))
            on_dependency_failure = policy
        given: dict[str, Any] = {
            "process_in": process_in,
            "process_at": process_at,
            "priority": priority,
            "queue": queue,
            "unique_key": unique_key,
            "concurrency_key": concurrency_key,
            "depends_on": depends_on,
            "on_dependency_failure": on_dependency_failure,
        }
        options = replace(self.options, **{name: v for name, v in given.items() if v is not UNSET})
        return Task(self.fn, self.job_type, options, self.retry, self.timeout)

    def run(self, payload: Any) -> R:
        """Call the function with the arguments a job of this task carries."""
        if (
            not isinstance(payload, dict)
            or set(payload) != {"args", "kwargs"}
            or not isinstance(payload["args"], list)
            or not isinstance(payload["kwargs"], dict)
        ):
            raise InvalidJobError(
                "payload",
                f"{payload!r} is no task's payload; a job of task {self.job_type!r} carries "
                '{"args": [...], "kwargs": {...}}: enqueue it with the task\'s enqueue()',
            )
        return self.fn(*payload["args"], **payload["kwargs"])

    def _check_arguments(self, field: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InvalidJobError(
                field,
                f"task {self.job_type!r} cannot be called with these arguments: {exc} "
                f"(its signature is {self._signature})",
            ) from None


def new_task(
    fn: Callable[P, R],
    job_type: str | None,
    options: EnqueueOptions,
    retry: Retry,
    timeout: float | None,
) -> Task[P, R]:
    """A task of ``fn``, its settings checked; its job type ``module.qualname`` unless given."""
    if not callable(fn):
        raise ConfigurationError(f"task() decorates a function, not {fn!r}")
    if job_type is None:
        job_type = f"{fn.__module__}.{fn.__qualname__}"
    check_name("job type", job_type)
    if retry is not None and not isinstance(retry, RetryStrategy) and not callable(retry):
        raise ConfigurationError(
            f"retry is {retry!r}; give a sqla_proletarian.RetryStrategy, a function of "
            "(job, exception) as the worker's retry_strategy, or None for the worker's"
        )
    if timeout is not None:
        from sqla_proletarian.leases import MAX_JOB_TIMEOUT

        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not (math.isfinite(timeout) and 0 < timeout <= MAX_JOB_TIMEOUT)
        ):
            raise ConfigurationError(
                f"timeout is {timeout!r}; give a number of seconds > 0, up to "
                f"{MAX_JOB_TIMEOUT:g} (a week), or None for the worker's job_timeout"
            )
    return Task(fn, job_type, options, retry, timeout)


def _call_arguments(call: object, index: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An enqueue_many call's positional and keyword arguments."""
    if isinstance(call, tuple):
        return call, {}
    if isinstance(call, Mapping) and all(isinstance(name, str) for name in call):
        return (), dict(call)
    raise InvalidJobError(
        f"calls[{index}]",
        f"{call!r}: give a tuple of positional arguments, e.g. (42,), or a dict of keyword "
        "arguments, e.g. {'user_id': 42}",
    )
