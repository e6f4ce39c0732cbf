"""asyncio: enqueue through an AsyncSession or AsyncConnection, and a queue worker of tasks.

The worker runs the threaded worker's own ``JobRunner`` (claim, handler, outcome, crash
ledger) on the async engine's ``sync_engine``, each call in a greenlet (``greenlet_spawn``),
where SQLAlchemy's asyncio drivers run synchronous code; the handler's coroutine is awaited
there with ``await_only``, inside the job's transaction. This module adds the loop only:
``concurrency`` tasks, idle waits, backoff after transient errors, a graceful stop, and
wake-ups (in-process enqueues on every backend; LISTEN through asyncpg or psycopg on
PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar, cast

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
)
from sqlalchemy.orm import Session, scoped_session
from sqlalchemy.util import await_only, greenlet_spawn

from sqla_proletarian import wakeups
from sqla_proletarian.dialects import dialect_of
from sqla_proletarian.enqueue import _not_a_transaction, enqueue, enqueue_many
from sqla_proletarian.errors import ConfigurationError, NotATransactionError, ProletarianError
from sqla_proletarian.handlers import (
    AsyncJobContext,
    JobContext,
    JobSession,
    SessionOnFirstUse,
    StopSignal,
    running_job,
    running_job_maker,
)
from sqla_proletarian.leases import LeaseRunner, LeaseSession, new_runner
from sqla_proletarian.logs import log_event
from sqla_proletarian.options import (
    DEFAULT_AWAIT_TERMINATION_TIMEOUT,
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_MAX_UNCLEAN_ENDS,
    DEFAULT_POLLING_INTERVAL,
    DEFAULT_RECONNECT_GRACE,
    WorkerOptions,
    stop_on_polling_error,
)
from sqla_proletarian.periodic import PeriodicJob
from sqla_proletarian.polling import Backoff, Idle, Poll, Polling, Stop
from sqla_proletarian.progress import DEFAULT_PROGRESS_INTERVAL
from sqla_proletarian.running import RUNNING_SIGNAL, Outcome, RunSettings
from sqla_proletarian.serialization import DEFAULT_SERIALIZER, Serializer
from sqla_proletarian.values import (
    DEFAULT_PRIORITY,
    DEFAULT_QUEUE,
    Clock,
    JobIdStrategy,
    utc_now,
)
from sqla_proletarian.worker import _check_pool, checked_mode, scheduler_for
from sqla_proletarian.workflows import OnDependencyFailure

#: Tasks running jobs at the same time.
DEFAULT_CONCURRENCY = 1
#: Seconds a job cancelled by a stop past its timeout has to roll back.
CANCEL_GRACE = 5.0

#: Options of the threaded worker that make no sense here, with what to do instead.
_NOT_IN_ASYNCIO = {
    "worker_threads": "the asyncio worker runs jobs in tasks, not threads: give "
    "concurrency=N instead of worker_threads",
    "install_signal_handlers": "the asyncio worker installs no signal handlers: stop it from "
    "your application's own shutdown (a lifespan, or loop.add_signal_handler calling "
    "`await worker.stop()`)",
}
_ASYNC_CONTEXT = "sqla_proletarian.async_context"
#: The field names of each JobContext class (``dataclasses.fields`` builds them anew per call).
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(job: JobContext) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(type(job))
    if names is None:
        names = _FIELD_NAMES[type(job)] = tuple(f.name for f in dataclasses.fields(job))
    return names


T = TypeVar("T")


# --- enqueue ---------------------------------------------------------------------------------


def _sync_of(session_or_connection: object, caller: str) -> Session | Connection:
    """The sync Session or Connection under an AsyncSession or a started AsyncConnection."""
    if isinstance(session_or_connection, async_scoped_session):
        session_or_connection = session_or_connection()
    if isinstance(session_or_connection, AsyncSession):
        return session_or_connection.sync_session
    if isinstance(session_or_connection, AsyncConnection):
        if session_or_connection.sync_connection is None:
            raise NotATransactionError(
                f"{caller}() was given an AsyncConnection that was never started: use "
                "`async with engine.begin() as conn:` (or `await conn.start()`) first"
            )
        return session_or_connection.sync_connection
    if isinstance(session_or_connection, Session | scoped_session | Connection):
        name = caller.removesuffix("_async")
        raise NotATransactionError(
            f"{caller}() takes an AsyncSession or AsyncConnection; for a "
            f"{type(session_or_connection).__name__} call sp.{name}() (no await)"
        )
    if isinstance(session_or_connection, AsyncEngine):
        raise _not_a_transaction(session_or_connection, caller)
    raise NotATransactionError(
        f"{caller}() needs a sqlalchemy AsyncSession or AsyncConnection, not "
        f"{type(session_or_connection).__name__}"
    )


async def enqueue_async(
    session_or_connection: AsyncSession | async_scoped_session[Any] | AsyncConnection,
    job_type: str,
    payload: Any = None,
    *,
    queue: str = DEFAULT_QUEUE,
    process_at: datetime | None = None,
    process_in: timedelta | float | None = None,
    priority: int = DEFAULT_PRIORITY,
    unique_key: str | None = None,
    job_id: uuid.UUID | None = None,
    serializer: Serializer | None = None,
    job_id_strategy: JobIdStrategy | None = None,
    clock: Clock | None = None,
    concurrency_key: str | None = None,
    depends_on: Iterable[uuid.UUID] | None = None,
    on_dependency_failure: OnDependencyFailure = "cancel",
) -> uuid.UUID:
    """``enqueue()`` for asyncio: add a job to the caller's transaction; its id. Never commits.

    With an AsyncSession the job joins the unit of work (flushed with the rest, as
    ``sp.enqueue(async_session, ...)`` does); with an AsyncConnection it is inserted at once
    in the connection's transaction. Same options and validation as ``enqueue()``.
    """
    target = _sync_of(session_or_connection, "enqueue_async")
    return await greenlet_spawn(
        enqueue,
        target,
        job_type,
        payload,
        queue=queue,
        process_at=process_at,
        process_in=process_in,
        priority=priority,
        unique_key=unique_key,
        job_id=job_id,
        serializer=serializer,
        job_id_strategy=job_id_strategy,
        clock=clock,
        concurrency_key=concurrency_key,
        depends_on=depends_on,
        on_dependency_failure=on_dependency_failure,
    )


async def enqueue_many_async(
    session_or_connection: AsyncSession | async_scoped_session[Any] | AsyncConnection,
    jobs: Iterable[tuple[str, Any]],
    *,
    queue: str = DEFAULT_QUEUE,
    process_at: datetime | None = None,
    process_in: timedelta | float | None = None,
    priority: int = DEFAULT_PRIORITY,
    serializer: Serializer | None = None,
    job_id_strategy: JobIdStrategy | None = None,
    clock: Clock | None = None,
    job_id: None = None,
    concurrency_key: str | None = None,
    depends_on: Iterable[uuid.UUID] | None = None,
    on_dependency_failure: OnDependencyFailure = "cancel",
) -> list[uuid.UUID]:
    """``enqueue_many()`` for asyncio: validate every job, insert them in the caller's
    transaction (an AsyncSession's or an AsyncConnection's), return their ids in order.
    Never commits."""
    target = _sync_of(session_or_connection, "enqueue_many_async")
    return await greenlet_spawn(
        enqueue_many,
        target,
        jobs,
        queue=queue,
        process_at=process_at,
        process_in=process_in,
        priority=priority,
        serializer=serializer,
        job_id_strategy=job_id_strategy,
        clock=clock,
        job_id=job_id,
        concurrency_key=concurrency_key,
        depends_on=depends_on,
        on_dependency_failure=on_dependency_failure,
    )


# --- the runner in greenlets ---------------------------------------------------------------


class _TaskLock:
    """The runner's lock where its callers are tasks sharing a thread: a task that waits for
    it lets the event loop run (a thread lock would block the loop, and its holder)."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    def __enter__(self) -> None:
        await_only(self._lock.acquire())

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()


