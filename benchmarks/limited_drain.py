"""What queue limits cost a drain that they never hold back: one worker (4 threads, this
process) drains a queue of no-op jobs without limits, then with ``max_running`` far above
its threads and a ``rate_limit`` above its speed, in transaction and in lease mode,
interleaved over the rounds (each round turns the order of the drains).

    bash scripts/testdb.sh start; source /tmp/sqla-proletarian-testdb/env
    .venv/bin/python -m benchmarks.limited_drain [--jobs 20000] [--rounds 3]
        [--max-running 1000] [--rate 10000/1] [--split] [--url URL]

The server: ``--url``, else ``SP_TEST_POSTGRESQL_URL`` (an admin URL; the benchmark makes a
scratch database there and drops it at the end). ``--split`` adds a drain under each limit
on its own, to tell their costs apart. Prints, per mode, the median jobs/s (min-max) of each
drain and its ratio to the unlimited one; a drain close to the rate limit is flagged, as the
limit may then have held it back. (10,000 is the largest count a rate limit takes.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

import sqla_proletarian as sp
from benchmarks.fill import check_drained, fill, fresh_tables
from benchmarks.library import THREADS, count_events, run_until, worker

#: The queue ``fill`` puts the jobs in.
QUEUE = "default"
#: Each mode's worker options; the lease far longer than any drain's job needs.
MODES: dict[str, dict[str, Any]] = {
    "transaction mode": {},
    "lease mode": {"lease_seconds": 60.0},
}
SCRATCH = "limited_drain_bench"


@contextmanager
def scratch(admin_url: str) -> Iterator[sa.Engine]:
    """A fresh database on the server of ``admin_url``, dropped at the end."""
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {SCRATCH}")
        conn.exec_driver_sql(f"CREATE DATABASE {SCRATCH}")
    engine = sa.create_engine(
        sa.make_url(admin_url).set(database=SCRATCH), pool_size=2 * THREADS + 2
    )
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {SCRATCH}")
        admin.dispose()


def one_drain(engine: sa.Engine, jobs: int, options: dict[str, Any], limits: Any) -> float:
    """Jobs/s of one drain of ``jobs`` queued no-op jobs, under ``limits`` (None: none)."""
    fresh_tables(engine)
    fill(engine, jobs)
    if limits is not None:
        with engine.begin() as conn:
            sp.set_queue_limits(conn, QUEUE, **limits)
    elapsed = run_until(worker(engine, **options), jobs)
    check_drained(engine, jobs, f"{options} {limits}")
    return jobs / elapsed


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def variants(args: argparse.Namespace) -> dict[str, dict[str, Any] | None]:
    """The drains of each mode: none, and the limits (with ``--split``, each on its own)."""
    count, seconds = args.rate.split("/")
    rate = (int(count), float(seconds))
    found: dict[str, dict[str, Any] | None] = {
        "unlimited": None,
        "limited": {"max_running": args.max_running, "rate_limit": rate},
    }
    if args.split:
        found["max_running only"] = {"max_running": args.max_running}
        found["rate_limit only"] = {"rate_limit": rate}
    return found


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per drain (20,000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, interleaved (3)")
    parser.add_argument("--max-running", type=int, default=1000, help="max_running (1000)")
    parser.add_argument(
        "--rate", default="10000/1", help="rate_limit as COUNT/SECONDS (10000/1, the largest count)"
    )
    parser.add_argument(
        "--split", action="store_true", help="also drain under each limit on its own"
    )
    parser.add_argument("--url", help="admin URL of the server (SP_TEST_POSTGRESQL_URL)")
    return parser.parse_args()


def main() -> int:
    args = parse()
    url = args.url or os.environ.get("SP_TEST_POSTGRESQL_URL")
    if not url:
        print(
            "limited_drain: give --url, or source /tmp/sqla-proletarian-testdb/env for "
            "SP_TEST_POSTGRESQL_URL",
            file=sys.stderr,
        )
        return 2
    drains = variants(args)
    count_events()
    rates: dict[tuple[str, str], list[float]] = {
        (mode, name): [] for mode in MODES for name in drains
    }
    with scratch(url) as engine:
        with engine.connect() as conn:
            version = ".".join(map(str, conn.dialect.server_version_info or ()))
        print(
            f"{engine.dialect.name} {version}: {args.jobs:,} no-op jobs, {THREADS} threads; "
            + "; ".join(
                f"{name} = {sp.QueueLimits(**limits).describe()}"
                for name, limits in drains.items()
                if limits is not None
            )
        )
        names = list(drains)
        for round_ in range(args.rounds):
            turned = round_ % len(names)
            order = names[turned:] + names[:turned]
            for mode, options in MODES.items():
                for name in order:
                    value = one_drain(engine, args.jobs, options, drains[name])
                    rates[mode, name].append(value)
                    print(f"  round {round_ + 1} {mode:16} {name:16} {value:8,.0f} jobs/s")
    print(f"{'mode':16} {'drain':16} {'jobs/s':>24} {'/ unlimited':>11}")
    for mode in MODES:
        free = statistics.median(rates[mode, "unlimited"])
        for name, limits in drains.items():
            held = statistics.median(rates[mode, name])
            rate = (limits or {}).get("rate_limit")
            near = rate is not None and held > 0.8 * rate[0] / rate[1]
            flag = "  (near the rate limit: it may have held the drain back)" if near else ""
            print(f"{mode:16} {name:16} {spread(rates[mode, name]):>24} {held / free:11.2f}{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
