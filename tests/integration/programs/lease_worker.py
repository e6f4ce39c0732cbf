"""A lease-mode queue worker process for the lease tests, run as a subprocess.

    python lease_worker.py DATABASE_URL EVENTS_FILE --lease-seconds S
                           [--heartbeat-interval S] [--hang-type T] [--hold-file PATH]
                           [--await-cancel S] [--exit-after N] [--signals]
                           [--max-unclean-ends N]

The handler (advanced mode) appends ``start <job_id> <attempts> <pid>`` to EVENTS_FILE when
a job starts and ``end <job_id> <pid>`` when it returns. Jobs of type ``--hang-type`` wait
until ``--hold-file`` exists (at most a minute) before they go on; with ``--await-cancel S``
they then wait up to S seconds for ``job.cancel_requested`` and append ``cancel <job_id>
<pid> True|False``. Every job writes the
note ``<job_id> <pid>`` to ``lease_notes`` through ``job.session``, after any wait, so a
test can tell which run's writes committed. ``--exit-after N`` stops the worker and exits 0
once N jobs have an outcome; with ``--signals`` SIGINT/SIGTERM stop it gracefully.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import sqlalchemy as sa

import sqla_proletarian as sp

NOTES = sa.table("lease_notes", sa.column("text", sa.String))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("events")
    parser.add_argument("--lease-seconds", type=float, required=True)
    parser.add_argument("--heartbeat-interval", type=float, default=None)
    parser.add_argument("--hang-type", default=None)
    parser.add_argument("--hold-file", type=Path, default=None)
    parser.add_argument("--await-cancel", type=float, default=None)
    parser.add_argument("--exit-after", type=int, default=None)
    parser.add_argument("--signals", action="store_true")
    parser.add_argument("--max-unclean-ends", type=int, default=3)
    args = parser.parse_args()

    def record(line: str) -> None:
        with open(args.events, "a", encoding="utf-8") as events:
            events.write(line + "\n")

    def handler(job: sp.JobContext) -> None:
        record(f"start {job.job_id} {job.attempts} {os.getpid()}")
        if job.job_type == args.hang_type:
            deadline = time.monotonic() + 60
            while not (args.hold_file and args.hold_file.exists()):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            if args.await_cancel is not None:
                asked = job.cancel_requested.wait(args.await_cancel)
                record(f"cancel {job.job_id} {os.getpid()} {asked}")
        job.session.execute(sa.insert(NOTES).values(text=f"{job.job_id} {os.getpid()}"))
        record(f"end {job.job_id} {os.getpid()}")

    engine = sa.create_engine(args.url)
    lease = {"lease_seconds": args.lease_seconds}
    if args.heartbeat_interval is not None:
        lease["heartbeat_interval"] = args.heartbeat_interval
    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        **lease,
        polling_interval=0.02,
        install_signal_handlers=args.signals,
        max_unclean_ends=args.max_unclean_ends,
        worker_id=f"lease-worker-{os.getpid()}",
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