def _task_sleep(seconds: float) -> None:
    """The runner's pause where its callers are tasks: the event loop runs meanwhile."""
    await_only(asyncio.sleep(seconds))


def _task_name() -> str:
    """The task running a claim, for logs and run records."""
    task = asyncio.current_task()
    return task.get_name() if task is not None else threading.current_thread().name


async def _as_current(awaitable: Awaitable[T], context_of: Callable[[], AsyncJobContext]) -> T:
    """Await a handler's result with ``current_job()`` making the run's context."""
    with running_job(context_of):
        return await awaitable


def _settle(result: Any) -> Any:
    """What a handler or callback returned, awaited if it is awaitable (in the runner's
    greenlet, so inside the job's transaction).

    A CancelledError that is not the cancellation of the worker's task (a stop past its
    timeout) is the function's own failure: it must not end the task.
    """
    if not inspect.isawaitable(result):
        return result
    try:
        return await_only(result)
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        raise ProletarianError(
            "CancelledError was raised, but the worker's stop did not cancel the job (a task "
            "or future the function awaited was cancelled): catch it where that is expected"
        ) from exc


def _async_event(signal: threading.Event, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An asyncio.Event of ``loop``, set when the run's stop signal is (from any thread), at
    once if it is already."""
    event = asyncio.Event()
    if signal.is_set():
        event.set()
    if isinstance(signal, StopSignal):
        signal.add_callback(lambda: loop.call_soon_threadsafe(event.set))
    return event


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Wait until ``event`` is set or ``seconds`` have passed."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


# --- the worker ------------------------------------------------------------------------------


class AsyncQueueWorker:
    """asyncio tasks that work off one queue. Use ``await start()``/``await stop()`` or
    ``async with worker:``, on one event loop.

    A worker runs once: once stopped (by stop() or by itself) it cannot be started again.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        handler: Callable[..., Any],
        options: WorkerOptions,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        if not isinstance(engine, AsyncEngine):
            raise ConfigurationError(
                f"the asyncio worker needs a sqlalchemy AsyncEngine, not "
                f"{type(engine).__name__} (for an Engine, use create_queue_worker)"
            )
        self.options = options
        self.concurrency = concurrency
        self.worker_id: str = options.worker_id or ""
        self._engine = engine
        sync_engine = engine.sync_engine
        dialect_of(sync_engine).check_worker_engine(sync_engine)
        self._stopping = asyncio.Event()
        self._runner = new_runner(
            sync_engine,
            self._settings(options.run_settings(handler)),
            self._count,
            stopping=self._stopping.is_set,
            new_lock=_TaskLock,
            unit_name=_task_name,
            sleep=_task_sleep,
            spawn=self._spawn,
        )
        _check_pool(
            sync_engine,
            self._runner.connections_per_thread,
            concurrency,
            self._runner.shared_connections,
        )
        self._scheduler = scheduler_for(self._runner.dialect, options)
        self._counts: dict[Outcome, int] = {"succeeded": 0, "retried": 0, "failed": 0}
        self._wakeup = asyncio.Event()
        self._stopped = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._shutdown: asyncio.Task[None] | None = None
        self._listener: wakeups.AsyncListener | None = None
        self._exception: BaseException | None = None
        self._unfinished = 0
        self._keeper: asyncio.Task[None] | None = None
        #: Lease mode: the tasks running handlers (a handler's stop() only asks for it).
        self._handler_tasks: set[asyncio.Future[Any]] = set()
        #: Lease mode: the tasks writing timed-out jobs' outcomes, off the heartbeat's task.
        self._outcome_tasks: set[asyncio.Task[Any]] = set()
        #: Transaction mode: one idle task at a time (the watcher) polls; the others wait for
        #: ``_woken``, set (and replaced) at each wake-up. Lease mode: each task polls, and
        #: waits for ``_wakeup``.
        self._woken = asyncio.Event()
        self._polling = Polling(
            options,
            self._runner,
            self._scheduler,
            current=asyncio.current_task,
            wake_all=self._wake_all,
            listener=lambda: self._listener,
            await_result=await_only,
        )

    def _settings(self, settings: RunSettings) -> RunSettings:
        """The run settings with the user's functions wrapped: advanced-mode handlers and the
        callbacks see an AsyncJobContext, and what they return is awaited."""
        handler = settings.handler

        # A coroutine cannot make the runner's reads: a job's dependency_results are read
        # here, in the runner's greenlet, before its handler is called (a job that has no
        # dependencies, as its claim read, costs no statement).
        def run_advanced(job: JobContext) -> Any:
            job.dependency_results  # noqa: B018
            context = self._context(job)
            return self._call(lambda: handler(context), lambda: context, job.cancel_requested)

        def run_default(job_type: str, payload: Any) -> Any:
            made = running_job_maker()  # the runner's JobContext, made on first use
            made().dependency_results  # noqa: B018

            @functools.cache
            def context_of() -> AsyncJobContext:
                job = made()
                assert isinstance(job, JobContext)
                return self._context(job)

            return self._call(lambda: handler(job_type, payload), context_of, RUNNING_SIGNAL.get())

        retries = {name: self._callback(fn) for name, fn in settings.task_retries.items()}
        return dataclasses.replace(
            settings,
            handler=run_advanced if settings.handler_mode == "advanced" else run_default,
            retry_strategy=self._callback(settings.retry_strategy),
            failed_job_handler=self._callback(settings.failed_job_handler),
            task_retries={name: fn for name, fn in retries.items() if fn is not None},
        )

    def _call(
        self,
        call: Callable[[], Any],
        context_of: Callable[[], AsyncJobContext],
        signal: threading.Event | None,
    ) -> Any:
        """Call the handler and await what it returns, ``current_job()`` being the run's
        AsyncJobContext all along (in its coroutine too, which runs in the awaiting task)."""
        with running_job(context_of):
            result = call()
        if inspect.isawaitable(result):
            result = _as_current(result, context_of)
        return _settle(self._stoppable(result, signal))

    def _stoppable(self, result: Any, signal: threading.Event | None) -> Any:
        """Lease mode: a handler's result awaited in a task of its own, cancelled when the
        worker asks the handler to stop (cancel, timeout, lost lease, a stop that gave up)."""
        if not isinstance(self._runner, LeaseRunner) or not inspect.isawaitable(result):
            return result
        task = asyncio.ensure_future(result)
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_tasks.discard)
        if isinstance(signal, StopSignal):
            loop = asyncio.get_running_loop()
            signal.add_callback(lambda: loop.call_soon_threadsafe(task.cancel))
        return task

    def _callback(self, function: Callable[..., Any] | None) -> Callable[..., Any] | None:
        """A retry strategy or failed-job handler, called with the run's AsyncJobContext."""
        if function is None:
            return None

        def call(job: JobContext, exc: Exception) -> Any:
            return _settle(function(self._context(job), exc))

        return call

    def _context(self, job: JobContext) -> AsyncJobContext:
        """The AsyncJobContext of a run (one per JobContext): its session, made on first
        read, an AsyncSession over the runner's own JobSession, so the worker's savepoint
        guards what the handler does through it; its ``cancel_requested`` made on first
        read too."""
        known = job.__dict__.get(_ASYNC_CONTEXT)
        if isinstance(known, AsyncJobContext):
            return known
        # The fields as they are: the job's Session is not made here.
        values = {name: object.__getattribute__(job, name) for name in _field_names(job)}
        values["session"] = SessionOnFirstUse(lambda: self._async_session(job))
        loop = asyncio.get_running_loop()
        values["cancel_requested"] = SessionOnFirstUse(
            lambda: _async_event(job.cancel_requested, loop)
        )
        values["_read_dependencies"] = lambda: job.dependency_results  # read already
        context = job.__dict__[_ASYNC_CONTEXT] = AsyncJobContext(**values)
        return context

    def _async_session(self, job: JobContext) -> AsyncSession:
        """An AsyncSession that proxies the job's own JobSession (no statement is sent)."""
        session = job.session
        assert isinstance(session, JobSession)
        # A leased job's session takes its connection on first use, not here.
        bind = (
            self._engine
            if isinstance(session, LeaseSession)
            else AsyncConnection(self._engine, session.job_connection)
        )
        return AsyncSession(
            bind,
            # AsyncSession proxies what its sync_session_class returns: the job's session.
            sync_session_class=cast(type[Session], lambda **_: session),
        )

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> AsyncQueueWorker:
        """Start the worker's tasks on the running event loop."""
        if self._stopping.is_set():
            raise ConfigurationError(
                f"worker {self.worker_id} was stopped, and a stopped worker cannot be "
                "restarted: create a new one with create_async_queue_worker"
            )
        if self._tasks:
            raise ConfigurationError(f"worker {self.worker_id} was started already")
        # Refuses transaction mode on a Galera cluster (the engine is reached from the loop).
        await greenlet_spawn(checked_mode, self._engine.sync_engine, self.options.lease_seconds)
        self._loop = asyncio.get_running_loop()
        wakeups.register(self._engine.sync_engine, self.options.queues, self)
        if not self.options.poll_only and wakeups.AsyncListener.supported(self._engine):
            self._listener = wakeups.AsyncListener(self._engine, self.options.queues, self.wake)
            self._listener.start()
        log_event(
            logging.INFO,
            "queue-worker-starting",
            worker_id=self.worker_id,
            queue=self.options.queue_names,
            concurrency=self.concurrency,
        )
        self._tasks = [
            asyncio.create_task(self._work(), name=f"{self.worker_id}-{index}")
            for index in range(self.concurrency)
        ]
        self._keeper = asyncio.create_task(self._keep_owner(), name=f"{self.worker_id}-owner")
        return self

    def _spawn(self, work: Callable[[], None]) -> None:
        """Run a runner's ``work`` (a timed-out job's outcome) in a task of its own, so that
        the heartbeat's task goes on renewing leases meanwhile; the stop waits for it."""
        assert self._loop is not None
        task = self._loop.create_task(greenlet_spawn(work), name=f"{self.worker_id}-timeout")
        self._outcome_tasks.add(task)
        task.add_done_callback(self._outcome_tasks.discard)

    async def _keep_owner(self) -> None:
        """Check the run-record owner's session every ledger.KEEPER_INTERVAL until the worker
        has stopped, taking it back if it ended."""
        while not self._stopped.is_set():
            await _wait(self._stopped, self._runner.upkeep_interval)
            if not self._stopped.is_set():
                await greenlet_spawn(self._runner.keep_owner)

    async def stop(self) -> None:
        """Stop polling, let running jobs finish within the timeout, then call on_shutdown.

        Safe to call again: a caller waits until the stop is complete, except a handler (one
        of the worker's tasks) or on_shutdown, whose call only asks for the stop. Jobs still
        running after ``await_termination_timeout`` are cancelled: their transactions roll
        back and they run again later, without an unclean end.
        """
        shutdown = self._begin_shutdown()
        current = asyncio.current_task()
        if current is shutdown or current in self._tasks or current in self._handler_tasks:
            return
        await asyncio.shield(shutdown)

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait until the worker has stopped; True if it has."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._stopped.wait()
        return self._stopped.is_set()

    def wake(self) -> None:
        """Make idle tasks poll now instead of after the polling interval (from any thread)."""
        self._call_soon(self._wake_all)

    def wake_for_enqueue(self, committing: bool) -> None:
        """A job of this worker's queue was enqueued in this process (from any thread) and its
        transaction is committing: poll now, and a few times shortly after."""
        self._call_soon(self._woken_by_enqueue, committing)

    def _woken_by_enqueue(self, committing: bool) -> None:
        self._polling.enqueued(committing)
        self._wake_all()

    def _wake_all(self) -> None:
        """End every idle task's wait: each polls once."""
        self._woken.set()
        self._woken = asyncio.Event()
        self._wakeup.set()

    def _call_soon(self, callback: Callable[..., object], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(callback, *args)

    @property
    def running(self) -> bool:
        """True from start() until the worker has stopped, by stop() or by itself."""
        return bool(self._tasks) and not self._stopped.is_set()

    @property
    def exception(self) -> BaseException | None:
        """What stopped the worker when it stopped by itself (a polling error that
        ``on_polling_error`` said to stop on, or the error that ended one of its tasks); None
        while it runs and after a stop() from outside."""
        return self._exception

    @property
    def unfinished(self) -> int:
        """How many running jobs a stop gave up on (cancelled) when
        ``await_termination_timeout`` passed; they run again. 0 while the worker runs, and
        after a stop that let every running job finish."""
        return self._unfinished

    def activity(self) -> int | None:
        """How many polls the worker's tasks have begun, or None while one is under way or a
        job it claimed has not ended (see ``QueueWorker.activity``)."""
        return self._polling.activity()

    def summary(self) -> dict[str, int]:
        """How many jobs this worker has run to each outcome."""
        return {str(outcome): count for outcome, count in self._counts.items()}

    def summary_text(self) -> str:
        counts = self.summary()
        return (
            f"{counts['succeeded']} succeeded, {counts['retried']} retried, "
            f"{counts['failed']} failed"
        )

    async def __aenter__(self) -> AsyncQueueWorker:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # --- stopping -------------------------------------------------------------------------

    def _begin_shutdown(self) -> asyncio.Task[None]:
        """The task doing the stop, started by the first call."""
        self._stopping.set()
        self._wake_all()
        if self._shutdown is None:
            self._shutdown = asyncio.get_running_loop().create_task(
                self._shut_down(), name=f"{self.worker_id}-stopper"
            )
        return self._shutdown

    async def _shut_down(self) -> None:
        """The stop itself, done once: wait for the tasks, call on_shutdown, let go."""
        try:
            log_event(logging.INFO, "shutting-down", worker_id=self.worker_id)
            wakeups.unregister(self._engine.sync_engine, self.options.queues, self)
            if self._listener is not None:
                await self._listener.stop()
            pending = {task for task in self._tasks if not task.done()}
            if pending:
                _, pending = await asyncio.wait(
                    pending, timeout=self.options.await_termination_timeout
                )
            if pending:
                await self._cancel(pending)
            await self._on_shutdown()
            log_event(
                logging.INFO, "completed-shutdown", worker_id=self.worker_id, **self.summary()
            )
        finally:
            if self._outcome_tasks:
                # The keeper renews their leases until their outcomes are written.
                await asyncio.wait(set(self._outcome_tasks))
            if self._keeper is not None:
                self._keeper.cancel()
            with contextlib.suppress(Exception):
                await greenlet_spawn(self._runner.close)
            self._stopped.set()

    async def abandon_running(self) -> int:
        """Lease mode: give back the leases of the jobs still running or waiting to, without
        an unclean end (they are due again at once), asking their handlers to stop; their
        late outcomes are fenced off. How many. What a second SIGTERM/SIGINT does before the
        command-line worker ends (transaction mode: nothing to give back, 0)."""
        if not isinstance(self._runner, LeaseRunner):
            return 0
        return await greenlet_spawn(self._runner.abandon_in_flight)

    async def _cancel(self, pending: set[asyncio.Task[None]]) -> None:
        """Cancel the jobs still running after the timeout: each rolls back and runs again."""
        self._unfinished = len(pending)
        log_event(
            logging.WARNING,
            "queue-worker-shutdown-timeout",
            worker_id=self.worker_id,
            tasks=",".join(sorted(task.get_name() for task in pending)),
            hint="jobs still running were cancelled: their transactions roll back and they "
            "will run again",
        )
        if isinstance(self._runner, LeaseRunner):
            # Leases go back at once, and their handlers are asked to stop (their tasks too).
            await greenlet_spawn(self._runner.abandon_in_flight)
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=CANCEL_GRACE)
        if pending:
            # A handler that ignores its cancellation: at least its run is no unclean end.
            await greenlet_spawn(self._runner.abandon_in_flight)

    async def _on_shutdown(self) -> None:
        if self.options.on_shutdown is None:
            return
        try:
            result = self.options.on_shutdown()
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            log_event(
                logging.ERROR,
                "queue-worker-shutdown-error",
                worker_id=self.worker_id,
                error=repr(exc),
            )

    def _stop_itself(self, exc: BaseException) -> None:
        """Stop the worker because of ``exc``."""
        if self._exception is None and not self._stopping.is_set():
            self._exception = exc
        self._begin_shutdown()

    # --- the tasks ------------------------------------------------------------------------

    def _count(self, outcome: Outcome) -> None:
        self._counts[outcome] += 1

    async def _work(self) -> None:
        """A worker task. Whatever ends it before a stop stops the whole worker."""
        try:
            await self._poll()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            with contextlib.suppress(Exception):  # the logging may be what failed
                log_event(
                    logging.ERROR, "job-worker-error", worker_id=self.worker_id, error=repr(exc)
                )
            self._stop_itself(exc)

    async def _poll(self) -> None:
        """Claim and run jobs until the worker stops, holding the task's connections: each
        step of the poll loop (see ``polling``) runs in a greenlet, and the task waits."""
        poll = Poll(self._polling)
        try:
            while not self._stopping.is_set():
                woken = self._woken  # before the poll: a wake-up during it is not missed
                match await greenlet_spawn(poll.step):
                    case Backoff(pause):
                        await _wait(self._stopping, pause)
                    case Idle(pause):
                        if await self._idle(woken, pause):
                            poll.announced()
                    case Stop(error):
                        self._stop_itself(error)
                        return
        finally:
            await greenlet_spawn(poll.end)

    async def _idle(self, woken: asyncio.Event, pause: float | None) -> bool:
        """Wait after an empty poll, for ``pause`` seconds (None: no limit); a wake-up since
        the poll began (``woken`` is set), or stop(), ends the wait early. True if a wake-up
        ended it (a job was announced: the next claim polls at once)."""
        if not self._polling.shared_idle:
            assert pause is not None
            await _wait(self._wakeup, pause)
            announced = self._wakeup.is_set() and not self._stopping.is_set()
            if not self._stopping.is_set():
                self._wakeup.clear()
            return announced
        if pause is None:
            await woken.wait()
        else:
            await _wait(woken, pause)
        return woken.is_set() and not self._stopping.is_set()


