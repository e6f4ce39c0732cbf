"""A worker process with signal handlers, for the lifecycle tests, run as a subprocess.

    python lifecycle_worker.py DATABASE_URL EVENTS_FILE MODE [--hang-seconds S]
                               [--atexit-file PATH] [--log-file PATH]

The handler (advanced mode) appends ``start <job_id>`` and ``end <job_id>`` to EVENTS_FILE;
jobs of type ``slow`` sleep ``--hang-seconds`` in between. The program appends ``ready``
once the worker runs, and other marks named below. MODE says where the main thread is when
the signal comes:

- ``wait``: in ``worker.wait()``; ``main-returned`` if it ever returns.
- ``in-stop``: inside ``worker.stop()``: a log handler sends the process SIGTERM when stop()
  logs ``shutting-down`` and sleeps, so the signal handler runs there.
- ``in-summary``: once a job has started, inside ``worker.summary()``, holding its lock (a
  trace function sends SIGTERM at its ``return`` line and sleeps); then ``summary-returned``
  and ``worker.wait()``.
- ``on-shutdown-stops``: in ``worker.wait()``; the on_shutdown callback calls
  ``worker.stop()`` and appends ``on-shutdown-returned`` when that returns.
- ``writing``: writing to standard error without end (``writing`` first), through a stream
  that refuses a write from inside another write of the same thread, as ``io``'s buffered
  writer does ("reentrant call"); each of the main thread's writes lasts 50 ms.

``--atexit-file`` registers an atexit handler that writes that file; ``--log-file`` sends
the library's INFO events to that file through a MemoryHandler that only writes them out
when logging is shut down.
"""

from __future__ import annotations

import argparse
import atexit
import linecache
import logging
import logging.handlers
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import sqlalchemy as sa

import sqla_proletarian as sp


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("events")
    parser.add_argument("mode")
    parser.add_argument("--hang-seconds", type=float, default=60.0)
    parser.add_argument("--atexit-file", default=None)
    parser.add_argument("--log-file", default=None)
    args = parser.parse_args()

    def record(line: str) -> None:
        with open(args.events, "a", encoding="utf-8") as events:
            events.write(line + "\n")

    job_started = threading.Event()

    def handler(job: sp.JobContext) -> None:
        record(f"start {job.job_id}")
        job_started.set()
        if job.job_type == "slow":
            time.sleep(args.hang_seconds)
        record(f"end {job.job_id}")

    if args.atexit_file is not None:
        atexit.register(Path(args.atexit_file).write_text, "atexit ran\n", encoding="utf-8")
    if args.log_file is not None:
        target = logging.FileHandler(args.log_file, delay=True)
        buffered = logging.handlers.MemoryHandler(
            10_000, flushLevel=logging.CRITICAL + 1, target=target
        )
        library = logging.getLogger("sqla_proletarian")
        library.setLevel(logging.INFO)
        library.addHandler(buffered)

    def on_shutdown() -> None:
        if args.mode == "on-shutdown-stops":
            worker.stop()
            record("on-shutdown-returned")

    engine = sa.create_engine(args.url)
    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        polling_interval=0.02,
        install_signal_handlers=True,
        on_shutdown=on_shutdown,
        worker_id=f"lifecycle-{os.getpid()}",
    )
    if args.mode == "in-stop":
        logging.getLogger("sqla_proletarian").setLevel(logging.INFO)
        logging.getLogger("sqla_proletarian").addHandler(_SignalOn("shutting-down"))
    worker.start()
    record("ready")
    if args.mode == "in-stop":
        worker.stop()
    elif args.mode == "in-summary":
        job_started.wait(30)
        sys.settrace(_signal_inside(sp.QueueWorker.summary.__code__))
        worker.summary()
        sys.settrace(None)
        record("summary-returned")
    elif args.mode == "writing":
        sys.stderr = _GuardedStream(sys.stderr)
        record("writing")
        while True:
            sys.stderr.write(".")
    worker.wait()
    record("main-returned")
    return 0


class _GuardedStream:
    """A text stream behind a lock, like io.BufferedWriter's: a write from inside another
    write of the same thread (a signal handler's print) raises "reentrant call"."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.owner: int | None = None

    def write(self, text: str) -> int:
        if self.owner == threading.get_ident():
            raise RuntimeError(f"reentrant call inside {self.stream!r}")
        with self.lock:
            self.owner = threading.get_ident()
            try:
                self.stream.write(text)
                self.stream.flush()
                if threading.current_thread() is threading.main_thread():
                    time.sleep(0.05)
            finally:
                self.owner = None
        return len(text)

    def flush(self) -> None:
        with self.lock:
            self.stream.flush()


class _SignalOn(logging.Handler):
    """Send the process SIGTERM when ``event`` is logged, and let the signal handler run
    while the logging call (and what called it) is still under way."""

    def __init__(self, event: str) -> None:
        super().__init__()
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == self.event:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)


def _signal_inside(code: Any) -> Any:
    """A trace function that sends SIGTERM once, at the ``return`` line of ``code``."""
    fired = False

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal fired
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if event == "line" and not fired and line.startswith("return"):
            fired = True
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the signal handler runs in here, under summary()'s lock
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        return local if event == "call" and frame.f_code is code else None

    return tracer


if __name__ == "__main__":
    sys.exit(main())
