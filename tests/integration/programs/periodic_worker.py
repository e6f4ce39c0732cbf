"""A worker process with one periodic job, for the periodic-job tests, run as a subprocess.

    python periodic_worker.py DATABASE_URL CLOCK_FILE EVERY_SECONDS

Its clock reads the time from CLOCK_FILE (ISO 8601, written by the test), so every process
sees the same instant and the test moves time on step by step. It prints ``ready`` once its
worker runs and stops on SIGTERM.
"""

from __future__ import annotations

import sys
from datetime import datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

import sqla_proletarian as sp


def main() -> int:
    url, clock_file, every = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])

    def clock() -> datetime:
        return datetime.fromisoformat(clock_file.read_text().strip())

    engine = sa.create_engine(url)
    worker = sp.create_queue_worker(
        engine,
        lambda job_type, payload: None,
        polling_interval=0.02,
        install_signal_handlers=True,
        clock=clock,
        periodic_jobs=[sp.PeriodicJob("tick", every=timedelta(seconds=every))],
    )
    worker.start()
    print("ready", flush=True)
    worker.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