def _check_concurrency(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"concurrency is {value!r}; give a whole number >= 1 (the tasks running jobs at "
            "the same time)"
        )
    return value


def create_async_queue_worker(
    engine: AsyncEngine,
    handler: Callable[..., Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    queue: str = DEFAULT_QUEUE,
    queues: Sequence[str] = (),
    polling_interval: float = DEFAULT_POLLING_INTERVAL,
    retry_strategy: Callable[[AsyncJobContext, Exception], Any] | None = None,
    failed_job_handler: Callable[[AsyncJobContext, Exception], Any] | None = None,
    on_polling_error: Callable[[Exception], Any] = stop_on_polling_error,
    handler_mode: Literal["default", "advanced"] = "default",
    on_shutdown: Callable[[], Any] | None = None,
    await_termination_timeout: float = DEFAULT_AWAIT_TERMINATION_TIMEOUT,
    worker_id: str | None = None,
    serializer: Serializer = DEFAULT_SERIALIZER,
    clock: Clock = utc_now,
    max_unclean_ends: int | None = DEFAULT_MAX_UNCLEAN_ENDS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    poll_only: bool = False,
    periodic_jobs: Sequence[PeriodicJob] = (),
    reconnect_grace: float = DEFAULT_RECONNECT_GRACE,
    lease_seconds: float | None = None,
    heartbeat_interval: float | None = None,
    job_timeout: float | None = None,
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL,
    max_result_bytes: int | None = DEFAULT_MAX_RESULT_BYTES,
    worker_threads: None = None,
    install_signal_handlers: None = None,
) -> AsyncQueueWorker:
    """An AsyncQueueWorker for ``engine`` that runs ``handler``; ``await worker.start()``.

    ``handler`` is an ``async def`` (or a plain function, called in the event loop's thread,
    so it must not block): ``handler(job_type, payload)``, or with ``handler_mode="advanced"``
    ``handler(job)`` with an AsyncJobContext. ``concurrency`` tasks run jobs at the same
    time. The other options are the threaded worker's (see create_queue_worker), but for
    ``worker_threads`` and ``install_signal_handlers``; ``retry_strategy``,
    ``failed_job_handler``, ``on_polling_error`` and ``on_shutdown`` may be ``async def``.
    ``worker_threads`` and ``install_signal_handlers`` are refused, saying what to do instead.
    """
    given = locals()
    for name, advice in _NOT_IN_ASYNCIO.items():
        if given[name] is not None:
            raise ConfigurationError(f"{name}: {advice}")
    options = WorkerOptions.from_parameters(
        {name: value for name, value in given.items() if name not in _NOT_IN_ASYNCIO}
    )
    return AsyncQueueWorker(engine, handler, options, _check_concurrency(concurrency))
