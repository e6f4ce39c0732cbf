"""What a handler receives (JobContext; AsyncJobContext in the asyncio worker, and
``current_job()`` from anywhere the handler calls) and a dispatch table by job type
(JobHandlers, whose ``task`` decorator makes tasks)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

from sqlalchemy import Connection, Engine, NestedTransaction, event
from sqlalchemy.orm import Session

from sqla_proletarian.errors import (
    ConfigurationError,
    JobTransactionLostError,
    NoCurrentJobError,
    UnknownJobTypeError,
)
from sqla_proletarian.progress import ProgressWriter, check_progress
from sqla_proletarian.tasks import EnqueueOptions, Key, Retry, Task, new_task
from sqla_proletarian.values import DEFAULT_PRIORITY, DEFAULT_QUEUE

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession


class _Guard:
    """Listens to one job connection's statements (``before_cursor_execute``, which also
    sees ``exec_driver_sql``): while a handler runs there and has not opened the worker's
    savepoint yet, its first statement, however it reaches the connection, opens it."""

    __slots__ = ("__weakref__", "session")

    #: The worker's own listener: ``direct`` calls it itself instead of leaving the
    #: statement to ``Connection.execute``.
    worker_own = True

    def __init__(self) -> None:
        self.session: JobSession | None = None

    def __call__(
        self, conn: Connection, cursor: Any, statement: str, parameters: Any, *args: Any
    ) -> tuple[str, Any]:
        session = self.session
        if session is not None:
            session.open_savepoint()
        return statement, parameters


_LOCK = threading.Lock()
_GUARDS: weakref.WeakKeyDictionary[Connection, _Guard] = weakref.WeakKeyDictionary()


def _guard_of(conn: Connection) -> _Guard:
    """The connection's guard, listening from its first job on."""
    with _LOCK:
        guard = _GUARDS.get(conn)
        if guard is None:
            guard = _GUARDS[conn] = _Guard()
            event.listen(conn, "before_cursor_execute", guard, retval=True)
    return guard


@contextlib.contextmanager
def worker_reads(conn: Connection) -> Iterator[None]:
    """The worker's own reads on a job's connection while its handler runs: they open no
    savepoint for the handler."""
    guard = _GUARDS.get(conn)
    session = guard.session if guard is not None else None
    if guard is not None:
        guard.session = None
    try:
        yield
    finally:
        if guard is not None:
            guard.session = session


class JobSession(Session):
    """The handler's Session, inside a savepoint of the job's own transaction.

    The worker owns that savepoint, opened when the handler first executes anything on the
    job's connection (through the session, ``session.connection()`` or ``session.bind``), so
    whatever the handler does (``commit()``, ``with session.begin():``, ``begin_nested()``,
    ``rollback()``, statements on the connection), its writes commit together with the job's
    outcome and roll back if it raises. ``commit()`` only flushes. A handler that executes
    nothing costs no savepoint. Once the outcome is recorded the session is closed for good,
    so late use fails instead of writing nothing.
    """

    def __init__(self, bind: Connection) -> None:
        super().__init__(
            bind=bind, join_transaction_mode="create_savepoint", close_resets_only=False
        )
        self.job_connection = bind
        #: The worker's savepoint around everything the handler did; None until first use.
        self.handler_savepoint: NestedTransaction | None = None
        self._guard: _Guard | None = None
        self._closed = False

    def get_bind(self, *args: Any, **kwargs: Any) -> Engine | Connection:
        """The job's connection. The first time the session is about to use it, the worker's
        savepoint is opened there, before the session's own: only where the session does
        I/O anyway (an AsyncSession's ``add()`` in the asyncio worker could not)."""
        self.open_savepoint()
        return super().get_bind(*args, **kwargs)

    def open_savepoint(self) -> None:
        """Open the worker's savepoint on the job's connection, unless it is open already."""
        if self.handler_savepoint is None and not self._closed:
            if self._guard is not None:
                self._guard.session = None  # its own SAVEPOINT statement must not recurse
            self.handler_savepoint = self.job_connection.begin_nested()

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """While the handler runs: its first statement on the job's connection, however it
        reaches it, opens the worker's savepoint (the worker's own statements never do)."""
        self.start_handling()
        try:
            yield
        finally:
            self.stop_handling()

    def start_handling(self) -> None:
        """The handler runs from now on (see ``handling``)."""
        guard = self._guard = _guard_of(self.job_connection)
        if self.handler_savepoint is None:
            guard.session = self

    def stop_handling(self) -> None:
        """The handler has returned (see ``handling``)."""
        if self._guard is not None:
            self._guard.session = None

    def close(self) -> None:
        """Close the session for good (it never opens the worker's savepoint again)."""
        self._closed = True
        super().close()

    def commit(self) -> None:
        """Flush the handler's writes; they commit with the job's outcome."""
        self.flush()

    def finish(self) -> None:
        """Keep the handler's writes in the job's transaction (the worker calls it).

        Raises what the final flush raises (a failure of the handler's writes); a savepoint
        that cannot be released means the job's transaction is gone.
        """
        if self.in_transaction():
            super().commit()
        if self.handler_savepoint is not None:
            try:
                self.handler_savepoint.commit()
            except Exception as exc:
                raise JobTransactionLostError(
                    f"the handler's savepoint could not be released ({exc!r})"
                ) from exc

    def discard(self) -> None:
        """Undo everything the handler wrote; the job's transaction itself goes on."""
        with contextlib.suppress(Exception):
            self.close()
        if self.handler_savepoint is not None and self.handler_savepoint.is_active:
            try:
                self.handler_savepoint.rollback()
            except Exception as exc:
                raise JobTransactionLostError(
                    f"the handler's savepoint could not be rolled back ({exc!r})"
                ) from exc


