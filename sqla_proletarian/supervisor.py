"""Worker processes: one queue worker run until it stops, and a supervisor of several.

``run_worker`` runs a QueueWorker in the calling thread until a signal stops it (with
``install_signal_handlers``), until it stops by itself, or, in burst mode, until no job of
its queues is due. ``Supervisor`` runs N such workers as processes, to use more than one
core past the GIL: it restarts a process that dies unexpectedly (with a backoff and a log
line), forwards SIGTERM and SIGINT to them, waits for them, and prints one summary.

The processes are ``python -m sqla_proletarian worker ...`` commands, not multiprocessing:
each is exactly the single-process command (the same handler import, signal handling and
summary), in a fresh interpreter, so nothing is pickled and nothing is forked from a
process that holds threads, engines or locks. The supervisor holds no database connection
and never imports the handler's module: a handler that breaks its process cannot take the
supervisor with it. Each process reports on a pipe (the hidden option ``--report-fd``) a
JSON line when it has started and one with its outcome counts when it stops; its standard
input is a pipe from the supervisor, and when that closes (the supervisor died, even by
SIGKILL) it stops gracefully, as on SIGTERM. The processes run in process groups of their
own, so a Ctrl-C in the terminal reaches the supervisor only, which forwards it once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import FrameType
from typing import Any

from sqlalchemy import Engine

from sqla_proletarian.dialects import dialect_of
from sqla_proletarian.errors import is_transient
from sqla_proletarian.exits import EXIT_INTERRUPTED, EXIT_JOBS_UNFINISHED, unfinished_text
from sqla_proletarian.inspection import queue_status
from sqla_proletarian.logs import log_event
from sqla_proletarian.options import WorkerOptions
from sqla_proletarian.running import any_due_in, next_due_at
from sqla_proletarian.worker import QueueWorker, create_queue_worker

__all__ = [
    "EXIT_FORCED",
    "EXIT_JOBS_FAILED",
    "EXIT_JOBS_UNFINISHED",
    "EXIT_OK",
    "EXIT_UNCLEAN",
    "Supervisor",
    "report_to_fd",
    "run_worker",
    "stop_with_supervisor",
]

#: What ``report`` receives: ``{"event": "started"}``, then ``{"event": "stopped",
#: "summary": {"succeeded": ..., "retried": ..., "failed": ...}, "unfinished": N}`` (the
#: running jobs its stop gave up on).
Report = Callable[[dict[str, Any]], None]


def stopped_event(worker: QueueWorker | Any) -> dict[str, Any]:
    """The ``stopped`` report of a worker whose stop is done (called from its on_shutdown,
    once the stop has given up on any running job)."""
    return {"event": "stopped", "summary": worker.summary(), "unfinished": worker.unfinished}


#: Exit status of the supervisor after a graceful stop (SIGTERM/SIGINT, or --burst done).
EXIT_OK = 0
#: Exit status when a worker process did not stop gracefully (it died during the stop),
#: or, with --burst, ended on an error.
EXIT_UNCLEAN = 1
#: Exit status of a burst whose every job ended, some failed for good (given up on).
EXIT_JOBS_FAILED = 3
#: A second SIGTERM/SIGINT stops every process at once: the supervisor exits with
#: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
EXIT_FORCED = 128

#: The first pause before restarting a process that died; it doubles up to the maximum.
RESTART_BACKOFF_MIN = 0.5
RESTART_BACKOFF_MAX = 30.0
#: A process that ran this long before dying is restarted after the shortest pause again.
HEALTHY_RUN = 30.0
#: How often a burst worker checks whether jobs are still due, at least.
BURST_CHECK_INTERVAL = 0.05


def run_worker(
    engine: Engine,
    handler: Callable[..., Any],
    *,
    burst: bool = False,
    report: Report | None = None,
    **options: Any,
) -> QueueWorker:
    """Run a queue worker in the calling thread until it stops; return it, stopped.

    Options are those of ``create_queue_worker``. Without ``burst`` it runs until stopped:
    by SIGTERM or SIGINT with ``install_signal_handlers=True`` (which ends the process as
    the worker's signal handling does), or by itself (``worker.exception`` says why). With
    ``burst`` it stops once no job of its queues is due (or they are paused) and none it
    claimed is still running (see ``drained``): running jobs finish first, and retries
    scheduled for later do not keep it going (one log line, ``burst-done``, says how many
    there are and when the next is due). ``report`` receives a ``started`` and a
    ``stopped`` event (see ``Report``).
    """
    started: list[QueueWorker] = []
    on_shutdown = options.pop("on_shutdown", None)

    def shut_down() -> None:
        if report is not None:
            report(stopped_event(started[0]))
        if on_shutdown is not None:
            on_shutdown()

    worker = create_queue_worker(engine, handler, on_shutdown=shut_down, **options)
    started.append(worker)
    worker.start()
    try:
        if report is not None:
            report({"event": "started"})
        if burst:
            _run_until_drained(engine, worker)
            if worker.running:
                log_burst_done(engine, worker)
        else:
            worker.wait()
    finally:
        worker.stop()
    return worker


def _run_until_drained(engine: Engine, worker: QueueWorker) -> None:
    """Wait while the worker runs and has not drained its queues."""
    interval = max(worker.options.polling_interval, BURST_CHECK_INTERVAL)
    while worker.running and not drained(engine, worker):
        worker.wait(interval)


def drained(engine: Engine, worker: QueueWorker | Any) -> bool:
    """Whether a burst worker is done: no job of its queues is due and none it claimed is
    still running. In lease mode a running job is not due (its ``process_at`` is its lease's
    expiry), so the worker's own count of claims under way (``activity``) is read before
    and after the look at the queues: the same on both sides, nothing changed between."""
    before = worker.activity()
    if before is None:
        return False
    return not any_due(engine, worker.options) and worker.activity() == before


def log_burst_done(engine: Engine, worker: QueueWorker | Any) -> None:
    """Say, in one line, how many jobs of a drained burst worker's queues are scheduled for
    later (retries waiting included) and when the next is due: the burst leaves them."""
    options = worker.options
    try:
        with engine.connect() as conn:
            now, scan = options.clock(), dialect_of(conn).priority_scan
            later = sum(
                status.scheduled
                for status in queue_status(conn, clock=options.clock)
                if status.queue in options.queues
            )
            firsts = [next_due_at(conn, queue, scan) for queue in options.queues]
    except Exception as exc:
        if not is_transient(exc):
            raise
        return
    if not later:
        return
    due = min((_aware(at) for at in firsts if at is not None and _aware(at) > now), default=None)
    log_event(
        logging.INFO,
        "burst-done",
        worker_id=worker.worker_id,
        scheduled_later=later,
        next_due_at=due.isoformat() if due is not None else None,
        next_due_in=f"{(due - now).total_seconds():.0f}s" if due is not None else None,
        hint="jobs scheduled for later (retries waiting included) stay queued: run the "
        "worker again once they are due, or without --burst",
    )


def _aware(value: datetime) -> datetime:
    """A time read back from the database, in UTC (SQLite's come back naive)."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def any_due(engine: Engine, options: WorkerOptions) -> bool:
    """Whether a job of the worker's queues is due (running jobs count): what ``burst`` waits
    for. True while the database is away: the worker waits for it too."""
    try:
        with engine.connect() as conn:
            now, scan = options.clock(), dialect_of(conn).priority_scan
            return any_due_in(conn, options.queues, now, scan)
    except Exception as exc:
        if not is_transient(exc):
            raise
        return True


def report_to_fd(fd: int) -> Report:
    """A ``report`` that writes one JSON line per event to a file descriptor (a pipe to the
    supervisor), unbuffered, so a line is out before the process exits."""

    def report(event: dict[str, Any]) -> None:
        line = (json.dumps(event) + "\n").encode()
        with contextlib.suppress(OSError):  # the supervisor is gone
            os.write(fd, line)

    return report


def stop_with_supervisor() -> None:
    """Stop this process gracefully, as on SIGTERM, once standard input closes: the
    supervisor holds the other end, so it closes when the supervisor dies."""

    def watch() -> None:
        try:
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


@dataclass
class _Process:
    """One running worker process and what it has reported."""

    index: int
    popen: subprocess.Popen[bytes]
    reports: int
    feed: int
    started_at: float
    pending: bytes = b""
    closed: bool = False
    started: bool = False
    summary: dict[str, int] | None = None
    #: The running jobs its stop gave up on (its shutdown timeout passed).
    unfinished: int = 0


@dataclass
class _Slot:
    """A place for one worker process: the process in it, or when to start the next."""

    process: _Process | None = None
    restart_at: float | None = None
    failures: int = 0
    done: bool = False


class Supervisor:
    """Run ``processes`` worker processes of ``worker_args`` (the ``worker`` command's
    arguments, the handler first) until SIGTERM or SIGINT, or, with ``burst``, until each
    has drained the queue; ``run()`` returns the exit status.

    The first process starts alone: if it exits before it has started its worker (a bad
    handler, an unreachable database), the supervisor exits with its status at once, with
    ``burst`` too. A process that dies unexpectedly afterwards is restarted after a pause
    that doubles from RESTART_BACKOFF_MIN up to RESTART_BACKOFF_MAX (logged as
    ``worker-process-exited``); with ``burst``, only one killed by a signal (one that exits
    on an error is not, so the burst ends, with EXIT_UNCLEAN).
    The summary counts what every process reported when it stopped; jobs finished by a
    process that was killed are not in it (they are in the archive).
    """

    def __init__(
        self,
        worker_args: Sequence[str],
        processes: int,
        *,
        burst: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.worker_args = list(worker_args)
        self.processes = processes
        self.burst = burst
        self.env = env
        self._slots = [_Slot() for _ in range(processes)]
        self._signals: list[int] = []
        self._selector = selectors.DefaultSelector()
        self._totals = {"succeeded": 0, "retried": 0, "failed": 0}
        #: The first signal taken (the stop is under way), and a second one (forced).
        self._stopping: int | None = None
        self._forced: int | None = None
        self._unclean = 0
        #: The running jobs the processes' stops gave up on.
        self._unfinished = 0
        self._restarts = 0
        self._ever_started = False

    def run(self) -> int:
        """Start the processes and supervise them until they have all stopped."""
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {signum: signal.signal(signum, self._on_signal) for signum in handled}
        try:
            self._spawn(0)
            status = self._supervise()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._selector.close()
        if status is not None:
            return status
        print(self.summary_text(), file=sys.stderr, flush=True)
        if self._forced is not None:
            return EXIT_FORCED + self._forced
        if self._unclean:
            return EXIT_UNCLEAN
        if self._unfinished:
            print(
                unfinished_text("sqla-proletarian", self._unfinished), file=sys.stderr, flush=True
            )
            return EXIT_JOBS_UNFINISHED
        return EXIT_JOBS_FAILED if self.burst and self._totals["failed"] else EXIT_OK

    def summary_text(self) -> str:
        counts = self._totals
        text = (
            f"sqla-proletarian: {self.processes} worker processes stopped: "
            f"{counts['succeeded']} succeeded, {counts['retried']} retried, "
            f"{counts['failed']} failed"
        )
        if self._restarts:
            text += f" ({self._restarts} restarted)"
        return text

    # --- the loop --------------------------------------------------------------------------

    def _supervise(self) -> int | None:
        """Until every process has ended: an exit status if the first could not start."""
        while True:
            self._read_reports(0.05)
            self._take_signals()
            for slot in self._slots:
                if slot.process is not None and slot.process.popen.poll() is not None:
                    failed = self._ended(slot, slot.process)
                    if failed is not None:
                        self._stop_all(signal.SIGTERM)
                        self._wait_all()
                        return failed
            now = time.monotonic()
            for index, slot in enumerate(self._slots):
                if self._stopping is not None or slot.process is not None or slot.done:
                    continue
                if slot.restart_at is not None and slot.restart_at <= now:
                    self._restarts += 1
                    self._spawn(index)
                elif slot.restart_at is None and index > 0 and self._ever_started:
                    self._spawn(index)
            if all(slot.process is None for slot in self._slots) and (
                self._stopping is not None or all(slot.done for slot in self._slots)
            ):
                return None

    def _spawn(self, index: int) -> None:
        reports, report_end = os.pipe()
        feed_end, feed = os.pipe()
        command = [
            *(sys.executable, "-m", "sqla_proletarian", "worker", *self.worker_args),
            *("--report-fd", str(report_end), "--process-index", str(index)),
        ]
        try:
            popen = subprocess.Popen(
                command, stdin=feed_end, pass_fds=(report_end,), env=self.env, process_group=0
            )
        finally:
            os.close(report_end)
            os.close(feed_end)
        os.set_blocking(reports, False)
        process = _Process(index, popen, reports, feed, time.monotonic())
        self._selector.register(reports, selectors.EVENT_READ, process)
        slot = self._slots[index]
        slot.process, slot.restart_at = process, None
        log_event(logging.DEBUG, "worker-process-started", index=index, pid=popen.pid)

    def _ended(self, slot: _Slot, process: _Process) -> int | None:
        """A process has exited: count it, and decide whether it comes back. An exit
        status when the first process could not start."""
        self._drain(process)
        if not process.closed:
            self._selector.unregister(process.reports)
        os.close(process.reports)
        os.close(process.feed)
        slot.process = None
        if process.summary is not None:
            for outcome, count in process.summary.items():
                self._totals[outcome] = self._totals.get(outcome, 0) + int(count)
        self._unfinished += process.unfinished
        code = process.popen.returncode
        if self._stopping is not None:
            if process.summary is None and not self._ended_unstarted(process, code):
                self._unclean += 1
            return None
        if not self._ever_started:
            # The first process could not start (a bad handler, the database away or its
            # tables missing): the others would fail alike, and they have not been started.
            return code if code > 0 else EXIT_UNCLEAN
        if (
            self.burst
            and code in (EXIT_OK, EXIT_JOBS_FAILED, EXIT_JOBS_UNFINISHED)
            and process.summary is not None
        ):
            slot.done = True
            return None
        if self.burst and code > 0:
            # It stopped on an error (a database refusing it...): another would too, and a
            # burst must end. A process killed by a signal is started again instead.
            slot.done = True
            self._unclean += 1
            return None
        ran = time.monotonic() - process.started_at
        slot.failures = 1 if ran >= HEALTHY_RUN else slot.failures + 1
        pause = min(RESTART_BACKOFF_MAX, RESTART_BACKOFF_MIN * 2 ** (slot.failures - 1))
        slot.restart_at = time.monotonic() + pause
        log_event(
            logging.WARNING,
            "worker-process-exited",
            index=process.index,
            pid=process.popen.pid,
            exit=_describe_exit(code),
            restart_in=pause,
        )
        return None

    def _ended_unstarted(self, process: _Process, code: int) -> bool:
        """Whether a process ended by a signal the supervisor forwarded before it had
        started its worker: it had no handlers yet and ran no job, so its end is clean (a
        SIGINT then ends the command as Ctrl-C does, with EXIT_INTERRUPTED)."""
        if process.started:
            return False
        forwarded = {signum for signum in (self._stopping, self._forced) if signum is not None}
        return -code in forwarded or (signal.SIGINT in forwarded and code == EXIT_INTERRUPTED)

    # --- reports ---------------------------------------------------------------------------

    def _read_reports(self, timeout: float) -> None:
        for key, _ in self._selector.select(timeout):
            self._drain(key.data)

    def _drain(self, process: _Process) -> None:
        """Read what the process has reported so far."""
        while True:
            try:
                chunk = os.read(process.reports, 65536)
            except BlockingIOError:
                return
            if not chunk:
                if not process.closed:
                    process.closed = True
                    self._selector.unregister(process.reports)
                return
            process.pending += chunk
            *lines, process.pending = process.pending.split(b"\n")
            for line in lines:
                self._take_report(process, line)

    def _take_report(self, process: _Process, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        if event.get("event") == "started":
            process.started = self._ever_started = True
        elif event.get("event") == "stopped" and isinstance(event.get("summary"), dict):
            process.summary = event["summary"]
            unfinished = event.get("unfinished")
            process.unfinished = unfinished if isinstance(unfinished, int) else 0

    # --- signals ---------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _take_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if self._stopping is None:
                self._stopping = signum
                running = sum(slot.process is not None for slot in self._slots)
                name = signal.Signals(signum).name
                print(
                    f"sqla-proletarian: {name} received, stopping {running} worker "
                    "processes gracefully...",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                self._forced = signum
            self._stop_all(signum)

    def _stop_all(self, signum: int) -> None:
        for slot in self._slots:
            slot.restart_at = None
            if slot.process is not None:
                slot.process.popen.send_signal(signum)

    def _wait_all(self) -> None:
        for slot in self._slots:
            if slot.process is not None:
                slot.process.popen.wait()
                self._ended(slot, slot.process)


def _describe_exit(code: int) -> str:
    """An exit status in words: ``status 1`` or ``SIGKILL``."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"
