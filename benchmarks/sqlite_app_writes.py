"""How the application's own writes fare on a SQLite file beside a worker of three threads.

    .venv/bin/python -m benchmarks.sqlite_app_writes [--jobs 2000] [--seconds 15] [--folder F]

Two phases on a fresh file in a temporary folder. Busy: the worker drains ``--jobs`` no-op
jobs while an application thread, with an engine of its own (SQLAlchemy's defaults, so
pysqlite's 5 s busy timeout), commits one small INSERT every 10 ms. Idle: the same writer
beside the same worker with an empty queue, for ``--seconds``. Each phase prints the
application's writes per second, its slowest write, its failures ("database is locked")
and, when busy, the worker's jobs per second. A third phase drains as many jobs without the
application, for the worker's own pace. It prints; nothing gates on a time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import sqla_proletarian as sp

APP = sa.Table(
    "app_event",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("note", sa.String(50)),
)


#: Seconds the busy phase may take at most (it ends when the queue is drained).
DEADLINE = 180.0
#: Seconds the application waits between its writes, as a busy app's requests would.
PAUSE = 0.01


class AppWriter(threading.Thread):
    """Commits one small INSERT every ``PAUSE`` seconds until told to stop, timing each."""

    def __init__(self, engine: sa.Engine) -> None:
        super().__init__(name="app-writer", daemon=True)
        self.engine = engine
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            start = time.monotonic()
            try:
                with self.engine.begin() as conn:
                    conn.execute(sa.insert(APP), {"note": "an application write"})
            except sa.exc.OperationalError as exc:
                self.failures.append(str(exc.orig))
            self.latencies.append(time.monotonic() - start)
            self.done.wait(PAUSE)

    def report(self, seconds: float) -> str:
        writes = len(self.latencies) - len(self.failures)
        worst = max(self.latencies, default=0.0)
        median = statistics.median(self.latencies) if self.latencies else 0.0
        return (
            f"app: {writes / seconds:8.1f} writes/s, median {median * 1000:7.1f} ms, "
            f"max {worst * 1000:7.1f} ms, {len(self.failures)} failed"
        )


def phase(url: str, jobs: int, seconds: float, *, app: bool = True) -> None:
    """One phase: ``jobs`` to drain (0: an idle worker for ``seconds``), beside the
    application's writer or alone."""
    worker_engine = sa.create_engine(url)
    app_engine = sa.create_engine(url)
    with Session(worker_engine) as session:
        sp.enqueue_many(session, [("noop", {"n": n}) for n in range(jobs)])
        session.commit()
    writer = AppWriter(app_engine)
    worker = sp.create_queue_worker(worker_engine, _noop, worker_threads=3)
    start = time.monotonic()
    with worker:
        if app:
            writer.start()
        while time.monotonic() - start < (DEADLINE if jobs else seconds):
            if jobs and worker.summary()["succeeded"] >= jobs:
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - start
        writer.done.set()
        if app:
            writer.join()
    name = f"busy ({jobs} jobs)" if jobs else "idle"
    line = f"{name:>18}: {writer.report(elapsed) if app else 'no app writes':<72}"
    if jobs:
        done = worker.summary()["succeeded"]
        line += f"; worker: {done / elapsed:7.1f} jobs/s ({done} in {elapsed:.1f} s)"
    print(line, flush=True)
    worker_engine.dispose()
    app_engine.dispose()


def _noop(job_type: str, payload: Any) -> None:
    """A job that does nothing."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--folder", help="where the file goes (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        url = f"sqlite:///{Path(folder) / 'jobs.db'}"
        engine = sa.create_engine(url)
        sp.metadata.create_all(engine)
        APP.create(engine)
        engine.dispose()
        phase(url, args.jobs, args.seconds)
        phase(url, 0, args.seconds)
        phase(url, args.jobs, args.seconds, app=False)


if __name__ == "__main__":
    main()