class StopSignal(threading.Event):
    """``job.cancel_requested``: an Event the worker sets when it wants the handler to stop
    (a cancel request, the job's timeout, a lost lease, a stop that gave up waiting), with
    the reason, and callbacks run when it is set (the asyncio worker's, to cancel a task)."""

    def __init__(self) -> None:
        super().__init__()
        #: Why the stop was asked for: "cancelled", "timed-out", "lease-lost", "stopping".
        self.reason: str | None = None
        self._callbacks: list[Callable[[], object]] = []
        self._lock = threading.Lock()

    def request(self, reason: str) -> bool:
        """Ask the handler to stop, for ``reason``; False if it was asked already."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason = reason
            callbacks = list(self._callbacks)
        self.set()
        for callback in callbacks:
            with contextlib.suppress(Exception):
                callback()
        return True

    def add_callback(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` when the stop is requested (at once if it was already)."""
        with self._lock:
            if self.reason is None:
                self._callbacks.append(callback)
                return
        callback()


@dataclass(frozen=True)
class _ClaimedJob:
    """What every view of a claimed job holds, whatever its session."""

    job_id: uuid.UUID
    queue: str
    job_type: str
    payload: Any
    attempts: int
    enqueued_at: datetime
    process_at: datetime
    #: Where ``set_progress`` reports go: the worker's writer (None: reports are checked only).
    progress_writer: ProgressWriter | None = field(
        default=None, kw_only=True, repr=False, compare=False
    )

    def set_progress(self, fraction: float, message: str | None = None) -> None:
        """Report how far the job has come: ``fraction`` from 0 to 1 and an optional
        ``message`` (cut to ``progress.MAX_MESSAGE_CHARS`` characters). Returns at once: the
        worker writes it on a connection of its own, committed at once, at most once per
        ``progress_interval`` (the latest report wins) and when the handler returns; see
        docs/guide/progress.md. Raises InvalidProgressError for a bad fraction or message."""
        if self.progress_writer is None:
            check_progress(fraction, message)
        else:
            self.progress_writer.report(self.job_id, fraction, message)

    @property
    def dependency_results(self) -> dict[uuid.UUID, Any]:
        """The results of the job's dependencies (``depends_on``), by their job ids: what
        each one's handler returned, or None when it returned None or did not succeed (a
        dependent of ``on_dependency_failure="run"``). Read on first access."""
        known = self.__dict__.get("_dependency_results")
        if known is None:
            read = getattr(self, "_read_dependencies", None)
            known = read() if read is not None else {}
            object.__setattr__(self, "_dependency_results", known)
        return dict(known)


#: Reads a running job's dependencies' results (see ``_ClaimedJob.dependency_results``).
DependencyReader = Callable[[], dict[uuid.UUID, Any]]


