"""The queue worker: threads that poll its queues, run jobs, and shut down gracefully (its
options are in ``options``, how its process ends after a signal in ``exits``)."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, Literal

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import QueuePool

from sqla_proletarian import wakeups, workflows
from sqla_proletarian.dialects import Dialect, dialect_of
from sqla_proletarian.errors import ConfigurationError
from sqla_proletarian.exits import EXIT_JOBS_UNFINISHED, exit_after_stop, write_stderr
from sqla_proletarian.feeder import Feeder
from sqla_proletarian.leases import LeaseRunner, new_runner
from sqla_proletarian.logs import log_event
from sqla_proletarian.options import (
    DEFAULT_AWAIT_TERMINATION_TIMEOUT,
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_MAX_UNCLEAN_ENDS,
    DEFAULT_POLLING_INTERVAL,
    DEFAULT_RECONNECT_GRACE,
    DEFAULT_WORKER_THREADS,
    MAX_BATCH_SIZE,
    PollingErrorHandler,
    WorkerOptions,
    stop_on_polling_error,
)
from sqla_proletarian.periodic import PeriodicJob, Scheduler
from sqla_proletarian.polling import (
    LISTENING_POLL_INTERVAL,
    Backoff,
    Feed,
    Idle,
    Poll,
    Polling,
    Stop,
)
from sqla_proletarian.progress import DEFAULT_PROGRESS_INTERVAL
from sqla_proletarian.running import FailedJobHandler, Outcome, RetryStrategyFn
from sqla_proletarian.serialization import DEFAULT_SERIALIZER, Serializer
from sqla_proletarian.values import DEFAULT_QUEUE, Clock, utc_now

#: The worker's own names, and those of its options (module ``options``) and exit status
#: (module ``exits``), which are named here too.
__all__ = [
    "DEFAULT_AWAIT_TERMINATION_TIMEOUT",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MAX_RESULT_BYTES",
    "DEFAULT_MAX_UNCLEAN_ENDS",
    "DEFAULT_POLLING_INTERVAL",
    "DEFAULT_PROGRESS_INTERVAL",
    "DEFAULT_RECONNECT_GRACE",
    "DEFAULT_WORKER_THREADS",
    "EXIT_JOBS_UNFINISHED",
    "LISTENING_POLL_INTERVAL",
    "MAX_BATCH_SIZE",
    "QueueWorker",
    "WorkerOptions",
    "create_queue_worker",
    "process_next_job",
    "scheduler_for",
]


def scheduler_for(dialect: Dialect, options: WorkerOptions) -> Scheduler | None:
    """What enqueues a worker's periodic jobs, if it has any."""
    if not options.periodic_jobs:
        return None
    return Scheduler(
        dialect,
        options.periodic_jobs,
        serializer=options.serializer,
        clock=options.clock,
        interval=options.polling_interval,
    )


