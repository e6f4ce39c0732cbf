"""A queue worker process for the crash and signal tests, run as a subprocess.

    python worker.py DATABASE_URL EVENTS_FILE [--hang-type T] [--hang-seconds S]
                     [--exit-after N] [--signals] [--threads N] [--max-unclean-ends N]
                     [--slow-exit-hook S]

The handler (advanced mode) appends ``start <job_id> <attempts> <pid>`` to EVENTS_FILE when
a job starts and ``end <job_id> <pid>`` when it returns, so a test can see which jobs run
and when one is mid-run. Jobs of type ``--hang-type`` sleep ``--hang-seconds`` first.
With ``--exit-after N`` the process stops its worker and exits 0 once N jobs have an
outcome; with ``--signals`` the worker installs its SIGINT/SIGTERM handlers and the main
thread returns as soon as the worker has stopped, so the signal decides how the process
ends. ``--slow-exit-hook S`` registers an atexit hook that takes S seconds off the main
thread (a slow log shipper, say), which the exit after a signal runs.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
import time

import sqlalchemy as sa

import sqla_proletarian as sp


def slow_off_the_main_thread(seconds: float) -> None:
    if threading.current_thread() is not threading.main_thread():
        time.sleep(seconds)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("events")
    parser.add_argument("--hang-type", default=None)
    parser.add_argument("--hang-seconds", type=float, default=60.0)
    parser.add_argument("--exit-after", type=int, default=None)
    parser.add_argument("--signals", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-unclean-ends", type=int, default=3)
    parser.add_argument("--slow-exit-hook", type=float, default=0.0)
    args = parser.parse_args()
    if args.slow_exit_hook:
        atexit.register(slow_off_the_main_thread, args.slow_exit_hook)

    def record(line: str) -> None:
        with open(args.events, "a", encoding="utf-8") as events:
            events.write(line + "\n")

    def handler(job: sp.JobContext) -> None:
        record(f"start {job.job_id} {job.attempts} {os.getpid()}")
        if job.job_type == args.hang_type:
            time.sleep(args.hang_seconds)
        record(f"end {job.job_id} {os.getpid()}")

    engine = sa.create_engine(args.url)
    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        worker_threads=args.threads,
        polling_interval=0.02,
        install_signal_handlers=args.signals,
        max_unclean_ends=args.max_unclean_ends,
        worker_id=f"test-worker-{os.getpid()}",
    )
    worker.start()
    record(f"ready {os.getpid()}")
    try:
        while worker.running:
            if args.exit_after is not None and sum(worker.summary().values()) >= args.exit_after:
                worker.stop()
                break
            time.sleep(0.02)
    finally:
        engine.dispose()
    print(f"exiting: {worker.summary_text()}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
