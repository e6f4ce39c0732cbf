"""What queue limits cost a drain that they never hold back: one worker (4 threads, this
process) drains a queue of no-op jobs without limits, then with ``max_running`` far above
its threads and a ``rate_limit`` above its speed, in transaction and in lease mode, at each
batch size, interleaved over the rounds (each round turns the order of the drains).

    python -m benchmarks.limited_drain [--jobs 10000] [--rounds 3] [--batch-sizes 1,50]
        [--max-running 1000] [--rate 1000000/1] [--split] [--url URL]

The servers: the durable benchmark servers (scripts/benchdb.sh: PostgreSQL and MariaDB,
started and stopped by it, as ``make bench`` does), or ``--url``, an admin URL where a
scratch database is made and dropped. ``--split`` adds a drain under each limit on its own,
to tell their costs apart. Prints the median jobs/s (min-max) of each drain and its ratio to
the unlimited one, and writes the table into its own section of benchmarks/results.md; a
drain close to the rate limit is flagged, as the limit may then have held it back.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import sqla_proletarian as sp
from benchmarks import server_work
from benchmarks.fill import check_drained, fill, fresh_tables
from benchmarks.library import THREADS, count_events, run_until, worker
from benchmarks.report import RESULTS, write_section
from benchmarks.servers import durable_servers

#: The queue ``fill`` puts the jobs in.
QUEUE = "default"
#: Each mode's worker options; the lease far longer than any drain's job needs.
MODES: dict[str, dict[str, Any]] = {
    "transaction mode": {},
    "lease mode": {"lease_seconds": 60.0},
}
SCRATCH = "limited_drain_bench"
SECTION = "limits"


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
    with server_work.metered(engine.url, jobs):
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
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs per drain (10,000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, interleaved (3)")
    parser.add_argument("--max-running", type=int, default=1000, help="max_running (1000)")
    parser.add_argument(
        "--rate", default="1000000/1", help="rate_limit as COUNT/SECONDS (1000000/1)"
    )
    parser.add_argument(
        "--batch-sizes", default="1,50", help="the workers' batch sizes, comma-separated (1,50)"
    )
    parser.add_argument(
        "--split", action="store_true", help="also drain under each limit on its own"
    )
    parser.add_argument(
        "--url",
        help="admin URL of one server (a scratch database is made there); default: the "
        "durable benchmark servers (scripts/benchdb.sh), PostgreSQL and MariaDB",
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="the Markdown file")
    parser.add_argument("--keep-servers", action="store_true", help="leave the servers running")
    return parser.parse_args()


@contextmanager
def engines(args: argparse.Namespace) -> Iterator[list[sa.Engine]]:
    """The engines to drain on: a scratch database on ``--url``, else the durable servers'
    benchmark databases."""
    if args.url:
        with scratch(args.url) as engine:
            yield [engine]
        return
    with durable_servers(keep=args.keep_servers) as servers:
        found = [server.engine() for server in servers]
        try:
            yield found
        finally:
            for engine in found:
                engine.dispose()


def main() -> int:
    args = parse()
    command = shlex.join(["python", "-m", "benchmarks.limited_drain", *sys.argv[1:]])
    started_at, started = datetime.now(UTC), time.perf_counter()
    drains = variants(args)
    batches = [int(size) for size in args.batch_sizes.split(",")]
    count_events()
    rates: dict[tuple[str, str, int, str], list[float]] = {}
    work: dict[tuple[str, str, int, str], list[dict[str, float]]] = {}
    lines: list[str] = []
    with engines(args) as found:
        for engine in found:
            with engine.connect() as conn:
                version = ".".join(map(str, conn.dialect.server_version_info or ()))
            server = f"{engine.dialect.name} {version}"
            print(
                f"{server}: {args.jobs:,} no-op jobs, {THREADS} threads; "
                + "; ".join(
                    f"{name} = {sp.QueueLimits(**limits).describe()}"
                    for name, limits in drains.items()
                    if limits is not None
                ),
                flush=True,
            )
            names = list(drains)
            for round_ in range(args.rounds):
                turned = round_ % len(names)
                order = names[turned:] + names[:turned]
                for mode, options in MODES.items():
                    for batch in batches:
                        for name in order:
                            value = one_drain(
                                engine, args.jobs, {**options, "batch_size": batch}, drains[name]
                            )
                            rates.setdefault((server, mode, batch, name), []).append(value)
                            figures = server_work.take()
                            if figures:
                                work.setdefault((server, mode, batch, name), []).append(figures)
                            print(
                                f"  round {round_ + 1} {mode:16} batch {batch:<3} {name:16} "
                                f"{value:8,.0f} jobs/s",
                                flush=True,
                            )
            for mode in MODES:
                for batch in batches:
                    free = statistics.median(rates[server, mode, batch, "unlimited"])
                    for name, limits in drains.items():
                        values = rates[server, mode, batch, name]
                        held = statistics.median(values)
                        rate = (limits or {}).get("rate_limit")
                        near = rate is not None and held > 0.8 * rate[0] / rate[1]
                        flag = " (near the rate limit: it may have held the drain back)"
                        lines.append(
                            f"| {server} | {mode} | {batch} | {name} | {spread(values)} | "
                            f"{server_work.median_text(work.get((server, mode, batch, name), []))}"
                            f" | {held / free:.2f}{flag if near else ''} |"
                        )
    minutes = (time.perf_counter() - started) / 60
    header = [
        "## Queue limits that never bind (`python -m benchmarks.limited_drain`)",
        "",
        f"- Command: `{command}`; run {started_at:%Y-%m-%d %H:%M} UTC, {minutes:.1f} min.",
        f"- One worker of {THREADS} threads drains {args.jobs:,} no-op jobs; {args.rounds} "
        "round(s), interleaved; each cell is the median over the rounds (min-max); the ratio "
        "is the drain's over the unlimited one of the same server, mode and batch size.",
        f"- Limits: max_running={args.max_running}, rate_limit={args.rate} (far above the "
        "threads and the drain's speed: they cost their checks, and hold nothing back).",
        "- Server per job: the median over the rounds of what the server did per job"
        " (benchmarks.server_work: PostgreSQL's WAL bytes; MariaDB's redo bytes, rows written"
        " and statements).",
        "",
        "| server | mode | batch_size | drain | jobs/s | server per job | / unlimited |",
        "|---|---|---|---|---|---|---|",
    ]
    body = "\n".join([*header, *lines])
    print(body)
    write_section(args.output, SECTION, body)
    print(f"\nwritten to {args.output} ({minutes:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