class QueueWorker:
    """Worker threads that work off one queue, or several in order. Use start()/stop() or
    ``with worker:``.

    A worker runs once: once stopped (by stop() or by itself) it cannot be started again.
    """

    def __init__(self, engine: Engine, handler: Callable[..., Any], options: WorkerOptions) -> None:
        _check_engine(engine)
        self.options = options
        self.worker_id: str = options.worker_id or ""
        self._stopping = threading.Event()
        dialect_of(engine).check_worker_engine(engine)
        self._mode_checked = checked_mode(engine, options.lease_seconds)
        self._runner = new_runner(
            engine, options.run_settings(handler), self._count, stopping=self._stopping.is_set
        )
        _check_pool(
            engine,
            self._runner.connections_per_thread,
            options.worker_threads,
            self._runner.shared_connections,
        )
        self._scheduler = scheduler_for(self._runner.dialect, options)
        self._counts: dict[Outcome, int] = {"succeeded": 0, "retried": 0, "failed": 0}
        self._counts_lock = threading.Lock()
        self._wakeup = threading.Event()
        #: Transaction mode: one idle thread at a time (the watcher) polls; the others wait on
        #: ``_idle_threads`` until ``_wakes`` (a count of wake-ups) moves on, or they take
        #: the turn ``_wake_one`` leaves (``_turn``). Lease mode: the poller waits on
        #: ``_wakeup``.
        self._idle_threads = threading.Condition()
        self._wakes = 0
        #: A turn for any idle thread (a claim that may leave more jobs due), and one for a
        #: given thread (the watcher, when a job was NOTIFYed): neither undoes the other.
        self._turn = False
        self._turn_for: object | None = None
        self._polling = Polling(
            options,
            self._runner,
            self._scheduler,
            current=threading.current_thread,
            wake_all=self._wake_all,
            wake_one=lambda: self._wake_one(watcher=False),
            listener=lambda: self._listener,
            guard=self._idle_threads,
        )
        self._engine = engine
        self._listener: wakeups.Listener | None = None
        self._stopped = threading.Event()
        #: Guards the choice of the thread that stops the worker; never held while waiting.
        self._state_lock = threading.Lock()
        #: The thread doing the stop, from the first stop() on.
        self._stopper: threading.Thread | None = None
        self._exception: BaseException | None = None
        self._unfinished = 0
        self._threads: list[threading.Thread] = []
        #: Lease mode: the poller's queue of claimed jobs, and the completer.
        self._feeder: Feeder | None = None
        self._previous_handlers: dict[int, Any] = {}
        #: From the signal handler to the watcher thread (put is safe inside a handler).
        self._signals: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        #: The first signal taken; from then on it is ending the process.
        self._signal_received: int | None = None
        #: Lease mode: the handler stays after the first signal, so that a second one gives
        #: the running jobs' leases back before the process ends; set once the exit's own
        #: kill is coming.
        self._releases_on_second_signal = options.lease_seconds is not None
        self._signal_exiting = False
        self._signal_exit: threading.Thread | None = None
        if options.install_signal_handlers:
            _require_main_thread()

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> QueueWorker:
        """Start the worker threads (and the signal handlers, if asked for)."""
        if self._stopping.is_set():
            raise ConfigurationError(
                f"worker {self.worker_id} was stopped, and a stopped worker cannot be "
                "restarted: create a new one with create_queue_worker"
            )
        if self._threads:
            raise ConfigurationError(f"worker {self.worker_id} was started already")
        if not self._mode_checked:
            self._mode_checked = checked_mode(self._engine, self.options.lease_seconds)
        if self.options.install_signal_handlers:
            self._install_signal_handlers()
        wakeups.register(self._engine, self.options.queues, self)
        if not self.options.poll_only and wakeups.Listener.supported(self._engine):
            self._listener = wakeups.Listener(
                self._engine, self.options.queues, self.wake, notified=self._wake_one
            )
            self._listener.start()
        log_event(
            logging.INFO,
            "queue-worker-starting",
            worker_id=self.worker_id,
            queue=self.options.queue_names,
            worker_threads=self.options.worker_threads,
        )
        self._runner.start_keeping_owner()
        body = self._start_feeding()
        for index in range(self.options.worker_threads):
            thread = threading.Thread(
                target=self._work, args=(body,), name=f"{self.worker_id}-{index}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        return self

    def stop(self) -> None:
        """Stop polling, let running jobs finish within the timeout, then call on_shutdown.

        Safe to call again and from any thread: a caller in another thread waits until the
        stop is complete; a call from one of the worker's threads (a handler) or from the
        stop itself (on_shutdown) asks for the stop and returns at once.
        """
        # Before anything else: from here on no thread starts a job.
        self._stopping.set()
        self._wake_all()
        current = threading.current_thread()
        if current in self._threads:
            self._stop_in_background()
            return
        with self._state_lock:
            stopper = self._stopper
            if stopper is None:
                self._stopper = current
        if stopper is current:
            return
        if stopper is None:
            self._shut_down()
        else:
            self._stopped.wait()
        self._restore_signal_handlers()
        self._park_during_signal_exit()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the worker has stopped; True if it has.

        While a signal is ending the process (``install_signal_handlers``), it does not
        return: the process ends by the signal.
        """
        stopped = self._stopped.wait(timeout)
        if stopped:
            self._park_during_signal_exit()
        return stopped

    def wake(self) -> None:
        """Make idle threads poll now instead of after the polling interval."""
        self._wake_all()

    def wake_for_enqueue(self, committing: bool) -> None:
        """A job of this worker's queue was enqueued in this process and its transaction is
        committing: poll now, and again a few times shortly after, until the commit shows."""
        self._polling.enqueued(committing)
        self._wake_all()

    @property
    def running(self) -> bool:
        """True from start() until the worker has stopped, by stop() or by itself."""
        return bool(self._threads) and not self._stopped.is_set()

    @property
    def exception(self) -> BaseException | None:
        """What stopped the worker when it stopped by itself: the polling error that
        ``on_polling_error`` said to stop on, or the error that ended one of its threads.
        None while it runs and after a stop() from outside."""
        return self._exception

    @property
    def unfinished(self) -> int:
        """How many running jobs a stop gave up on when ``await_termination_timeout``
        passed (they roll back, or their leases go back, and they run again); 0 while the
        worker runs, and after a stop that let every running job finish."""
        return self._unfinished

    def activity(self) -> int | None:
        """How many polls the worker has begun, or None while one is under way or a job it
        claimed has not ended: the same number before and after a look at its queues means
        it claimed nothing meanwhile (what ``worker --burst`` checks before it stops)."""
        return self._polling.activity()

    def summary(self) -> dict[str, int]:
        """How many jobs this worker has run to each outcome."""
        with self._counts_lock:
            return {str(outcome): count for outcome, count in self._counts.items()}

    def summary_text(self) -> str:
        counts = self.summary()
        return (
            f"{counts['succeeded']} succeeded, {counts['retried']} retried, "
            f"{counts['failed']} failed"
        )

    def __enter__(self) -> QueueWorker:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- stopping -------------------------------------------------------------------------

    def _stop_in_background(self) -> None:
        """Have a thread of its own stop the worker, unless a stop is under way already."""
        self._stopping.set()
        self._wake_all()
        with self._state_lock:
            if self._stopper is not None:
                return
            stopper = threading.Thread(
                target=self._shut_down, name=f"{self.worker_id}-stopper", daemon=True
            )
            self._stopper = stopper
        stopper.start()

    def _shut_down(self) -> None:
        """The stop itself, done once: wait for the threads, call on_shutdown, let go."""
        try:
            log_event(logging.INFO, "shutting-down", worker_id=self.worker_id)
            wakeups.unregister(self._engine, self.options.queues, self)
            if self._listener is not None:
                self._listener.stop()
            deadline = time.monotonic() + self.options.await_termination_timeout
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join(max(0.0, deadline - time.monotonic()))
            unfinished = [t.name for t in self._threads if t.is_alive()]
            if unfinished:
                self._unfinished = self._runner.abandon_in_flight() or len(unfinished)
                log_event(
                    logging.WARNING,
                    "queue-worker-shutdown-timeout",
                    worker_id=self.worker_id,
                    threads=",".join(unfinished),
                    hint=(
                        "the leases of jobs still running were released: they run again at "
                        "once, and what their handlers still write is discarded"
                        if self.options.lease_seconds is not None
                        else "jobs still running are rolled back when the process exits and "
                        "will run again"
                    ),
                )
            self._stop_feeding()
            if self.options.on_shutdown is not None:
                try:
                    self.options.on_shutdown()
                except Exception as exc:
                    log_event(
                        logging.ERROR,
                        "queue-worker-shutdown-error",
                        worker_id=self.worker_id,
                        error=repr(exc),
                    )
            self._restore_signal_handlers()
            log_event(
                logging.INFO, "completed-shutdown", worker_id=self.worker_id, **self.summary()
            )
        finally:
            self._runner.close()
            self._stopped.set()

    def _stop_itself(self, exc: BaseException) -> None:
        """Stop the worker because of ``exc``."""
        self._note_exception(exc)
        self._stop_in_background()

    def _note_exception(self, exc: BaseException) -> None:
        """Keep ``exc`` as what stopped the worker, unless it was stopping already."""
        with self._state_lock:
            if self._exception is None and not self._stopping.is_set():
                self._exception = exc

    # --- the threads ----------------------------------------------------------------------

    def _count(self, outcome: Outcome) -> None:
        with self._counts_lock:
            self._counts[outcome] += 1

    def _work(self, body: Callable[[], None] | None = None) -> None:
        """A worker thread. Whatever ends it before a stop stops the whole worker."""
        try:
            (body or self._poll)()
        except BaseException as exc:
            self._note_exception(exc)
            with contextlib.suppress(Exception):  # the logging may be what failed
                log_event(
                    logging.ERROR, "job-worker-error", worker_id=self.worker_id, error=repr(exc)
                )
            self._stop_in_background()

    def _poll(self) -> None:
        """Claim and run jobs until the worker stops, holding the thread's connections."""
        self._loop(Poll(self._polling))

    def _loop(self, poller: Poll | Feed) -> None:
        """Step ``poller`` until the worker stops, waiting as each step says."""
        try:
            while not self._stopping.is_set():
                wakes = self._wakes  # before the poll: a wake-up during it is not missed
                # A turn left before this poll began (for any thread, or for this one) is taken
                # by it: it sees what woke.
                if self._turn or self._turn_for is not None:
                    with self._idle_threads:
                        if self._turn or self._turn_for is threading.current_thread():
                            poller.announced()
                        self._turn = False
                        if self._turn_for is threading.current_thread():
                            self._turn_for = None
                match poller.step():
                    case Backoff(pause):
                        self._stopping.wait(pause)
                    case Idle(pause):
                        if self._idle(wakes, pause):
                            poller.announced()
                    case Stop(error):
                        self._stop_itself(error)
                        return
        finally:
            poller.end()

    def _idle(self, wakes: int, pause: float | None) -> bool:
        """Wait for ``pause`` seconds (None: no limit); stop(), or a wake-up since the poll
        began (``wakes`` moved on; lease mode: ``_wakeup`` is set), ends the wait early.
        True if a wake-up or a turn ended it (a job was announced), not the pause or stop()."""
        if not self._polling.shared_idle:
            assert pause is not None
            woken = self._wakeup.wait(pause)
            if not self._stopping.is_set():
                self._wakeup.clear()
            return woken
        deadline = None if pause is None else time.monotonic() + pause
        current = threading.current_thread()
        with self._idle_threads:
            while self._wakes == wakes and not self._stopping.is_set():
                if self._turn_for is current:
                    self._turn_for = None
                    return True
                if self._turn:
                    self._turn = False
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._idle_threads.wait(remaining)
            return self._wakes != wakes and not self._stopping.is_set()

    def _wake_all(self) -> None:
        """End every idle thread's wait: each polls once."""
        with self._idle_threads:
            self._wakes += 1
            self._idle_threads.notify_all()
        self._wakeup.set()

    def _wake_one(self, watcher: bool = True) -> None:
        """End one idle thread's wait (or, if none waits, that of the next to wait, unless a
        poll begins first): it polls once. ``watcher``: the watcher's, if there is one (a
        NOTIFYed job; it also learns of a job scheduled ahead); else any idle thread's (a
        claim that may leave more jobs due: the thread it wakes, claiming, wakes the next).
        So a single job's start does not wait behind every idle thread's empty poll."""
        if not self._polling.shared_idle:
            self._wakeup.set()
            return
        with self._idle_threads:
            target = self._polling.watcher if watcher else None
            if target is None:
                self._turn = True
                self._idle_threads.notify()
            else:
                self._turn_for = target
                self._idle_threads.notify_all()

    # --- lease mode: one poller feeds the threads -----------------------------------------

    def _start_feeding(self) -> Callable[[], None]:
        """Lease mode: start the poller and the completer; what the worker threads run."""
        runner = self._runner
        if not isinstance(runner, LeaseRunner):
            return self._poll
        feeder = self._feeder = Feeder(
            runner, self.options.worker_threads, self.options.batch_size, self._wakeup
        )
        feeder.start(self._stopping.is_set, self._polling.claiming)
        poller = threading.Thread(
            target=self._work,
            args=(lambda: self._feed(feeder),),
            name=f"{self.worker_id}-poller",
            daemon=True,
        )
        self._threads.append(poller)
        poller.start()
        return lambda: feeder.work(self._stopping.is_set)

    def _stop_feeding(self) -> None:
        """Archive the completions still queued (after the threads ended or were given up)."""
        if self._feeder is not None:
            self._feeder.completer.close()

    def _feed(self, feeder: Feeder) -> None:
        """Lease mode's poller: claim jobs into the threads' queue while they have room;
        with the queue drained, wait alone (see ``polling.Feed``)."""
        self._loop(Feed(self._polling, feeder))

    # --- signals --------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        _require_main_thread()
        threading.Thread(
            target=self._watch_signals, name=f"{self.worker_id}-signals", daemon=True
        ).start()
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        """Put back the handlers start() replaced. Only the main thread can: elsewhere they
        stay until a stop() in the main thread. Not while a signal is ending the process."""
        if threading.current_thread() is not threading.main_thread():
            return
        if not self._previous_handlers or self._signal_received is not None:
            return
        while self._previous_handlers:
            signum, handler = self._previous_handlers.popitem()
            signal.signal(signum, handler)
        received = self._signal_received
        if received is not None:
            # Taken while the handlers were put back: its exit goes on, by SIG_DFL.
            signal.signal(received, signal.SIG_DFL)
        else:
            self._signals.put(None)  # the watcher thread ends

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Ask for a graceful stop and exit; a second signal meanwhile exits at once (in
        lease mode after giving the running jobs' leases back, see ``_exit_at_once``).

        It runs between two bytecodes of the main thread, which may hold any lock then
        (inside stop(), summary(), a print): so it takes no lock and prints nothing; it
        hands the signal to the watcher thread (SimpleQueue.put is safe here).
        """
        if self._signal_exiting:
            # The exit's own kill (lease mode kept this handler for a second signal).
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self._signal_received is not None:
            # A second signal while jobs finish: exit now; their transactions roll back.
            name = signal.Signals(signum).name
            signal.signal(signum, signal.SIG_DFL)  # a third one ends the process at once
            if self._releases_on_second_signal:
                write_stderr(
                    f"{self.worker_id}: {name} again, giving the running jobs back and "
                    "exiting at once\n"
                )
                self._signals.put(signum)  # the watcher thread gives their leases back
                return
            write_stderr(f"{self.worker_id}: {name} again, exiting at once\n")
            os.kill(os.getpid(), signum)
            return
        self._signal_received = signum
        if not self._releases_on_second_signal:
            # The same signal again ends the process at once, and so does the exit's kill.
            signal.signal(signum, signal.SIG_DFL)
        self._signals.put(signum)

    def _watch_signals(self) -> None:
        """The watcher thread: hand the first signal to a thread that stops the worker and
        ends the process. That thread is no daemon, so the interpreter cannot exit first.
        Lease mode: a second signal comes here too (see ``_exit_at_once``)."""
        signum = self._signals.get()
        if signum is None:
            return
        # daemon=False is said outright: a thread inherits the daemon flag of the thread
        # that made it, and this one is made by the daemon watcher.
        exit_thread = threading.Thread(
            target=self._exit_on_signal,
            args=(signum,),
            name=f"{self.worker_id}-signal-exit",
            daemon=False,
        )
        self._signal_exit = exit_thread
        exit_thread.start()
        again = self._signals.get()
        if again is not None:
            self._exit_at_once(again)

    def _exit_at_once(self, signum: int) -> None:
        """Lease mode, a second signal: give back the leases of the jobs still running or
        waiting to (without an unclean end: they are due again at once, not when their
        leases expire), where the database answers within ``SIGNAL_RELEASE_TIMEOUT``; then
        end the process by the signal. Their handlers' late writes are fenced off."""
        releaser = threading.Thread(
            target=self._release_running, name=f"{self.worker_id}-release", daemon=True
        )
        releaser.start()
        releaser.join(SIGNAL_RELEASE_TIMEOUT)
        os.kill(os.getpid(), signum)

    def _release_running(self) -> None:
        with contextlib.suppress(Exception):  # the database may be what is wrong
            self._runner.abandon_in_flight()

    def _exit_on_signal(self, signum: int) -> None:
        """Stop gracefully, print the summary, then exit as the signal would have (or with
        EXIT_JOBS_UNFINISHED when the stop gave up on running jobs)."""
        try:
            name = signal.Signals(signum).name
            print(
                f"{self.worker_id}: {name} received, finishing running jobs...",
                file=sys.stderr,
                flush=True,
            )
            self.stop()
            print(f"{self.worker_id} stopped: {self.summary_text()}", file=sys.stderr, flush=True)
        finally:
            self._signal_exiting = True
            exit_after_stop(self, signum)

    def _park_during_signal_exit(self) -> None:
        """While a signal ends the process, keep the calling thread (the main thread in
        wait() or stop()) from returning and exiting the interpreter before it."""
        if self._signal_received is None or threading.current_thread() is self._signal_exit:
            return
        while True:
            threading.Event().wait()


#: Seconds a second SIGINT/SIGTERM waits for the running jobs' leases to go back (lease
#: mode) before it ends the process regardless.
SIGNAL_RELEASE_TIMEOUT = 5.0


def _check_engine(engine: Engine) -> None:
    """Refuse engines whose worker threads could not see the application's jobs."""
    if not isinstance(engine, Engine):
        raise ConfigurationError(
            f"the worker needs a sqlalchemy Engine, not {type(engine).__name__}: the worker "
            "opens its own connections"
        )


#: Engines whose server was found to be no Galera node: asked once per engine (a
#: process_next_job loop does not pay a round trip a call).
_NO_CLUSTER: weakref.WeakSet[Engine] = weakref.WeakSet()


def checked_mode(engine: Engine, lease_seconds: float | None) -> bool:
    """Refuse a mode the server cannot serve (``Dialect.check_worker_mode``: transaction
    mode on a Galera cluster); False when the server could not be asked (it is down): the
    worker asks again when it starts."""
    dialect = dialect_of(engine)
    if lease_seconds is not None or dialect.owner_lock != "named" or engine in _NO_CLUSTER:
        return True
    try:
        with engine.connect() as conn:
            dialect.check_worker_mode(conn, lease_seconds)
    except DBAPIError:
        return False
    _NO_CLUSTER.add(engine)
    return True


def _check_pool(engine: Engine, per_thread: int, threads: int, shared: int = 0) -> None:
    """Refuse a pool that can never give a thread its connections; warn if it starves some.

    ``shared``: connections the worker holds besides its threads' (its run-record owner's).
    """
    pool = engine.pool
    if not isinstance(pool, QueuePool):
        return
    overflow = pool._max_overflow
    capacity = float("inf") if overflow < 0 else pool.size() + overflow
    advice = (
        f"each worker thread holds {per_thread} connection(s) (its claim"
        + (" and its run records" if per_thread > 1 else "")
        + ")"
        + (f", the worker {shared} more (its run-record owner)" if shared else "")
        + f", so give the engine pool_size + max_overflow >= {per_thread * threads + shared} "
        "for the worker, plus what the application uses"
    )
    if capacity < per_thread + shared:
        raise ConfigurationError(
            f"the engine's pool holds at most {capacity:g} connection(s): {advice}"
        )
    if capacity < per_thread * threads + shared:
        log_event(
            logging.WARNING,
            "pool-too-small",
            pool_capacity=capacity,
            worker_threads=threads,
            hint=f"some worker threads will wait for connections: {advice}",
        )


def _require_main_thread() -> None:
    if threading.current_thread() is not threading.main_thread():
        raise ConfigurationError(
            "install_signal_handlers=True needs the main thread (Python delivers signals "
            "only there); create and start the worker in the main thread, or leave it False "
            "and call worker.stop() from your own shutdown code"
        )


def create_queue_worker(
    engine: Engine,
    handler: Callable[..., Any],
    *,
    queue: str = DEFAULT_QUEUE,
    queues: Sequence[str] = (),
    worker_threads: int = DEFAULT_WORKER_THREADS,
    polling_interval: float = DEFAULT_POLLING_INTERVAL,
    retry_strategy: RetryStrategyFn | None = None,
    failed_job_handler: FailedJobHandler | None = None,
    on_polling_error: PollingErrorHandler = stop_on_polling_error,
    handler_mode: Literal["default", "advanced"] = "default",
    install_signal_handlers: bool = False,
    on_shutdown: Callable[[], object] | None = None,
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
) -> QueueWorker:
    """A QueueWorker for ``engine`` that runs ``handler``; call ``.start()`` to begin.

    Options: ``queue`` ("default") or ``queues`` (several queue names, claimed in the order
    given: a queue's jobs are claimed when the queues before it have no due job, or fewer
    than ``batch_size``; each queue is polled on its own range of the poll index),
    ``worker_threads`` (1), ``polling_interval`` (0.1 s; a
    positive number, as 0 would poll without pause; one idle thread polls for all of them,
    and while LISTEN wakes the worker it polls when the next job is due, or after
    ``LISTENING_POLL_INTERVAL``), ``retry_strategy``
    (``(job, exc) -> RetryStrategy | None``; default no retries),
    ``failed_job_handler`` (``(job, exc)``), ``on_polling_error`` (``(exc) -> bool``, True
    stops; default stops), ``handler_mode`` ("default": ``handler(job_type, payload)``;
    "advanced": ``handler(job)``), ``install_signal_handlers`` (False), ``on_shutdown``,
    ``await_termination_timeout`` (10 s), ``worker_id``, ``serializer``, ``clock`` and
    ``max_unclean_ends`` (3; None turns crash accounting off), ``reconnect_grace`` (5 s:
    how long a run's worker must stay gone from the database before the run counts as an
    unclean end and its job runs again; while its session is away or it lives, the job is
    left alone), ``batch_size`` (1: jobs
    claimed, run one after another and committed together in one transaction; SQLite
    always claims one), ``poll_only`` (False: on PostgreSQL a committed enqueue wakes
    idle workers at once through LISTEN/NOTIFY; True polls only, for transaction-pooling
    proxies) and ``periodic_jobs`` (a list of ``PeriodicJob``: the worker enqueues their
    occurrences, each once however many workers have them, checking at most once per
    polling interval, between jobs), ``lease_seconds`` (None: transaction mode, each
    handler runs inside the transaction that claimed its job; a number: lease mode, the
    claim commits a lease of that many seconds and the handler runs with no transaction
    open, for long jobs; see docs/modes.md; on a MariaDB Galera cluster transaction mode is
    refused with ConfigurationError), ``heartbeat_interval`` (lease mode: seconds
    between renewals of the worker's leases, ``lease_seconds / 3``) and ``job_timeout``
    (lease mode: seconds after which a running job is failed with JobTimeoutError, retried
    per the retry strategy, and its handler asked to stop through ``job.cancel_requested``),
    ``progress_interval`` (1 s: the least time between two writes of a running job's
    ``job.set_progress`` reports; the reports in between keep only the latest, written
    when the interval has passed or the handler returns) and ``max_result_bytes`` (1 MiB:
    the longest handler result stored, serialized; a longer one fails the job with
    ResultTooLargeError; None: no limit).

    A worker runs once: ``start()`` after a stop raises ConfigurationError. ``stop()`` starts
    no job from the moment it is called, may be called more than once and from any thread
    (from a handler or on_shutdown it only asks for the stop and returns). A worker that
    stops by itself (a polling error that on_polling_error stops on, a thread ended by an
    error) is not ``running``, ``wait()`` returns, and ``exception`` says why. With
    ``install_signal_handlers``, SIGINT and SIGTERM stop it, print a summary, run the atexit
    handlers, flush logging and end the process by the signal; a second signal ends it at
    once.
    """
    return QueueWorker(engine, handler, WorkerOptions.from_parameters(locals()))


def process_next_job(engine: Engine, handler: Callable[..., Any], **options: Any) -> bool:
    """Run at most one due job of the queue in the calling thread; True if one was claimed
    (and run, or archived at the claim: cancelled under an expired lease, or crashed).

    Takes the worker options that apply to one job (``queue`` or ``queues``, ``retry_strategy``,
    ``failed_job_handler``, ``handler_mode``, ``worker_id``, ``serializer``, ``clock``,
    ``max_unclean_ends``, ``reconnect_grace``, ``lease_seconds``, ``heartbeat_interval``,
    ``job_timeout``, ``max_result_bytes``). Database errors are raised to the caller.
    """
    worker_options = WorkerOptions.from_kwargs(options)
    checked_mode(engine, worker_options.lease_seconds)
    settings = worker_options.run_settings(handler)
    runner = new_runner(engine, settings)
    try:
        return runner.process_one()
    finally:
        runner.progress.wait_written()
        workflows.count_later(engine, runner.now)
        runner._flow.give_back_now()