class SessionOnFirstUse:
    """Stands for a context's ``session`` (or, in an AsyncJobContext, its
    ``cancel_requested``) until it is first read: a handler that never reads it costs no
    Session (or Event). ``make`` returns the value."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


def _session_made_on_first_use(context: Any, name: str) -> Any:
    """A context's attribute, made if this is its first read (see SessionOnFirstUse)."""
    value = object.__getattribute__(context, name)
    if type(value) is SessionOnFirstUse:
        value = value.make()
        object.__setattr__(context, name, value)
    return value


@dataclass(frozen=True)
class JobContext(_ClaimedJob):
    """A claimed job, as an advanced-mode handler (and retry strategies) see it.

    ``attempts`` is 1 on the first run. ``session`` is bound to the job's own transaction:
    what the handler writes through it commits with the job's archive row, or rolls back if
    the handler raises. In lease mode it is a Session of the job's own, which takes a
    connection and opens its transaction on first use; the worker completes the job in
    that transaction. ``cancel_requested`` is set when the worker wants the handler to stop
    (lease mode: a cancel request, ``job_timeout``, a lost lease, a stop that gave up).
    ``dependency_results``: the results of the jobs it depends on, by job id.
    """

    session: Session = field(repr=False, compare=False)
    cancel_requested: threading.Event = field(default_factory=StopSignal, repr=False, compare=False)
    _read_dependencies: DependencyReader | None = field(default=None, repr=False, compare=False)

    def __getattribute__(self, name: str) -> Any:
        return _session_made_on_first_use(self, name)


@dataclass(frozen=True)
class AsyncJobContext(_ClaimedJob):
    """A claimed job, as the asyncio worker's advanced-mode handler (and its retry strategy
    and failed-job handler) see it: a JobContext whose ``session`` is an AsyncSession over
    the job's own transaction, with the same promise (its writes commit with the job's
    archive row, or roll back if the handler raises). ``cancel_requested`` is an
    asyncio.Event; when it is set, the handler's task is cancelled too.
    """

    session: AsyncSession = field(repr=False, compare=False)
    cancel_requested: asyncio.Event = field(
        default_factory=asyncio.Event, repr=False, compare=False
    )
    _read_dependencies: DependencyReader | None = field(default=None, repr=False, compare=False)

    def __getattribute__(self, name: str) -> Any:
        return _session_made_on_first_use(self, name)


F = TypeVar("F", bound=Callable[..., Any])
P = ParamSpec("P")
R = TypeVar("R")

#: How the running job's context is made, while its handler runs (made on first use: a
#: default-mode handler that never asks costs no context).
_RUNNING_JOB: ContextVar[Callable[[], JobContext | AsyncJobContext] | None] = ContextVar(
    "running_job", default=None
)


def current_job() -> JobContext | AsyncJobContext:
    """The running job's JobContext (an AsyncJobContext in the asyncio worker), from its
    handler or task or anything they call in the same thread or task, in either handler
    mode. Raises NoCurrentJobError (a LookupError) when no job runs there."""
    made = _RUNNING_JOB.get()
    if made is None:
        raise NoCurrentJobError()
    return made()


@contextlib.contextmanager
def running_job(context_of: Callable[[], JobContext | AsyncJobContext]) -> Iterator[None]:
    """While the handler runs: ``current_job()`` returns what ``context_of`` makes."""
    token = _RUNNING_JOB.set(context_of)
    try:
        yield
    finally:
        _RUNNING_JOB.reset(token)


def running_job_maker() -> Callable[[], JobContext | AsyncJobContext]:
    """What makes the running job's context (the asyncio worker makes its own from it)."""
    made = _RUNNING_JOB.get()
    if made is None:
        raise NoCurrentJobError()
    return made


