"""What dependencies cost: a chain of jobs (each depending on the one before) and a fan-out
with one join depending on all its parts, each enqueued in one transaction and drained by
one worker (4 threads, this process), against the same number of independent jobs enqueued
and drained the same way, in transaction and in lease mode, interleaved over the rounds.

    python -m benchmarks.workflows [--jobs 1000] [--rounds 3] [--url URL]

The chain: ``--jobs`` enqueues in one transaction, each ``depends_on`` the one before, so at
most one of them is due at any time; the independent jobs: the same enqueues without
``depends_on``. The fan-out: ``enqueue_many`` of ``--jobs`` jobs and one join depending on
all of them; the independent jobs: the same ``enqueue_many`` and one more job without
``depends_on``. Prints, per server, mode and shape, the median jobs/s (min-max) of the
drain and of the enqueue, their ratio to the independent jobs', and what a drain must never
show, summed over the rounds: handler runs beyond one per job, ``job-transaction-lost``
events, and steps run out of order (a chain step before the one before it, the join before
a part). Writes the table into its own section of benchmarks/results.md.

The servers: the durable benchmark servers (scripts/benchdb.sh: PostgreSQL and MariaDB,
started and stopped by it, as ``make bench`` does), or ``--url``, an admin URL where a
scratch database is made and dropped.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import sqla_proletarian as sp
from benchmarks import server_work
from benchmarks.fill import check_drained, fresh_tables
from benchmarks.job import JOB_TYPE, PAYLOAD
from benchmarks.library import EVENTS, THREADS, count_events, run_until, worker
from benchmarks.limited_drain import MODES, engines
from benchmarks.report import RESULTS, library_commit, write_section

SECTION = "workflows"
#: The shapes, each drained with its dependencies and as independent jobs.
SHAPES = ("chain", "fan-in")
KINDS = ("with dependencies", "independent")


class OrderedRuns:
    """A no-op handler (advanced mode) that notes each job's runs, in the order they began."""

    def __init__(self) -> None:
        self.order: list[uuid.UUID] = []
        self._lock = threading.Lock()

    def __call__(self, job: sp.JobContext) -> None:
        with self._lock:
            self.order.append(job.job_id)


@dataclass
class Measured:
    """One drain: jobs/s of its enqueue and of its drain, and what it must never show."""

    enqueue: float
    drain: float
    counts: Counter[str] = field(default_factory=Counter)
    #: What the server did per job of the drain (benchmarks.server_work).
    work: dict[str, float] = field(default_factory=dict)


def enqueue_chain(conn: sa.Connection, jobs: int, linked: bool) -> list[uuid.UUID]:
    """``jobs`` enqueues, each depending on the one before when ``linked``."""
    ids: list[uuid.UUID] = []
    for _ in range(jobs):
        depends = {"depends_on": ids[-1:]} if linked and ids else {}
        ids.append(sp.enqueue(conn, JOB_TYPE, PAYLOAD, **depends))
    return ids


def enqueue_fan_in(conn: sa.Connection, jobs: int, linked: bool) -> list[uuid.UUID]:
    """``jobs`` parts by ``enqueue_many`` and one more job, the join of them all when
    ``linked``."""
    parts = sp.enqueue_many(conn, [(JOB_TYPE, PAYLOAD)] * jobs)
    depends = {"depends_on": parts} if linked else {}
    return [*parts, sp.enqueue(conn, JOB_TYPE, PAYLOAD, **depends)]


ENQUEUE: dict[str, Callable[[sa.Connection, int, bool], list[uuid.UUID]]] = {
    "chain": enqueue_chain,
    "fan-in": enqueue_fan_in,
}


def out_of_order(shape: str, ids: list[uuid.UUID], order: list[uuid.UUID]) -> int:
    """Steps that began before a dependency of theirs: in a chain, a step begun before the
    step before it; in a fan-in, a part begun after the join."""
    first: dict[uuid.UUID, int] = {}
    for index, job_id in enumerate(order):
        first.setdefault(job_id, index)
    if shape == "chain":
        return sum(1 for one, two in pairwise(ids) if first[two] < first[one])
    return sum(1 for part in ids[:-1] if first[part] > first[ids[-1]])


def one_drain(
    engine: sa.Engine, shape: str, linked: bool, jobs: int, options: dict[str, Any]
) -> Measured:
    """Enqueue one shape in one transaction and drain it with one worker of 4 threads."""
    fresh_tables(engine)
    started = time.perf_counter()
    with engine.begin() as conn:
        ids = ENQUEUE[shape](conn, jobs, linked)
    enqueued = time.perf_counter() - started
    total = len(ids)
    runs = OrderedRuns()
    before = Counter(EVENTS.counts)
    with server_work.metered(engine.url, total):
        elapsed = run_until(worker(engine, runs, handler_mode="advanced", **options), total)
    check_drained(engine, total, f"{shape} {'linked' if linked else 'independent'} {options}")
    logged = EVENTS.counts - before
    counts = Counter(
        {
            "extra runs": len(runs.order) - len(set(runs.order)),
            "job-transaction-lost": logged["job-transaction-lost"],
            "out of order": out_of_order(shape, ids, runs.order) if linked else 0,
        }
    )
    return Measured(total / enqueued, total / elapsed, counts, server_work.take() or {})