class JobHandlers:
    """A handler that dispatches on job type, like Proletarian's ``defmulti``.

    Works in both handler modes and in both workers: registered functions receive exactly
    what the worker passes, ``(job_type, payload)`` or ``(job)``, and return what they
    return (the asyncio worker awaits a coroutine); tasks (``task``) receive the arguments
    their jobs were enqueued with.
    """

    def __init__(self) -> None:
        self._handlers: dict[str, Callable[..., Any]] = {}
        self._default: Callable[..., Any] | None = None
        #: The tasks by job type (each also in ``_handlers``, as its function).
        self._tasks: dict[str, Task[..., Any]] = {}

    def register(self, job_type: str) -> Callable[[F], F]:
        """Decorator: handle jobs of ``job_type`` with the decorated function."""
        if not isinstance(job_type, str) or not job_type:
            raise ConfigurationError(f"job type {job_type!r}: give a non-empty string")

        def decorate(fn: F) -> F:
            self._add(job_type, fn)
            return fn

        return decorate

    @overload
    def task(self, job_type: Callable[P, R], /) -> Task[P, R]: ...

    @overload
    def task(
        self,
        job_type: str | None = None,
        *,
        queue: str = DEFAULT_QUEUE,
        priority: int = DEFAULT_PRIORITY,
        retry: Retry = None,
        timeout: float | None = None,
        unique_key: Key = None,
        concurrency_key: Key = None,
    ) -> Callable[[Callable[P, R]], Task[P, R]]: ...

    def task(
        self,
        job_type: str | Callable[..., Any] | None = None,
        *,
        queue: str = DEFAULT_QUEUE,
        priority: int = DEFAULT_PRIORITY,
        retry: Retry = None,
        timeout: float | None = None,
        unique_key: Key = None,
        concurrency_key: Key = None,
    ) -> Any:
        """Decorator: handle jobs of ``job_type`` (default: the function's
        ``module.qualname``) with a plain function of its own arguments, and return it as a
        Task, still callable as the function, with ``enqueue(session, *args, **kwargs)``.

        ``queue``, ``priority``, ``unique_key`` and ``concurrency_key`` are its jobs'
        defaults (``with_options`` overrides them); the keys may be functions of the task's
        arguments. ``retry`` (a RetryStrategy, or a function as the worker's
        ``retry_strategy``) replaces the worker's retry strategy for this job type;
        ``timeout`` is its runs' ``job_timeout`` in lease mode (a worker without
        ``lease_seconds`` refuses the handler).
        """
        if callable(job_type):  # @handlers.task, without parentheses
            return self.task()(job_type)
        options = EnqueueOptions(
            queue=queue, priority=priority, unique_key=unique_key, concurrency_key=concurrency_key
        )

        def decorate(fn: Callable[P, R]) -> Task[P, R]:
            made = new_task(fn, job_type, options, retry, timeout)
            self._add(made.job_type, fn)
            self._tasks[made.job_type] = made
            return made

        return decorate

    def task_of(self, job_type: str) -> Task[..., Any] | None:
        """The task of ``job_type``, if a task handles it."""
        return self._tasks.get(job_type)

    def tasks(self) -> list[Task[..., Any]]:
        """Every task, in the order they were made."""
        return list(self._tasks.values())

    def _add(self, job_type: str, fn: Callable[..., Any]) -> None:
        if job_type in self._handlers:
            raise ConfigurationError(
                f"job type {job_type!r} already has a handler "
                f"({self._handlers[job_type].__qualname__}); register each type once"
            )
        self._handlers[job_type] = fn

    def default(self, fn: F) -> F:
        """Decorator: handle every job type that has no handler of its own."""
        self._default = fn
        return fn

    def handler_for(self, job_type: str) -> Callable[..., Any]:
        """The function that handles ``job_type`` (a task's own function, which takes its
        jobs' arguments); raises UnknownJobTypeError if none does."""
        handler = self._handlers.get(job_type, self._default)
        if handler is None:
            raise UnknownJobTypeError(job_type, self._handlers)
        return handler

    def __contains__(self, job_type: object) -> bool:
        return job_type in self._handlers

    def functions(self) -> list[Callable[..., Any]]:
        """Every registered function, the default's last (if there is one)."""
        return [*self._handlers.values(), *([self._default] if self._default else [])]

    def __call__(self, *args: Any) -> Any:
        if len(args) == 2:
            task = self._tasks.get(args[0])
            return task.run(args[1]) if task else self.handler_for(args[0])(*args)
        if len(args) == 1 and isinstance(args[0], _ClaimedJob):
            task = self._tasks.get(args[0].job_type)
            return (
                task.run(args[0].payload) if task else self.handler_for(args[0].job_type)(args[0])
            )
        raise TypeError(
            "JobHandlers is called as handler(job_type, payload) or handler(job: JobContext)"
        )