def work_text(drains: list[Measured]) -> str:
    """What the server did per job of these drains, the median of each figure."""
    return server_work.median_text([one.work for one in drains if one.work])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--jobs", type=int, default=1000, help="jobs in the chain, parts of the fan-out (1,000)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds, interleaved (3)")
    parser.add_argument(
        "--url",
        help="admin URL of one server (a scratch database is made there); default: the "
        "durable benchmark servers (scripts/benchdb.sh), PostgreSQL and MariaDB",
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="the Markdown file")
    parser.add_argument("--keep-servers", action="store_true", help="leave the servers running")
    return parser.parse_args()


def main() -> int:
    args = parse()
    command = shlex.join(["python", "-m", "benchmarks.workflows", *sys.argv[1:]])
    started_at, started = datetime.now(UTC), time.perf_counter()
    count_events()
    measured: dict[tuple[str, str, str, str], list[Measured]] = {}
    lines: list[str] = []
    bad = 0
    with engines(args) as found:
        for engine in found:
            with engine.connect() as conn:
                version = ".".join(map(str, conn.dialect.server_version_info or ()))
            server = f"{engine.dialect.name} {version}"
            print(f"{server}: {args.jobs:,} jobs a shape, {THREADS} threads", flush=True)
            for round_ in range(args.rounds):
                kinds = KINDS if round_ % 2 == 0 else KINDS[::-1]
                for mode, options in MODES.items():
                    for shape in SHAPES:
                        for kind in kinds:
                            linked = kind == "with dependencies"
                            one = one_drain(engine, shape, linked, args.jobs, options)
                            measured.setdefault((server, mode, shape, kind), []).append(one)
                            print(
                                f"  round {round_ + 1} {mode:16} {shape:6} {kind:17} "
                                f"drain {one.drain:8,.0f} jobs/s, enqueue {one.enqueue:8,.0f} "
                                f"jobs/s {dict(+one.counts) or ''}",
                                flush=True,
                            )
            for mode in MODES:
                for shape in SHAPES:
                    linked = measured[server, mode, shape, "with dependencies"]
                    free = measured[server, mode, shape, "independent"]
                    counts = sum((one.counts for one in linked + free), Counter[str]())
                    bad += sum(counts.values())
                    drain = [one.drain for one in linked]
                    enqueue = [one.enqueue for one in linked]
                    free_drain = [one.drain for one in free]
                    free_enqueue = [one.enqueue for one in free]
                    drain_ratio = statistics.median(drain) / statistics.median(free_drain)
                    enqueue_ratio = statistics.median(enqueue) / statistics.median(free_enqueue)
                    lines.append(
                        f"| {server} | {mode} | {shape} | {spread(drain)} | {spread(free_drain)} "
                        f"| {drain_ratio:.2f} | {work_text(linked)} | {work_text(free)} "
                        f"| {spread(enqueue)} | {spread(free_enqueue)} "
                        f"| {enqueue_ratio:.2f} | {counts['extra runs']} "
                        f"| {counts['job-transaction-lost']} | {counts['out of order']} |"
                    )
    minutes = (time.perf_counter() - started) / 60
    header = [
        "## Workflows: chains and fan-ins (`python -m benchmarks.workflows`)",
        "",
        f"- Command: `{command}`; run {started_at:%Y-%m-%d %H:%M} UTC, {minutes:.1f} min, "
        f"{library_commit()}.",
        f"- Chain: {args.jobs:,} jobs enqueued one by one in one transaction, each depending "
        f"on the one before; fan-in: `enqueue_many` of {args.jobs:,} parts and one join "
        "depending on all of them. Each against the same enqueues without `depends_on`; one "
        f"worker of {THREADS} threads drains each; {args.rounds} round(s), interleaved; each "
        "cell is the median over the rounds (min-max); a ratio is the shape's over its "
        "independent jobs'.",
        "- Extra runs (a job's handler run more than once), `job-transaction-lost` and steps "
        "out of order (a step begun before its dependency's end) are summed over the rounds, "
        "both kinds of drain: each must be 0.",
        "- Server per job: the median over the rounds of what the server did per job of the"
        " drain (benchmarks.server_work: PostgreSQL's WAL bytes; MariaDB's redo bytes, rows"
        " written and statements).",
        "",
        "| server | mode | shape | drain jobs/s | independent | / independent "
        "| server per job | independent "
        "| enqueue jobs/s | independent | / independent | extra runs | lost | out of order |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    body = "\n".join([*header, *lines])
    print(body)
    write_section(args.output, SECTION, body)
    print(f"\nwritten to {args.output} ({minutes:.1f} min)")
    if bad:
        print(f"\nFAILED: {bad} extra runs, lost transactions or steps out of order", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
